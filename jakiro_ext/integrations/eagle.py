"""This package's ops inside EAGLE's own decoding loop (PyPI ``eagle-llm`` 1.2.1: EAGLE-1's
``EaModel.eagenerate``, a static 26-node tree), switchable, so that one script runs both ways::

    from jakiro_ext.integrations import eagle
    model = eagle.load_eagle_model(base_dir, head_dir)          # (eagle_compat: transformers 5)
    with eagle.use_jakiro_ops():                                  # attention, verify, compact (+ model=True)
        out = model.eagenerate(ids, max_new_tokens=128)

The places swapped (module attributes of EAGLE's code, restored on exit):

1. ``attention``: the target's tree attention. ``LlamaModel._prepare_decoder_attention_mask``
   returns the bit-packed tree mask (from EAGLE's dense ``tree_mask``, or causal) instead of the
   dense additive one, and ``LlamaAttention.forward`` runs ``tree_attention`` over EAGLE's own KV
   buffers after EAGLE's own cache write (split-KV over the prefix, the tree part masked).
2. ``verify``: ``evaluate_posterior`` becomes ``verify_tree`` over every node's logits (greedy: the
   same path and bonus token as EAGLE's; sampling: lossless rejection sampling with q = 1, EAGLE-2's
   rule, where EAGLE-1 tests p / q with the draft's probabilities: another lossless rule, other
   draws). ``tree_decoding`` is the same call keeping the per-node logits, ``initialize_tree`` also
   derives the tree's parents.
3. ``compact``: ``update_inference_inputs`` commits the accepted path's K/V with ``compact_kv``
   (all layers' K and V in one call on EAGLE's single buffer) instead of a gather-copy per layer.
4. ``model`` (off by default): the whole target forward as one ``decoder_layers`` call: EAGLE's
   KV buffer ``[2 L, 1, Hkv, S, D]`` viewed as ``[L, 2, 1, Hkv, S, D]`` is that op's layout.

EAGLE's code patched this way is batch 1 (as EAGLE); fp16 models are refused by our ops (use
float32 or bfloat16). :func:`save_for_eagle` writes this package's dense heads in the files
EAGLE's loader reads.
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
from transformers.modeling_outputs import BaseModelOutputWithPast

import eagle.model.ea_model as ea
import eagle.model.modeling_llama_kv as kv
from jakiro_ext import atomic, ops
from jakiro_ext.integrations import eagle_compat
from jakiro_ext.models.heads import formats as head_formats
from jakiro_ext.ops.masks import causal_tree_mask, pack_bits

load_eagle_model = eagle_compat.load_eagle_model
_ORIGINAL: dict = {}
_STEP: dict = {}  # what one patched function hands the next within a step (EAGLE decodes one sequence)


# ----------------------------------------------------------------------------- EAGLE's tree in our terms
def parents_of(tree_attn_mask: torch.Tensor) -> torch.Tensor:
    """Parents [1, T] int64 of EAGLE's (or Medusa's) dense ancestor mask [1, 1, T, T] (1: sees):
    its nodes are in breadth-first order, so a node's parent is its highest-index ancestor."""
    sees = tree_attn_mask.reshape(tree_attn_mask.shape[-2:]).bool().clone()
    sees.fill_diagonal_(False)
    T = sees.shape[0]
    parents = torch.where(sees, torch.arange(T, device=sees.device).expand(T, T), -1).amax(1)
    parents[0] = -1
    return parents.unsqueeze(0).to(torch.int64)


def _packed_mask(self, attention_mask, input_shape, inputs_embeds, past_key_values_length):
    B, T = input_shape
    tree = getattr(self, "tree_mask", None)
    if tree is None or tree.shape[-1] != T:  # the prompt, or one token: causal
        return causal_tree_mask(B, T, inputs_embeds.device)
    if _STEP.get("mask_of") != (id(tree), tree._version, B):  # (EAGLE-1's tree is one tensor: packed once)
        _STEP["mask"] = pack_bits(tree.reshape(1, T, T) > 0.5).to(inputs_embeds.device).expand(B, -1, -1).contiguous()
        _STEP["mask_of"] = (id(tree), tree._version, B)
    return _STEP["mask"]


def _attention(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None,
               output_attentions=False, use_cache=False):
    if past_key_value is None or self.pretraining_tp > 1 or output_attentions:
        raise NotImplementedError("jakiro_ext's tree attention in EAGLE's Llama needs EAGLE's KV cache, "
                                  "pretraining_tp 1 and no attention weights returned")
    B, T, _ = hidden_states.shape
    q = self.q_proj(hidden_states).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
    k = self.k_proj(hidden_states).view(B, T, self.num_key_value_heads, self.head_dim).transpose(1, 2)
    v = self.v_proj(hidden_states).view(B, T, self.num_key_value_heads, self.head_dim).transpose(1, 2)
    prefix = int(past_key_value[0].current_length)
    cos, sin = self.rotary_emb(v, seq_len=prefix + T)
    q, k = kv.apply_rotary_pos_emb(q, k, cos, sin, position_ids)
    past_key_value[0].cat(k, dim=2)  # EAGLE's own cache write: [prefix, prefix + T)
    past_key_value[1].cat(v, dim=2)
    out, _ = ops.tree_attention(q.transpose(1, 2), past_key_value[0].data, past_key_value[1].data,
                                torch.full((B,), prefix, dtype=torch.int64, device=q.device), attention_mask,
                                1.0 / self.head_dim ** 0.5)
    return self.o_proj(out.reshape(B, T, self.hidden_size)), None, None


