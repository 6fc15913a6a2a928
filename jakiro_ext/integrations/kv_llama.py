"""What the EAGLE and Medusa adapters share: both peers ship the same copy of transformers 4.3x's
Llama with one preallocated KV buffer (``modeling_llama_kv``: EAGLE-1's is Medusa's, re-documented),
a dense tree mask set on the model, and the tree's nodes in breadth-first order.

Running that code on transformers 5 (:func:`fix_classes`, :func:`rebuild_rotary`): its attention's
``_init_rope`` indexes ``config.rope_scaling["type"]``, which transformers 5 makes an alias of
``rope_parameters`` (never None); its ``_tied_weights_keys`` is a list where transformers 5 wants a
dict; transformers 5 builds a model on the meta device, leaving the rotary buffers (not in the
checkpoint) as uninitialised memory (NaN logits); and the rotary tables are built with base 10,000
whatever the model's ``rope_theta`` (100,000 on SmolLM2): a silent error on 4.x too.

Our ops in that code (each peer's module patches its own functions with these):
:func:`packed_mask` (the dense tree mask bit-packed), :func:`tree_attention_forward` (the attention
over the peer's KV buffer), :func:`model_forward` (the whole target forward as ``decoder_layers``),
:func:`verify` (``verify_tree`` over every node's logits, the accepted path mapped back to the
peer's ``retrieve_indices``) and :func:`commit` (``compact_kv`` on the one buffer).
"""
from __future__ import annotations

import contextlib

import torch
from transformers.modeling_outputs import BaseModelOutputWithPast

from jakiro_ext import ops
from jakiro_ext.ops.masks import causal_tree_mask, pack_bits

STATE: dict = {}  # what one patched function hands the next within a step (both peers decode one sequence)


# ----------------------------------------------------------------------------- transformers 5
def rope_theta(config) -> float:
    """The model's RoPE base (transformers 5 keeps it in ``rope_parameters``)."""
    parameters = getattr(config, "rope_parameters", None) or {}
    return float(parameters.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def _init_rope(rotary_class):
    def init(self):
        parameters = getattr(self.config, "rope_parameters", None) or {}
        kind = parameters.get("rope_type", "default")
        if kind != "default":
            raise NotImplementedError(f"{type(self).__module__} on transformers 5 here: RoPE type {kind!r} is not "
                                      "supported (default only)")
        self.rotary_emb = rotary_class(self.head_dim, max_position_embeddings=self.max_position_embeddings,
                                       base=rope_theta(self.config))
    return init


def fix_classes(*modules) -> None:
    """Patch a peer's Llama modules (``modeling_llama_kv``, EAGLE's ``cnets``) for transformers 5:
    RoPE set up from ``rope_parameters`` with the model's base, tied-weight keys as a dict.
    Idempotent."""
    for module in modules:
        module.LlamaAttention._init_rope = _init_rope(module.LlamaRotaryEmbedding)
        if hasattr(module, "LlamaForCausalLM"):
            module.LlamaForCausalLM._tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}


def rebuild_rotary(model: torch.nn.Module, *modules) -> torch.nn.Module:
    """Recompute every rotary table of ``model`` whose class is one of ``modules``' (left
    uninitialised by transformers 5's meta-device load)."""
    classes = tuple(module.LlamaRotaryEmbedding for module in modules)
    for module in model.modules():
        rotary = getattr(module, "rotary_emb", None)
        if isinstance(rotary, classes) and hasattr(module, "head_dim"):
            device = next(module.parameters()).device
            module.rotary_emb = type(rotary)(module.head_dim, max_position_embeddings=rotary.max_position_embeddings,
                                             base=rotary.base, device=device).to(device)
    return model


# ----------------------------------------------------------------------------- the target forward
def parents_of(tree_attn_mask: torch.Tensor) -> torch.Tensor:
    """Parents [1, T] int64 of a dense ancestor mask [1, 1, T, T] (1: sees) over nodes in
    breadth-first order (EAGLE's, Medusa's): a node's parent is its highest-index ancestor."""
    sees = tree_attn_mask.reshape(tree_attn_mask.shape[-2:]).bool().clone()
    sees.fill_diagonal_(False)
    T = sees.shape[0]
    parents = torch.where(sees, torch.arange(T, device=sees.device).expand(T, T), -1).amax(1)
    parents[0] = -1
    return parents.unsqueeze(0).to(torch.int64)


