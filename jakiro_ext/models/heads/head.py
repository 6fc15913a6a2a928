"""What the engine asks of a draft head, and the checks every kind of head shares.

:class:`Head` is the protocol the drafter, the round and ``speculative_generate`` read: the
EAGLE-1/2 / Jakiro / Gumiho head (:class:`~jakiro_ext.models.heads.draft_head.DraftHead`) and
the EAGLE-3 head (:class:`~jakiro_ext.models.heads.eagle3.Eagle3Head`) are two implementations
side by side, neither a subclass of the other.
"""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Optional, Protocol, runtime_checkable

import torch
from torch import nn

from jakiro_ext.kv_cache import BufferPool, KVCache, TreeKV
from jakiro_ext.models.heads.config import CONFIG_FILE
from jakiro_ext.models.heads.drafting import Products
from jakiro_ext.models.heads.step import DraftStep
from jakiro_ext.models.llama import LlamaModel, model_name


@runtime_checkable
class Head(Protocol):
    """A draft head bound to a target. ``config`` gives ``kind``, ``num_experts``,
    ``cache_shape()`` (and a dense head's ``num_mlp_heads``); ``acceptance`` its measured profile
    (or None); ``feature_layers`` the target layers it reads (empty: the target's last hidden
    state)."""

    config: object
    acceptance: Optional[dict]
    lm_head_weight: Optional[torch.Tensor]

    def bind(self, target: LlamaModel) -> "Head": ...

    def check_target(self, target: LlamaModel) -> None: ...

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor: ...

    def new_cache(self, capacity: int, max_capacity: Optional[int] = None, batch: int = 1,
                  pool: Optional[BufferPool] = None) -> KVCache: ...

    def products(self) -> Products: ...

    def forward(self, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                tree_mask: torch.Tensor, ancestors: Optional[TreeKV] = None) -> DraftStep: ...

    def save(self, path, dtype: Optional[torch.dtype] = None, metadata: Optional[dict] = None, format: str = ...,
             full_vocabulary: bool = False, extra_files: Optional[dict] = None) -> None: ...


def check_target_shapes(config, target: LlamaModel) -> None:
    """A head made for another target is a ValueError when the shapes differ (hidden size,
    vocabulary), and a warning when they fit but the head's config names another model (the
    output stays exact, the drafts are the other model's guesses)."""
    t = target.config
    for name, mine, theirs in (("hidden_size", config.hidden_size, t.hidden_size),
                               ("vocab_size", config.vocab_size, t.vocab_size)):
        if mine != theirs:
            raise ValueError(f"the draft head was made for a target with {name} {mine}, but this target has "
                             f"{name} {theirs}" + (f" (the head's target: {config.target})" if config.target else ""))
    if config.target and t.name and model_name(config.target).lower() != model_name(t.name).lower():
        warnings.warn(f"the draft head was made for {config.target!r}, but the target is {t.name!r}: the output is "
                      f"exact all the same, but expect fewer drafts accepted than the head's profile says",
                      stacklevel=2)


def check_target_of(head: Head, target: Optional[LlamaModel], path: Path) -> None:
    """:meth:`Head.check_target` for a head read from ``path``, its errors naming the file."""
    if target is not None:
        try:
            head.check_target(target)
        except ValueError as exc:
            raise ValueError(f"{path / CONFIG_FILE}: {exc}") from None


def load_checked_state(module: nn.Module, state: dict, weights: Path) -> None:
    """Load ``state`` into ``module`` after checking that it fits: names, shapes, the kind of
    dtype (floating point or integer), finite values; anything else is a ValueError naming the
    file ``weights`` and the tensors."""
    mine = module.state_dict()
    missing, unexpected = sorted(set(mine) - set(state)), sorted(set(state) - set(mine))
    problems = ([f"missing tensors {missing[:3]}"] if missing else []) + (
        [f"unexpected tensors {unexpected[:3]}"] if unexpected else [])
    problems += [f"{k} has shape {list(v.shape)}, expected {list(mine[k].shape)}"
                 for k, v in state.items() if k in mine and v.shape != mine[k].shape][:3]
    problems += [f"{k} has dtype {v.dtype}, expected {'a floating-point' if mine[k].is_floating_point() else 'an integer'}"
                 " tensor" for k, v in state.items() if k in mine and (v.dtype == torch.bool or v.is_complex()
                                                                      or v.is_floating_point() != mine[k].is_floating_point())][:3]
    problems += [f"{k} holds non-finite values" for k, v in state.items()
                 if v.is_floating_point() and not bool(torch.isfinite(v).all())][:3]
    if problems:
        raise ValueError(f"{weights} does not fit its {CONFIG_FILE}: " + "; ".join(problems))
    module.load_state_dict({k: v.to(mine[k].dtype) for k, v in state.items()})


def new_head_cache(config, weight: torch.Tensor, capacity: int, max_capacity: Optional[int], batch: int,
                   pool: Optional[BufferPool] = None) -> KVCache:
    """A head's KV cache: ``capacity`` positions per sequence, growing on demand up to
    ``max_capacity`` (None: fixed), in the dtype and on the device of the head's ``weight``; its
    buffers from ``pool`` where it keeps them (:class:`KVCache`)."""
    return KVCache(config.cache_shape(), batch, capacity, dtype=weight.dtype, device=weight.device,
                   max_capacity=max_capacity, pool=pool)