# ----------------------------------------------------------------------------- verification
def _initialize_tree(input_ids, model, tree_attn_mask, past_key_values, logits_processor):
    _STEP["parents"] = parents_of(tree_attn_mask).to(input_ids.device)
    return _ORIGINAL["initialize_tree"](input_ids, model, tree_attn_mask, past_key_values, logits_processor)


def _tree_decoding(model, tree_candidates, past_key_values, tree_position_ids, input_ids, retrieve_indices):
    outputs, tree_logits, hidden_state = model(tree_candidates, output_orig=True, past_key_values=past_key_values,
                                               position_ids=tree_position_ids + input_ids.shape[1], init=False)
    _STEP["node_logits"], _STEP["retrieve_indices"] = tree_logits, retrieve_indices  # [1, T, V]: every node's
    return tree_logits[0, retrieve_indices], hidden_state, outputs


def sampling_settings(logits_processor) -> tuple:
    """(temperature, top_p, top_k) of EAGLE's logits processors (its top_p 0, "off", is absent).
    EAGLE filters top-p before top-k, ``verify_tree`` top-k before top-p: both at once would
    sample another distribution than EAGLE's, and are refused."""
    temperature, top_p, top_k = 1.0, 1.0, 0
    for warper in logits_processor or ():
        if isinstance(warper, TemperatureLogitsWarper):
            temperature = float(warper.temperature)
        elif isinstance(warper, TopPLogitsWarper):
            top_p = float(warper.top_p)
        elif isinstance(warper, TopKLogitsWarper):
            top_k = int(warper.top_k)
        else:
            raise NotImplementedError(f"verify_tree in EAGLE's loop takes temperature, top-p and top-k, not "
                                      f"{type(warper).__name__}")
    if top_p < 1.0 and top_k:
        raise NotImplementedError(f"EAGLE filters top-p ({top_p}) before top-k ({top_k}), verify_tree top-k before "
                                  "top-p: give one of them (or run EAGLE's own evaluate_posterior)")
    return temperature, top_p, top_k


def _evaluate_posterior(logits, candidates, logits_processor, cart_candidates_prob=None, op=None, p_indices=None,
                        tree_candidates=None, b_indices=None):
    node_logits, rows = _STEP["node_logits"], _STEP["retrieve_indices"]
    if logits_processor is None:
        path, accepted, bonus = ops.verify_tree(_STEP["parents"], tree_candidates, node_logits.float())
    else:
        temperature, top_p, top_k = sampling_settings(logits_processor)
        uniforms = torch.rand((1, tree_candidates.shape[-1] + 1), dtype=torch.float64, generator=_STEP.get("generator"))
        path, accepted, bonus = ops.verify_tree(_STEP["parents"], tree_candidates, node_logits.float(),
                                                uniforms.to(node_logits.device), temperature, top_p, top_k)
    n = int(accepted[0])
    best = int(torch.nonzero((rows[:, : n + 1] == path[0, : n + 1].to(rows.device)).all(1))[0, 0])  # a row on the path
    chosen = torch.zeros(node_logits.shape[-1], device=node_logits.device)
    chosen[int(bonus[0])] = 1.0  # (EAGLE's argmax or multinomial of it is the bonus token)
    return torch.tensor(best), torch.tensor(n), chosen


# ----------------------------------------------------------------------------- the commit
@torch.no_grad()
def _update_inference_inputs(input_ids, candidates, best_candidate, accept_length, retrieve_indices, logits_processor,
                             logits, tree_logits, new_token, past_key_values_data_list, current_length_data, model,
                             hidden_state, hidden_state_new, sample_p):
    prefix, n = input_ids.shape[1], int(accept_length)
    path = retrieve_indices[best_candidate, : n + 1]
    input_ids = torch.cat([input_ids, candidates[None, best_candidate, : n + 1].to(input_ids.device)], -1)
    for data in past_key_values_data_list:  # [2 L, 1, Hkv, S, D]: every layer's K and V in one call
        ops.compact_kv(data, torch.tensor([prefix], device=data.device), path[None].to(data.device),
                       torch.tensor([n + 1], device=data.device))
    current_length_data.fill_(prefix + n + 1)
    accepted_hidden = hidden_state_new[:, retrieve_indices][:, best_candidate, : n + 1]
    token = torch.multinomial(sample_p, 1)[None] if logits_processor is not None else torch.argmax(sample_p)[None, None]
    tree_logits = model.ea_layer.topK_genrate(accepted_hidden, input_ids=torch.cat((input_ids, token.to(input_ids.device)), 1),
                                              head=model.base_model.lm_head, logits_processor=logits_processor)
    return input_ids, tree_logits, new_token + n + 1, None, token


