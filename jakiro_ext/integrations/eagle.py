"""This package's ops inside EAGLE's own decoding loop (PyPI ``eagle-llm`` 1.2.1: EAGLE-1's
``EaModel.eagenerate``, a static 26-node tree), switchable, so that one script runs both ways::

    from jakiro_ext.integrations import eagle
    model = eagle.load_eagle_model(base_dir, head_dir)          # (on transformers 5: kv_llama)
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

import json
from pathlib import Path

import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

import eagle.model.cnets as cnets
import eagle.model.ea_model as ea
import eagle.model.modeling_llama_kv as kv
from jakiro_ext import atomic
from jakiro_ext.integrations import kv_llama
from jakiro_ext.integrations.kv_llama import parents_of  # noqa: F401  (EAGLE's tree in our terms)
from jakiro_ext.models.heads import formats as head_formats

STATE = kv_llama.STATE  # (what one patched function hands the next within a step)
_attention = kv_llama.tree_attention_forward(kv.apply_rotary_pos_emb)
_packed_mask = kv_llama.packed_mask("tree_mask")


def load_eagle_model(base_dir, head_dir, dtype: torch.dtype = torch.float32) -> "ea.EaModel":
    """EAGLE's ``EaModel``: the base model of ``base_dir`` (a transformers Llama directory, its
    tokenizer beside it) as EAGLE's KV Llama, and the head of ``head_dir`` (``config.json`` and
    ``pytorch_model.bin`` with the embedding, as :func:`save_for_eagle` writes it), both in
    ``dtype``, on the CPU, made to run on transformers 5 (:mod:`~jakiro_ext.integrations.kv_llama`).
    Nothing is fetched from the hub (``EaModel.from_pretrained`` reads ``architectures`` from the
    base's config and falls back to the hub for a missing head file)."""
    kv_llama.fix_classes(kv, cnets)
    head_dir = Path(head_dir)
    for name in ("config.json", "pytorch_model.bin"):
        if not (head_dir / name).is_file():
            raise FileNotFoundError(f"{head_dir / name} not found: an EAGLE head directory holds config.json and "
                                    "pytorch_model.bin (jakiro_ext.integrations.eagle.save_for_eagle writes them)")
    base = kv_llama.rebuild_rotary(kv.LlamaForCausalLM.from_pretrained(str(base_dir), dtype=dtype).eval(), kv)
    model = ea.EaModel(base, str(base_dir), str(head_dir / "config.json"))
    state = torch.load(head_dir / "pytorch_model.bin", map_location="cpu", weights_only=True)
    model.ea_layer.load_state_dict(state, strict=True)
    kv_llama.rebuild_rotary(model.ea_layer, cnets)
    bases = {float(m.rotary_emb.base) for m in model.ea_layer.modules() if hasattr(m, "rotary_emb")}
    if bases != {kv_llama.rope_theta(base.config)}:
        raise ValueError(f"{head_dir / 'config.json'}: the head's RoPE base {sorted(bases)} is not the base model's "
                         f"{kv_llama.rope_theta(base.config)} (its config.json needs the model's rope_theta)")
    return model.eval()


# ----------------------------------------------------------------------------- verification
def _initialize_tree(input_ids, model, tree_attn_mask, past_key_values, logits_processor):
    STATE["parents"] = parents_of(tree_attn_mask).to(input_ids.device)
    return _ORIGINAL_INITIALIZE_TREE(input_ids, model, tree_attn_mask, past_key_values, logits_processor)


def _tree_decoding(model, tree_candidates, past_key_values, tree_position_ids, input_ids, retrieve_indices):
    outputs, tree_logits, hidden_state = model(tree_candidates, output_orig=True, past_key_values=past_key_values,
                                               position_ids=tree_position_ids + input_ids.shape[1], init=False)
    STATE["node_logits"], STATE["retrieve_indices"] = tree_logits, retrieve_indices  # [1, T, V]: every node's
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
    node_logits = STATE["node_logits"]
    best, n, bonus = kv_llama.verify(node_logits, tree_candidates, STATE["retrieve_indices"],
                                     None if logits_processor is None else sampling_settings(logits_processor))
    chosen = torch.zeros(node_logits.shape[-1], device=node_logits.device)
    chosen[bonus] = 1.0  # (EAGLE's argmax or multinomial of it is the bonus token)
    return torch.tensor(best), torch.tensor(n), chosen


# ----------------------------------------------------------------------------- the commit
@torch.no_grad()
def _update_inference_inputs(input_ids, candidates, best_candidate, accept_length, retrieve_indices, logits_processor,
                             logits, tree_logits, new_token, past_key_values_data_list, current_length_data, model,
                             hidden_state, hidden_state_new, sample_p):
    prefix, n = input_ids.shape[1], int(accept_length)
    input_ids = torch.cat([input_ids, candidates[None, best_candidate, : n + 1].to(input_ids.device)], -1)
    for data in past_key_values_data_list:  # [2 L, 1, Hkv, S, D]: every layer's K and V in one call
        kv_llama.commit(data, prefix, retrieve_indices[best_candidate, : n + 1])
    current_length_data.fill_(prefix + n + 1)
    accepted_hidden = hidden_state_new[:, retrieve_indices][:, best_candidate, : n + 1]
    token = torch.multinomial(sample_p, 1)[None] if logits_processor is not None else torch.argmax(sample_p)[None, None]
    tree_logits = model.ea_layer.topK_genrate(accepted_hidden, input_ids=torch.cat((input_ids, token.to(input_ids.device)), 1),
                                              head=model.base_model.lm_head, logits_processor=logits_processor)
    return input_ids, tree_logits, new_token + n + 1, None, token


# ----------------------------------------------------------------------------- the switch
_ORIGINAL_INITIALIZE_TREE = ea.initialize_tree


def use_jakiro_ops(attention: bool = True, verify: bool = True, compact: bool = True, model: bool = False,
                   generator: torch.Generator = None):
    """EAGLE's loop with this package's ops in the places chosen, restored on exit, an exception's
    too (``generator``: a CPU generator for ``verify_tree``'s uniforms when sampling; default the
    global one). ``model`` runs the whole target forward as ``decoder_layers`` (its attention
    then is ``tree_attention`` too). A context manager."""
    kv_llama.fix_classes(kv, cnets)
    replacements = kv_llama.target_patches(kv, _packed_mask, _attention, attention, model)
    if verify:  # (eagenerate reads these from ea_model's globals: ``from .utils import *``)
        replacements += [(ea, "initialize_tree", _initialize_tree), (ea, "tree_decoding", _tree_decoding),
                         (ea, "evaluate_posterior", _evaluate_posterior)]
    if compact:
        replacements.append((ea, "update_inference_inputs", _update_inference_inputs))
    return kv_llama.patched(replacements, generator)


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
