"""The decoding settings every entry point shares: the draft tree's shape (``TreeConfig``) and its
bounds, the batch and cache limits, and the checks of the sampling options (a TypeError or
ValueError naming the argument)."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from jakiro_ext.methods import METHODS

INITIAL_ROOM = 256  # new tokens the KV caches hold before their first growth
MAX_BATCH = 1024  # sequences decoded together (each holds its own KV cache rows)


# Bounds of a draft tree (TreeConfig): far beyond every published tree (60 nodes, depth 5-8,
# top-k 10), and small enough that one round can neither hang nor allocate without bound.
MAX_TREE_NODES, MAX_TREE_DEPTH, MAX_TREE_TOP_K = 1024, 64, 128


# ----------------------------------------------------------------------------- argument checks
def brief(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def one_for_the_batch(name: str, value, kind: str) -> None:
    """A list or tensor given for a scalar setting: the per-sequence values a batch does not take."""
    if isinstance(value, (list, tuple)) or (isinstance(value, torch.Tensor) and value.dim() > 0):
        raise TypeError(f"{name} must be {kind}, one value for every sequence of a batch (per-sequence values "
                        f"are not supported), got {type(value).__name__} {brief(value)}")


def int_arg(name: str, value, low: Optional[int] = None, high: Optional[int] = None) -> int:
    """``value`` as an int (any integral number but a bool) within [low, high], else a
    TypeError / ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        one_for_the_batch(name, value, "an int")
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {brief(value)}")
    value = int(value)
    if (low is not None and value < low) or (high is not None and value > high):
        expected = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {expected}, got {value}")
    return value


def real_arg(name: str, value) -> float:
    """``value`` as a finite float (any real number but a bool), else a TypeError / ValueError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        one_for_the_batch(name, value, "a real number")
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {brief(value)}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return float(value)


def check_sampling_options(max_new_tokens, temperature, top_p, top_k, seed):
    """The generation options shared by the API and the CLI (which checks them before loading a
    model): (max_new_tokens, temperature, top_p, top_k, seed) as ints and floats, or a TypeError
    / ValueError naming the argument."""
    max_new_tokens = int_arg("max_new_tokens", max_new_tokens, 1)
    temperature = real_arg("temperature", temperature)
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0: greedy), got {temperature}")
    top_p = real_arg("top_p", top_p)
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    top_k = int_arg("top_k", top_k, 0)
    seed = int_arg("seed", seed, 0, 2**63 - 1)
    return max_new_tokens, temperature, top_p, top_k, seed


@dataclass
class TreeConfig:
    """Shape of the draft tree.

    Dynamic (EAGLE-2): every expansion keeps the ``top_k`` best nodes of a layer (by cumulative
    draft log-probability) as the next frontier and takes ``top_k`` children of each; after
    ``depth`` expansions (EAGLE-2's convention: a path holds up to depth + 1 drafted tokens)
    the ``total_tokens - 1`` best drafted nodes, with the root, are verified.
    Static (EAGLE-1 / Medusa): ``choices`` lists every node as its path of child ranks from the
    root, e.g. ``[[0], [1], [0, 0]]``: child rank r of a node is its draft's r-th best token.

    Bounded so that a round's work is (MAX_TREE_NODES: verification computes [nodes, vocab]
    logits; a dynamic round drafts up to depth x top_k**2 candidates): at most MAX_TREE_NODES
    nodes, depth <= MAX_TREE_DEPTH, top_k (and static child ranks) < MAX_TREE_TOP_K + 1.
    """
    total_tokens: int = 60
    depth: int = 5
    top_k: int = 10
    choices: Optional[Sequence[Sequence[int]]] = None

    def __post_init__(self):
        for name in ("total_tokens", "depth", "top_k"):
            int_arg(f"tree {name}", getattr(self, name))
        if self.choices is not None:
            def is_path(p):
                return isinstance(p, (list, tuple)) and all(isinstance(r, numbers.Integral) and not isinstance(r, bool)
                                                            for r in p)
            if not isinstance(self.choices, (list, tuple)) or not all(is_path(p) for p in self.choices):
                raise ValueError(f"static tree choices must be a list of lists of child ranks, got {brief(self.choices)}")
            paths = {tuple(int(r) for r in p) for p in self.choices}
            if not paths or any(len(p) == 0 or min(p) < 0 for p in paths):
                raise ValueError(f"static tree choices must be non-empty paths of ranks >= 0, got {self.choices!r}")
            missing = [p for p in paths if len(p) > 1 and p[:-1] not in paths]
            if missing:
                raise ValueError(f"static tree choices must contain every node's parent; missing parents of {missing[:3]}")
            if (len(paths) + 1 > MAX_TREE_NODES or max(map(len, paths)) > MAX_TREE_DEPTH
                    or max(max(p) for p in paths) >= MAX_TREE_TOP_K):
                raise ValueError(f"a static tree holds at most {MAX_TREE_NODES} nodes (root included), paths of at most "
                                 f"{MAX_TREE_DEPTH} ranks and ranks below {MAX_TREE_TOP_K}; got {len(paths) + 1} nodes, "
                                 f"depth {max(map(len, paths))}, largest rank {max(max(p) for p in paths)}")
        elif not (2 <= self.total_tokens <= MAX_TREE_NODES and 1 <= self.depth <= MAX_TREE_DEPTH
                  and 1 <= self.top_k <= MAX_TREE_TOP_K):
            raise ValueError(f"a dynamic tree needs total_tokens in [2, {MAX_TREE_NODES}], depth in [1, {MAX_TREE_DEPTH}] "
                             f"and top_k in [1, {MAX_TREE_TOP_K}], got {self.total_tokens}/{self.depth}/{self.top_k} "
                             "(total_tokens/depth/top_k)")

    def key(self) -> tuple:
        """Its value, hashable (a dataclass that may change is not)."""
        return (self.total_tokens, self.depth, self.top_k,
                None if self.choices is None else tuple(tuple(int(r) for r in p) for p in self.choices))

    def max_nodes_for(self, method) -> int:
        """The most nodes one round of ``method`` (a name or a :class:`Method`) can verify, the
        root included (:meth:`Method.max_nodes`: what the KV caches are sized by)."""
        return (METHODS[method] if isinstance(method, str) else method).max_nodes(self)


def tree_key(tree: Optional[TreeConfig]) -> Optional[tuple]:
    """A tree's value, hashable (:meth:`TreeConfig.key`); None for plain decoding's."""
    return None if tree is None else tree.key()


# The published comparisons' tree, and the CPU default chosen by measurement (README, "Tree size").
GPU_TREE = TreeConfig(60, 5, 10)
CPU_TREE = TreeConfig(6, 2, 2)
