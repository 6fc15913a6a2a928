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


def blocked_tokens(draft_to_target: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[vocab_size] bool: the target's tokens outside the draft vocabulary (their draft logits
    are set to -inf: the head never drafts them)."""
    ids = draft_to_target.to(torch.int64).flatten()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(f"draft_to_target holds ids outside [0, {vocab_size})")
    blocked = torch.ones(vocab_size, dtype=torch.bool)
    blocked[ids] = False
    return blocked
