"""Serving-format tensors into an engine's draft model: the one mapping both plugins use.

The engines hold layer 0 as their own Llama decoder layer: the attention's q, k and v stacked
into ``qkv_proj`` and a dense MLP's gate and up into ``gate_up_proj`` (each stacked parameter
loaded shard by shard by its ``weight_loader``), everything under ``model.``. Their own loaders
skip unknown tensors and never report a parameter left unloaded (vLLM's ``torch.empty`` memory
would then draft); this one refuses both.
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional, Tuple

import torch
from torch import nn

from jakiro_ext.serving.format import ARCHITECTURE, blocked_tokens, settings
from jakiro_ext.serving.layers import JakiroMoE

# (checkpoint name part, the engine's stacked parameter part, shard)
STACKED = ((".q_proj", ".qkv_proj", "q"), (".k_proj", ".qkv_proj", "k"), (".v_proj", ".qkv_proj", "v"),
           (".gate_proj", ".gate_up_proj", 0), (".up_proj", ".gate_up_proj", 1))
SHARED = ("model.embed_tokens.", "lm_head.")  # the target's, shared by the engine after loading


def load_serving_weights(model: nn.Module, weights: Iterable[Tuple[str, torch.Tensor]],
                         default_loader: Callable) -> Optional[torch.Tensor]:
    """Load ``weights`` (name, tensor) of a serving-format head into ``model``; returns its
    ``draft_to_target`` (None: it drafts over the whole vocabulary). A tensor with no parameter,
    or a parameter (or shard) left unloaded, is a ValueError naming it."""
    params = dict(model.named_parameters())
    loaded, draft_to_target = set(), None
    for name, tensor in weights:
        if name == "draft_to_target":
            draft_to_target = tensor
            continue
        full = "model." + name
        stacked = next(((full.replace(part, into), shard) for part, into, shard in STACKED if part in full), None)
        target, shard = stacked or (full, None)
        if target not in params:
            raise ValueError(f"the serving-format tensor {name!r} has no parameter {target!r} in the engine's draft "
                             f"model {type(model).__name__}")
        param = params[target]
        if shard is None:
            getattr(param, "weight_loader", default_loader)(param, tensor)
        else:
            param.weight_loader(param, tensor, shard)
        loaded.add((target, shard))
    required = set()
    for name in params:
        if name.startswith(SHARED):
            continue
        shards = {into: [s for _, i, s in STACKED if i == into] for _, into, _ in STACKED}
        part = next((into for into in shards if into + "." in name), None)
        required |= {(name, s) for s in shards[part]} if part else {(name, None)}
    missing = sorted(f"{n}" + (f" (shard {s})" if s is not None else "") for n, s in required - loaded)
    if missing:
        raise ValueError(f"the draft head's weights leave parameters of {type(model).__name__} unloaded: {missing[:4]}")
    return draft_to_target


def set_up_draft(model: nn.Module, config, layers: Iterable[nn.Module], dtype: torch.dtype) -> bool:
    """An engine's EAGLE Llama draft made this package's (both plugins' classes): the head's
    settings read from ``config.jakiro``, each of ``layers``' MLP replaced by the MoE block for a
    MoE head, and a ``blocked`` buffer (the tokens outside the draft vocabulary, filled by
    :func:`load_draft_weights`). Returns whether the head is MoE."""
    own = settings({"jakiro": getattr(config, "jakiro", None)}, f"the {ARCHITECTURE} draft's config.json")
    if own.get("num_experts"):
        for layer in layers:
            layer.mlp = JakiroMoE(config.hidden_size, own["expert_intermediate_size"], own["num_experts"],
                                  bool(own.get("renormalize")), dtype=dtype)
    model.register_buffer("blocked", torch.zeros(config.vocab_size, dtype=torch.bool), persistent=False)
    return bool(own.get("num_experts"))


def load_draft_weights(model: nn.Module, weights: Iterable[Tuple[str, torch.Tensor]], default_loader: Callable) -> bool:
    """:func:`load_serving_weights` into a draft set up by :func:`set_up_draft`, its ``blocked``
    buffer filled; returns whether the head drafts over a reduced vocabulary."""
    draft_to_target = load_serving_weights(model, weights, default_loader)
    if draft_to_target is not None:
        model.blocked.copy_(blocked_tokens(draft_to_target, model.config.vocab_size))
    return draft_to_target is not None
