"""EAGLE's reference code (PyPI ``eagle-llm`` 1.2.1, EAGLE-1) on transformers 5, and its models
loaded from local directories.

As shipped it does not run on transformers 5: its attention's ``_init_rope`` indexes
``config.rope_scaling["type"]``, which transformers 5 makes an alias of ``rope_parameters`` (never
None); its ``_tied_weights_keys`` is a list where transformers 5 wants a dict; and transformers 5
builds a model on the meta device, leaving the rotary buffers (not in the checkpoint) as
uninitialised memory (NaN logits). It also builds every rotary table with base 10,000 whatever the
model's ``rope_theta`` (100,000 on SmolLM2): a silent error on 4.x too. :func:`apply` fixes these
(idempotent); :func:`load_eagle_model` builds an ``EaModel`` from a base model's and a head's
directories without the hub (``EaModel.from_pretrained`` reads ``architectures`` from the base's
config and falls back to the hub for a missing head file).
"""
from __future__ import annotations

from pathlib import Path

import torch

import eagle.model.cnets as cnets
import eagle.model.ea_model as ea
import eagle.model.modeling_llama_kv as kv

_APPLIED = []


def rope_theta(config) -> float:
    """The model's RoPE base (transformers 5 keeps it in ``rope_parameters``)."""
    parameters = getattr(config, "rope_parameters", None) or {}
    return float(parameters.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def _init_rope(module):
    def init(self):
        parameters = getattr(self.config, "rope_parameters", None) or {}
        kind = parameters.get("rope_type", "default")
        if kind != "default":
            raise NotImplementedError(f"EAGLE on transformers 5 here: RoPE type {kind!r} is not supported (default only)")
        self.rotary_emb = module.LlamaRotaryEmbedding(self.head_dim, max_position_embeddings=self.max_position_embeddings,
                                                      base=rope_theta(self.config))
    return init


def rebuild_rotary(model: torch.nn.Module) -> torch.nn.Module:
    """Recompute every rotary table of ``model`` (left uninitialised by transformers 5's meta-device load)."""
    for module in model.modules():
        rotary = getattr(module, "rotary_emb", None)
        if isinstance(rotary, (kv.LlamaRotaryEmbedding, cnets.LlamaRotaryEmbedding)) and hasattr(module, "head_dim"):
            device = next(module.parameters()).device
            module.rotary_emb = type(rotary)(module.head_dim, max_position_embeddings=rotary.max_position_embeddings,
                                             base=rotary.base, device=device).to(device)
    return model


def apply() -> None:
    """Patch eagle-llm's classes for transformers 5 (once)."""
    if _APPLIED:
        return
    kv.LlamaAttention._init_rope = _init_rope(kv)
    cnets.LlamaAttention._init_rope = _init_rope(cnets)
    kv.LlamaForCausalLM._tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _APPLIED.append(True)


def load_eagle_model(base_dir, head_dir, dtype: torch.dtype = torch.float32) -> "ea.EaModel":
    """EAGLE's ``EaModel``: the base model of ``base_dir`` (a transformers Llama directory, its
    tokenizer beside it) as EAGLE's KV Llama, and the head of ``head_dir`` (``config.json`` and
    ``pytorch_model.bin`` with the embedding, as :func:`jakiro_ext.integrations.eagle.save_for_eagle`
    writes it), both in ``dtype``, on the CPU. Nothing is fetched from the hub."""
    apply()
    head_dir = Path(head_dir)
    for name in ("config.json", "pytorch_model.bin"):
        if not (head_dir / name).is_file():
            raise FileNotFoundError(f"{head_dir / name} not found: an EAGLE head directory holds config.json and "
                                    "pytorch_model.bin (jakiro_ext.integrations.eagle.save_for_eagle writes them)")
    base = rebuild_rotary(kv.LlamaForCausalLM.from_pretrained(str(base_dir), dtype=dtype).eval())
    model = ea.EaModel(base, str(base_dir), str(head_dir / "config.json"))
    state = torch.load(head_dir / "pytorch_model.bin", map_location="cpu", weights_only=True)
    model.ea_layer.load_state_dict(state, strict=True)
    rebuild_rotary(model.ea_layer)
    bases = {float(m.rotary_emb.base) for m in model.ea_layer.modules() if hasattr(m, "rotary_emb")}
    if bases != {rope_theta(base.config)}:
        raise ValueError(f"{head_dir / 'config.json'}: the head's RoPE base {sorted(bases)} is not the base model's "
                         f"{rope_theta(base.config)} (its config.json needs the model's rope_theta)")
    return model.eval()