def packed_mask(tree_attribute: str):
    """``LlamaModel._prepare_decoder_attention_mask`` returning the bit-packed tree mask, from the
    dense one the peer sets on the model as ``tree_attribute`` (causal for the prompt and for
    steps of another length)."""
    def prepare(self, attention_mask, input_shape, inputs_embeds, past_key_values_length):
        B, T = input_shape
        tree = getattr(self, tree_attribute, None)
        if tree is None or tree.shape[-1] != T:
            return causal_tree_mask(B, T, inputs_embeds.device)
        if STATE.get("mask_of") != (id(tree), tree._version, B):  # (the peer's tree is one tensor: packed once)
            STATE["mask"] = pack_bits(tree.reshape(1, T, T) > 0.5).to(inputs_embeds.device).expand(B, -1, -1).contiguous()
            STATE["mask_of"] = (id(tree), tree._version, B)
        return STATE["mask"]
    return prepare


def tree_attention_forward(apply_rotary_pos_emb):
    """``LlamaAttention.forward`` writing the new K/V into the peer's cache as the peer does, then
    ``tree_attention`` over it (split-KV over the prefix, the tree part masked by the packed mask)."""
    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None,
                output_attentions=False, use_cache=False):
        if past_key_value is None or self.pretraining_tp > 1 or output_attentions:
            raise NotImplementedError("jakiro_ext's tree attention in a KV Llama needs its KV cache, pretraining_tp 1 "
                                      "and no attention weights returned")
        B, T, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(B, T, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(B, T, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        prefix = int(past_key_value[0].current_length)
        cos, sin = self.rotary_emb(v, seq_len=prefix + T)
        q, k = apply_rotary_pos_emb(q, k, cos, sin, position_ids)
        past_key_value[0].cat(k, dim=2)  # the peer's own cache write: [prefix, prefix + T)
        past_key_value[1].cat(v, dim=2)
        out, _ = ops.tree_attention(q.transpose(1, 2), past_key_value[0].data, past_key_value[1].data,
                                    torch.full((B,), prefix, dtype=torch.int64, device=q.device), attention_mask,
                                    1.0 / self.head_dim ** 0.5)
        return self.o_proj(out.reshape(B, T, self.hidden_size)), None, None
    return forward


def model_forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                  inputs_embeds=None, use_cache=None, output_attentions=None, output_hidden_states=None,
                  return_dict=None):
    """``LlamaModel.forward`` as one ``decoder_layers`` call: the peer's KV buffer
    ``[2 L, 1, Hkv, S, D]`` viewed as ``[L, 2, 1, Hkv, S, D]`` is that op's layout."""
    buffer = None if past_key_values is None else past_key_values[0][0].data._base  # [2 L, 1, Hkv, S, D]
    L = len(self.layers)
    if (buffer is None or output_attentions or output_hidden_states or self.config.pretraining_tp > 1
            or buffer.shape[0] != 2 * L or buffer.data_ptr() != past_key_values[0][0].data.data_ptr()):
        raise NotImplementedError("jakiro_ext's decoder_layers in a KV Llama needs its one KV buffer (one device), "
                                  "pretraining_tp 1 and no attention weights or hidden states returned")
    weights = self.__dict__.get("_jakiro_weights")
    if weights is None:  # q/k/v and gate/up as one weight each, made once (a copy of those matrices)
        layers = self.layers
        weights = self.__dict__["_jakiro_weights"] = dict(
            input_norms=[x.input_layernorm.weight for x in layers],
            qkv=[torch.cat([x.self_attn.q_proj.weight, x.self_attn.k_proj.weight, x.self_attn.v_proj.weight])
                 for x in layers],
            o=[x.self_attn.o_proj.weight for x in layers], post=[x.post_attention_layernorm.weight for x in layers],
            gate_up=[torch.cat([x.mlp.gate_proj.weight, x.mlp.up_proj.weight]) for x in layers],
            down=[x.mlp.down_proj.weight for x in layers])
    h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
    B, T, _ = h.shape
    prefix = int(past_key_values[0][0].current_length)
    positions = (torch.arange(prefix, prefix + T, device=h.device) if position_ids is None else position_ids).reshape(1, T)
    rotary = self.layers[0].self_attn.rotary_emb
    cos = rotary.cos_cached[0, 0][positions].to(h.dtype).expand(B, T, -1).contiguous()
    sin = rotary.sin_cached[0, 0][positions].to(h.dtype).expand(B, T, -1).contiguous()
    residual, delta = ops.decoder_layers(h, None, weights["input_norms"], weights["qkv"], [], weights["o"],
                                         weights["post"], weights["gate_up"], weights["down"], cos, sin,
                                         buffer.view(L, 2, *buffer.shape[1:]),
                                         torch.full((B,), prefix, dtype=torch.int64, device=h.device),
                                         self._prepare_decoder_attention_mask(None, (B, T), h, prefix),
                                         self.layers[0].input_layernorm.variance_epsilon)
    out, _ = ops.rms_norm(delta, self.norm.weight, self.norm.variance_epsilon, residual)
    for pair in past_key_values:  # (the op wrote the keys and values: the peer's lengths move on)
        for cache in pair:
            cache.current_length.add_(T)
    return BaseModelOutputWithPast(last_hidden_state=out)


# ----------------------------------------------------------------------------- verification and commit
def sample_uniforms(tree_size: int, device) -> torch.Tensor:
    """``verify_tree``'s uniforms for a tree of ``tree_size`` nodes, from the switch's generator."""
    return torch.rand((1, tree_size + 1), dtype=torch.float64, generator=STATE.get("generator")).to(device)


def verify(node_logits: torch.Tensor, tree_tokens: torch.Tensor, retrieve_indices: torch.Tensor,
           sampling: tuple = None) -> tuple:
    """``verify_tree`` over every node's logits [1, T, V] (``sampling``: None for greedy, or
    (temperature, top_p, top_k)): (the row of ``retrieve_indices`` holding the accepted path,
    the number of drafts accepted, the bonus token)."""
    parents = STATE["parents"]
    if sampling is None:
        path, accepted, bonus = ops.verify_tree(parents, tree_tokens, node_logits.float())
    else:
        path, accepted, bonus = ops.verify_tree(parents, tree_tokens, node_logits.float(),
                                                sample_uniforms(tree_tokens.shape[-1], node_logits.device), *sampling)
    n = int(accepted[0])
    rows = retrieve_indices.to(path.device)
    best = int(torch.nonzero((rows[:, : n + 1] == path[0, : n + 1]).all(1))[0, 0])  # (the path lies on a row)
    return best, n, int(bonus[0])


def commit(buffer: torch.Tensor, prefix: int, path: torch.Tensor) -> None:
    """The accepted path's K/V (tree positions ``path``, the root first) moved to ``prefix`` in
    every layer of the peer's one buffer ``[2 L, 1, Hkv, S, D]``, one ``compact_kv`` call."""
    device = buffer.device
    ops.compact_kv(buffer, torch.tensor([prefix], device=device), path[None].to(device),
                   torch.tensor([path.shape[0]], device=device))


# ----------------------------------------------------------------------------- the switch
def target_patches(module, mask, attention_forward, attention: bool, model: bool) -> list:
    """The target-side replacements in a peer's KV Llama ``module`` (see :func:`patched`): its mask
    by ``mask`` and its attention by ``attention_forward`` (:func:`packed_mask`,
    :func:`tree_attention_forward`) with ``attention`` or ``model``, and its whole forward by
    :func:`model_forward` with ``model``."""
    out = []
    if attention or model:
        out += [(module.LlamaModel, "_prepare_decoder_attention_mask", mask),
                (module.LlamaAttention, "forward", attention_forward)]
    if model:
        out.append((module.LlamaModel, "forward", model_forward))
    return out


@contextlib.contextmanager
def patched(replacements: list, generator: torch.Generator = None):
    """Set ``(owner, attribute, value)`` for each replacement, restored on exit (an exception's
    too); one switch at a time (the patches are module-wide)."""
    if "active" in STATE:
        raise RuntimeError("use_jakiro_ops is already active (it patches the peer's modules: one at a time)")
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in replacements]
    STATE.update(active=True, generator=generator)
    try:
        for owner, name, value in replacements:
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, value in reversed(originals):
            setattr(owner, name, value)
        STATE.clear()