# ----------------------------------------------------------------------------- the whole target forward
def _model_forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                   inputs_embeds=None, use_cache=None, output_attentions=None, output_hidden_states=None,
                   return_dict=None):
    buffer = None if past_key_values is None else past_key_values[0][0].data._base  # [2 L, 1, Hkv, S, D]
    L = len(self.layers)
    if (buffer is None or output_attentions or output_hidden_states or self.config.pretraining_tp > 1
            or buffer.shape[0] != 2 * L or buffer.data_ptr() != past_key_values[0][0].data.data_ptr()):
        raise NotImplementedError("jakiro_ext's decoder_layers in EAGLE's Llama needs EAGLE's one KV buffer (one "
                                  "device), pretraining_tp 1 and no attention weights or hidden states returned")
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
                                         _packed_mask(self, None, (B, T), h, prefix),
                                         self.layers[0].input_layernorm.variance_epsilon)
    out, _ = ops.rms_norm(delta, self.norm.weight, self.norm.variance_epsilon, residual)
    for pair in past_key_values:  # (the op wrote the keys and values: EAGLE's lengths move on)
        for cache in pair:
            cache.current_length.add_(T)
    return BaseModelOutputWithPast(last_hidden_state=out)


# ----------------------------------------------------------------------------- the switch
@contextlib.contextmanager
def use_jakiro_ops(attention: bool = True, verify: bool = True, compact: bool = True, model: bool = False,
                   generator: torch.Generator = None):
    """EAGLE's loop with this package's ops in the places chosen, restored on exit, an exception's
    too (``generator``: a CPU generator for ``verify_tree``'s uniforms when sampling; default the
    global one). ``model`` runs the whole target forward as ``decoder_layers`` (its attention
    then is ``tree_attention`` too)."""
    if _ORIGINAL:
        raise RuntimeError("use_jakiro_ops is already active (it patches EAGLE's modules: one at a time)")
    eagle_compat.apply()
    _ORIGINAL.update(mask=kv.LlamaModel._prepare_decoder_attention_mask, attention=kv.LlamaAttention.forward,
                     model=kv.LlamaModel.forward, initialize_tree=ea.initialize_tree, tree_decoding=ea.tree_decoding,
                     evaluate_posterior=ea.evaluate_posterior, update_inference_inputs=ea.update_inference_inputs)
    _STEP["generator"] = generator
    try:
        if attention or model:
            kv.LlamaModel._prepare_decoder_attention_mask = _packed_mask
            kv.LlamaAttention.forward = _attention
        if model:
            kv.LlamaModel.forward = _model_forward
        if verify:  # (eagenerate reads these from ea_model's globals: ``from .utils import *``)
            ea.initialize_tree, ea.tree_decoding, ea.evaluate_posterior = (_initialize_tree, _tree_decoding,
                                                                           _evaluate_posterior)
        if compact:
            ea.update_inference_inputs = _update_inference_inputs
        yield
    finally:
        kv.LlamaModel._prepare_decoder_attention_mask = _ORIGINAL["mask"]
        kv.LlamaAttention.forward, kv.LlamaModel.forward = _ORIGINAL["attention"], _ORIGINAL["model"]
        ea.initialize_tree, ea.tree_decoding = _ORIGINAL["initialize_tree"], _ORIGINAL["tree_decoding"]
        ea.evaluate_posterior = _ORIGINAL["evaluate_posterior"]
        ea.update_inference_inputs = _ORIGINAL["update_inference_inputs"]
        _ORIGINAL.clear()
        _STEP.clear()


def save_for_eagle(head, embed_tokens: torch.Tensor, out) -> None:
    """A dense one-layer head of this package in the files EAGLE's loader reads: ``config.json``
    (with ``bias``) and ``pytorch_model.bin`` holding the target's embedding beside the head's
    tensors (EAGLE loads strictly); a head over a draft vocabulary drafts over the whole one there
    (the target's LM head rows: EAGLE has no draft vocabulary)."""
    config, state = head_formats.HEAD_FORMATS["eagle"].write(head, True)  # (the eagle format's own writer)
    state = {k: v.detach().float().contiguous() for k, v in state.items()}
    state["embed_tokens.weight"] = embed_tokens.detach().float().contiguous().clone()
    config["bias"] = True  # (fc's: EAGLE's loader reads it)

    def write(tmp: Path) -> None:
        torch.save(state, tmp / "pytorch_model.bin")
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    atomic.write_directory(out, write, ("config.json", "pytorch_model.bin"))
