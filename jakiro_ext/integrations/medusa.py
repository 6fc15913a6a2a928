"""This package's ops inside Medusa's own decoding loop (PyPI ``medusa-llm`` 0.1:
``MedusaModel.medusa_generate``, a Cartesian tree over the heads' top-k), switchable::

    from jakiro_ext.integrations import medusa
    model = medusa.load_medusa_model(base_dir)                  # random heads, or heads_dir=
    with medusa.use_jakiro_ops():                                 # attention, verify, compact (+ model=True)
        tokens, accepted = medusa.generate(model, ids, max_steps=64)

Medusa's KV Llama is EAGLE-1's (its ancestor), so the target-side places swapped are the EAGLE
adapter's (:mod:`~jakiro_ext.integrations.kv_llama`): ``attention`` (the bit-packed tree mask and
``tree_attention`` over Medusa's KV buffer), ``model`` (the whole target forward as one
``decoder_layers`` call) and ``compact`` (``update_inference_inputs`` commits the accepted path
with one ``compact_kv`` call instead of Medusa's gather-copy). ``verify`` replaces
``evaluate_posterior`` with ``verify_tree`` over every node's logits: greedy, the same path and
next token as Medusa's; with a temperature, lossless rejection sampling (q = 1) in place of
Medusa's typical acceptance (which is not lossless, and whose next tree root is the argmax even
when sampling): the root of every tree is then ``verify_tree``'s sampled bonus token, the first
one drawn from the prompt's last logits. Medusa's posterior threshold and alpha are then unused.

Medusa 0.1 on transformers 5 needs the KV Llama fixes EAGLE's does and one of its own: its KV
buffer is sized by attention heads, not KV heads, which breaks grouped-query models such as
SmolLM2 (:func:`load_medusa_model` applies them). Batch 1 (as Medusa); float32 or bfloat16.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

import medusa.model.kv_cache as medusa_cache
import medusa.model.medusa_model as mm
import medusa.model.modeling_llama_kv as kv
from jakiro_ext import ops
from jakiro_ext.integrations import kv_llama
from jakiro_ext.integrations.kv_llama import parents_of

STATE = kv_llama.STATE  # (what one patched function hands the next within a step)
_attention = kv_llama.tree_attention_forward(kv.apply_rotary_pos_emb)
_packed_mask = kv_llama.packed_mask("medusa_mask")


# ----------------------------------------------------------------------------- Medusa on transformers 5
def _kv_cache_by_kv_heads(model):
    """Medusa's ``initialize_past_key_values`` with the buffer ``[2 L, 1, Hkv, S, D]`` sized by the
    model's KV heads (Medusa's own sizes it by attention heads)."""
    config = model.config
    data = torch.zeros(config.num_hidden_layers * 2, 1, config.num_key_value_heads, config.max_position_embeddings,
                       config.hidden_size // config.num_attention_heads, device=model.device, dtype=model.dtype)
    lengths = torch.zeros(config.num_hidden_layers * 2, dtype=torch.long)  # (Medusa keeps its lengths on the CPU)
    caches = [[medusa_cache.KVCache(data[2 * i + j], lengths[2 * i + j]) for j in range(2)]
              for i in range(config.num_hidden_layers)]
    return caches, data, lengths


def _fix() -> None:
    kv_llama.fix_classes(kv)
    mm.initialize_past_key_values = _kv_cache_by_kv_heads  # (medusa_generate reads it from its module's globals)


def load_medusa_model(base_dir, heads_dir=None, num_heads: int = 2, num_layers: int = 1, seed: int = 0,
                      std: float = 0.02, dtype: torch.dtype = torch.float32) -> "mm.MedusaModel":
    """Medusa's ``MedusaModel``: the base model of ``base_dir`` (a transformers Llama directory,
    its tokenizer beside it) as Medusa's KV Llama, on the CPU, made to run on transformers 5, and
    its heads from ``heads_dir`` (Medusa's ``config.json`` and ``medusa_lm_head.pt``) or, with
    none, ``num_heads`` random heads (each residual block's weights drawn N(0, ``std``) with ``seed``; Medusa's
    own start is zeros, every head then the base model's LM head). Nothing is fetched from the hub.
    ``medusa_generate``'s default tree ``[1, 7, 6]`` takes two heads."""
    _fix()
    if heads_dir is not None:
        heads_dir = Path(heads_dir)
        for name in ("config.json", "medusa_lm_head.pt"):
            if not (heads_dir / name).is_file():
                raise FileNotFoundError(f"{heads_dir / name} not found: a Medusa heads directory holds config.json "
                                        "(medusa_num_heads, medusa_num_layers) and medusa_lm_head.pt")
        config = json.loads((heads_dir / "config.json").read_text())
        num_heads, num_layers = int(config["medusa_num_heads"]), int(config["medusa_num_layers"])
    base = kv_llama.rebuild_rotary(kv.LlamaForCausalLM.from_pretrained(str(base_dir), dtype=dtype).eval(), kv)
    model = mm.MedusaModel(base, num_heads, num_layers, str(base_dir))
    if heads_dir is not None:
        state = torch.load(heads_dir / "medusa_lm_head.pt", map_location="cpu", weights_only=True)
        model.medusa_head.load_state_dict(state, strict=True)
    else:
        draws = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for head in model.medusa_head:
                for block in head[:-1]:
                    block.linear.weight.copy_(torch.randn(block.linear.weight.shape, generator=draws) * std)
    return model.eval()


def generate(model: "mm.MedusaModel", input_ids: torch.Tensor, max_steps: int = 512, **kwargs) -> tuple:
    """Run ``model.medusa_generate`` (which yields only text) to its end: (its tokens after the
    prompt, the drafts it accepted at each step). ``kwargs``: ``medusa_generate``'s."""
    update, out = mm.update_inference_inputs, {"ids": input_ids, "steps": []}

    def recorded(*args):
        result = update(*args)
        out["ids"] = result[0]
        out["steps"].append(int(args[3]))
        return result
    mm.update_inference_inputs = recorded
    try:
        for _ in model.medusa_generate(input_ids, max_steps=max_steps, **kwargs):
            pass
    finally:
        mm.update_inference_inputs = update
    return out["ids"][0, input_ids.shape[1]:].tolist(), out["steps"]


# ----------------------------------------------------------------------------- verification
def _initialize_medusa(input_ids, model, medusa_attn_mask, past_key_values):
    STATE["parents"] = parents_of(medusa_attn_mask).to(input_ids.device)
    STATE.pop("bonus", None)  # (a new call: its first root comes from its prompt, not the last call's bonus)
    return _ORIGINAL["initialize_medusa"](input_ids, model, medusa_attn_mask, past_key_values)


def _generate_candidates(medusa_logits, logits, medusa_topk, tree_indices, temperature):
    candidates, tree_candidates = _ORIGINAL["generate_candidates"](medusa_logits, logits, medusa_topk, tree_indices,
                                                                   temperature)
    root = STATE.pop("bonus", None)
    if root is None and temperature > 0:  # the first tree: its root drawn from the prompt's last logits
        one_node = torch.zeros((1, 1), dtype=torch.int64, device=logits.device)
        _, _, bonus = ops.verify_tree(torch.full_like(one_node, -1), one_node, logits[:, -1:].float(),
                                      kv_llama.sample_uniforms(1, logits.device), float(temperature), 1.0, 0)
        root = int(bonus[0])
    if root is not None:  # (node 0 is the root; the heads' top-k do not depend on it)
        candidates[:, 0] = root
        tree_candidates[:, 0] = root
    return candidates, tree_candidates


def _tree_decoding(model, tree_candidates, past_key_values, medusa_position_ids, input_ids, retrieve_indices):
    tree_medusa_logits, outputs, tree_logits = model(tree_candidates, output_orig=True, past_key_values=past_key_values,
                                                     position_ids=medusa_position_ids + input_ids.shape[1])
    STATE.update(node_logits=tree_logits, tree_tokens=tree_candidates, retrieve_indices=retrieve_indices)
    return tree_medusa_logits[:, 0, retrieve_indices], tree_logits[0, retrieve_indices], outputs


def _evaluate_posterior(logits, candidates, temperature, posterior_threshold, posterior_alpha):
    best, n, STATE["bonus"] = kv_llama.verify(STATE["node_logits"], STATE["tree_tokens"], STATE["retrieve_indices"],
                                               None if temperature == 0 else (float(temperature), 1.0, 0))
    return torch.tensor(best), torch.tensor(n)


# ----------------------------------------------------------------------------- the commit
def _update_inference_inputs(input_ids, candidates, best_candidate, accept_length, retrieve_indices, outputs, logits,
                             medusa_logits, new_token, past_key_values_data, current_length_data):
    prefix, n = input_ids.shape[1], int(accept_length)
    input_ids = torch.cat([input_ids, candidates[None, best_candidate, : n + 1]], dim=-1)
    kv_llama.commit(past_key_values_data, prefix, retrieve_indices[best_candidate, : n + 1])
    current_length_data.fill_(prefix + n + 1)
    return (input_ids, logits[None, best_candidate, n: n + 1], medusa_logits[:, None, best_candidate, n: n + 1],
            new_token + n + 1)


# ----------------------------------------------------------------------------- the switch
_ORIGINAL = dict(initialize_medusa=mm.initialize_medusa, generate_candidates=mm.generate_candidates)


def use_jakiro_ops(attention: bool = True, verify: bool = True, compact: bool = True, model: bool = False,
                   generator: torch.Generator = None):
    """Medusa's loop with this package's ops in the places chosen, restored on exit, an exception's
    too (``generator``: a CPU generator for ``verify_tree``'s uniforms when sampling; default the
    global one). ``model`` runs the whole target forward as ``decoder_layers`` (its attention
    then is ``tree_attention`` too). A context manager."""
    _fix()
    replacements = kv_llama.target_patches(kv, _packed_mask, _attention, attention, model)
    if verify:  # (medusa_generate reads these from its module's globals: ``from .utils import *``)
        replacements += [(mm, "initialize_medusa", _initialize_medusa), (mm, "generate_candidates", _generate_candidates),
                         (mm, "tree_decoding", _tree_decoding), (mm, "evaluate_posterior", _evaluate_posterior)]
    if compact:
        replacements.append((mm, "update_inference_inputs", _update_inference_inputs))
    return kv_llama.patched(replacements, generator)
