"""The draft-verify loop: ``speculative_generate``.

Each round the draft head proposes a tree rooted at the last emitted token (not yet in the
target's cache), the target runs the whole tree in one forward (``jakiro::tree_attention`` with
the tree's ancestor mask), ``jakiro::verify_tree`` accepts the longest valid path plus a bonus
token (greedy, or lossless recursive rejection sampling), ``jakiro::compact_kv`` moves the
accepted path's keys/values into place, and the draft catches up on the accepted tokens with the
target's fresh hidden states. Plain autoregressive decoding is the same loop with a one-node tree.

Batch size 1 (the setting every published speedup is measured in).

Bad arguments are a TypeError (wrong type) or ValueError (wrong value) naming the argument,
raised before anything is allocated or run. The KV caches start small and grow on demand, up to
what the generation can use: the prompt, the tokens the context limit and ``max_new_tokens``
leave room for, and the largest tree the method can draft.
"""
from __future__ import annotations

import math
import numbers
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence

import torch

from jakiro_ext import ops
from jakiro_ext.models.draft_head import DraftHead, DraftStep, TreeKV
from jakiro_ext.models.llama import LlamaModel, causal_tree_mask, packed_bit_ranges

METHODS = ("ar", "eagle2", "jakiro", "jakiro_star")
INITIAL_ROOM = 256  # new tokens the KV caches hold before their first growth
# Bounds of a draft tree (TreeConfig): far beyond every published tree (60 nodes, depth 5-8,
# top-k 10), and small enough that one round can neither hang nor allocate without bound.
MAX_TREE_NODES, MAX_TREE_DEPTH, MAX_TREE_TOP_K = 1024, 64, 128


# ----------------------------------------------------------------------------- argument checks
def _brief(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _int_arg(name: str, value, low: Optional[int] = None, high: Optional[int] = None) -> int:
    """``value`` as an int (any integral number but a bool) within [low, high], else a
    TypeError / ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {_brief(value)}")
    value = int(value)
    if (low is not None and value < low) or (high is not None and value > high):
        expected = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {expected}, got {value}")
    return value


def _real_arg(name: str, value) -> float:
    """``value`` as a finite float (any real number but a bool), else a TypeError / ValueError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {_brief(value)}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return float(value)


def check_sampling_options(max_new_tokens, temperature, top_p, top_k, seed):
    """The generation options shared by the API and the CLI (which checks them before loading a
    model): (max_new_tokens, temperature, top_p, top_k, seed) as ints and floats, or a TypeError
    / ValueError naming the argument."""
    max_new_tokens = _int_arg("max_new_tokens", max_new_tokens, 1)
    temperature = _real_arg("temperature", temperature)
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0: greedy), got {temperature}")
    top_p = _real_arg("top_p", top_p)
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    top_k = _int_arg("top_k", top_k, 0)
    seed = _int_arg("seed", seed, 0, 2**63 - 1)
    return max_new_tokens, temperature, top_p, top_k, seed


def _prompt_ids(input_ids, vocab: int) -> torch.Tensor:
    """The prompt as an int64 [n] tensor: from a list of ints or an integer tensor, [n] or [1, n],
    non-empty, every id in the target's vocabulary."""
    if isinstance(input_ids, (list, tuple)):
        if input_ids and isinstance(input_ids[0], (list, tuple)):  # [[...]]: a batch
            if len(input_ids) != 1:
                raise ValueError(f"speculative_generate decodes one sequence (batch size 1); got input_ids with "
                                 f"{len(input_ids)} rows")
            input_ids = input_ids[0]
        bad = [x for x in input_ids if isinstance(x, bool) or not isinstance(x, numbers.Integral)]
        if bad:
            raise TypeError(f"input_ids must be ints (token ids), got {type(bad[0]).__name__} {_brief(bad[0])}")
        values = [int(x) for x in input_ids]
        low, high = (min(values), max(values)) if values else (0, 0)
    elif isinstance(input_ids, torch.Tensor):
        if input_ids.dtype == torch.bool or input_ids.is_floating_point() or input_ids.is_complex():
            raise TypeError(f"input_ids must be an integer tensor, got dtype {input_ids.dtype}")
        if input_ids.dim() == 2 and input_ids.shape[0] != 1:
            raise ValueError(f"speculative_generate decodes one sequence (batch size 1); got input_ids "
                             f"{tuple(input_ids.shape)}")
        if input_ids.dim() not in (1, 2):
            raise ValueError(f"input_ids must be [n] or [1, n], got shape {tuple(input_ids.shape)}")
        values = input_ids.reshape(-1)
        low, high = (int(values.min()), int(values.max())) if values.numel() else (0, 0)
    else:
        raise TypeError(f"input_ids must be a list of ints or an integer tensor, got {type(input_ids).__name__}")
    if len(values) == 0:
        raise ValueError("input_ids must not be empty")
    if low < 0 or high >= vocab:
        raise ValueError(f"input_ids must be token ids in [0, {vocab}) (the target's vocabulary), "
                         f"got values in [{low}, {high}]")
    return torch.as_tensor(values, dtype=torch.int64)


def _eos_ids(eos_token_id) -> set:
    """The token ids that end a generation: None, an int or a list / tuple of ints."""
    values = [] if eos_token_id is None else eos_token_id if isinstance(eos_token_id, (list, tuple)) else [eos_token_id]
    if any(isinstance(x, bool) or not isinstance(x, numbers.Integral) for x in values):
        raise TypeError(f"eos_token_id must be None, an int or a list of ints, got {type(eos_token_id).__name__} "
                        f"{_brief(eos_token_id)}")
    return {int(x) for x in values}


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
            _int_arg(f"tree {name}", getattr(self, name))
        if self.choices is not None:
            def is_path(p):
                return isinstance(p, (list, tuple)) and all(isinstance(r, numbers.Integral) and not isinstance(r, bool)
                                                            for r in p)
            if not isinstance(self.choices, (list, tuple)) or not all(is_path(p) for p in self.choices):
                raise ValueError(f"static tree choices must be a list of lists of child ranks, got {_brief(self.choices)}")
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

    def max_nodes_for(self, method: str) -> int:
        """The most nodes one round of ``method`` can verify, the root included (what the KV caches
        are sized by). A static tree has its nodes. A dynamic tree keeps at most ``total_tokens``,
        and can't draft more than c children of the root plus, per expansion, c children of each
        of its ``top_k`` frontier nodes, with c = ``top_k`` (``jakiro_star``: 2 ``top_k``, both
        experts' proposals). ``jakiro`` runs depth - 1 expansions, the last one also attaching
        ``top_k`` contrastive candidates per frontier node: the same count."""
        if method == "ar":
            return 1
        if self.choices is not None:
            return len({tuple(p) for p in self.choices}) + 1
        c = 2 * self.top_k if method == "jakiro_star" else self.top_k
        return min(self.total_tokens, 1 + c + self.depth * self.top_k * c)


# The published comparisons' tree, and the CPU default chosen by measurement (README, "Tree size").
GPU_TREE = TreeConfig(60, 5, 10)
CPU_TREE = TreeConfig(6, 2, 2)


@dataclass
class GenerationStats:
    new_tokens: int = 0
    target_forwards: int = 0  # every target forward, the prompt's included
    draft_forwards: int = 0
    accept_lengths: List[int] = field(default_factory=list)  # drafted tokens accepted, per round
    prefill_s: float = 0.0
    wall_time_s: float = 0.0
    # "eos", "max_new_tokens", "context_limit" (the target's max_position_embeddings came before
    # max_new_tokens) or "cache_full" (a user-given max_cache_len ran out)
    stop_reason: str = ""

    @property
    def tau(self) -> float:
        """Tokens per target forward, counting every forward."""
        return self.new_tokens / max(self.target_forwards, 1)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_time_s if self.wall_time_s > 0 else 0.0

    @property
    def accept_histogram(self) -> List[int]:
        """Rounds that accepted 0, 1, 2, ... drafted tokens."""
        hist = [0] * (max(self.accept_lengths, default=0) + 1)
        for n in self.accept_lengths:
            hist[n] += 1
        return hist

    def as_dict(self) -> dict:
        return dict(new_tokens=self.new_tokens, target_forwards=self.target_forwards,
                    draft_forwards=self.draft_forwards, tau=self.tau, tokens_per_s=self.tokens_per_s,
                    wall_time_s=self.wall_time_s, prefill_s=self.prefill_s,
                    accept_histogram=self.accept_histogram, stop_reason=self.stop_reason)


@dataclass
class GenerationOutput:
    token_ids: List[int]  # the generated tokens (EOS included when it ended the generation)
    stats: GenerationStats


# ----------------------------------------------------------------------------- drafting
def _dedupe(logprobs: torch.Tensor, ids: torch.Tensor):
    """Sort candidate rows [R, C] by log-probability and set repeated tokens (two experts
    proposing the same one) to -inf, so a token is never two siblings."""
    logprobs, order = logprobs.sort(dim=-1, descending=True, stable=True)
    ids = ids.gather(-1, order)
    # A token's first (most probable) occurrence stays. Sorted by id (stably: occurrences keep
    # their probability order), a repeat comes right after an earlier occurrence: O(C log C) a
    # row, not a [R, C, C] comparison.
    by_id, position = ids.sort(dim=-1, stable=True)
    later = torch.zeros_like(by_id, dtype=torch.bool)
    later[..., 1:] = by_id[..., 1:] == by_id[..., :-1]
    repeated = torch.zeros_like(later).scatter(-1, position, later)
    # Sort again so the dropped repeats go last: a child's rank is its rank among distinct tokens.
    logprobs, order = logprobs.masked_fill(repeated, float("-inf")).sort(dim=-1, descending=True, stable=True)
    return logprobs, ids.gather(-1, order)


class Drafter:
    """The draft head's side of the loop for one sequence: its KV cache (committed up to the
    last emitted token), the latest catch-up output, and tree building."""

    def __init__(self, head: DraftHead, method: str, tree: TreeConfig, capacity: int,
                 max_capacity: Optional[int] = None):
        """``capacity`` committed positions to start with, growing up to ``max_capacity`` (default: fixed)."""
        if head.lm_head_weight is None:
            raise ValueError("the draft head is not bound to a target: call head.bind(target) (DraftHead.load does it)")
        if method in ("jakiro", "jakiro_star") and not head.config.num_experts:
            raise ValueError(f"method {method!r} needs a Jakiro (MoE) draft head; this head is {head.config.kind!r}")
        if method == "jakiro" and tree.choices is not None:
            raise ValueError("method 'jakiro' (hybrid contrastive last step) builds the dynamic tree; "
                             "with a static tree use 'eagle2' or 'jakiro_star'")
        if method == "jakiro" and tree.depth < 2:
            raise ValueError(f"method 'jakiro' takes its last layer from the contrastive branch and needs depth >= 2, "
                             f"got {tree.depth}")
        self.head, self.method, self.tree = head, method, tree
        vocab = head.lm_head_weight.shape[0]
        width = tree.top_k if tree.choices is None else self._static_width
        if width > vocab:
            what = "children drafted per node" if tree.choices is None else "a static tree's widest child rank + 1"
            raise ValueError(f"the tree's top_k ({what}) is {width}, more than the draft vocabulary of the head "
                             f"({vocab} tokens)")
        # Beyond the committed tokens, a tree layer's rows need scratch slots (at most the
        # frontier: top_k nodes, or a whole static layer), and a catch-up at most the tree.
        scratch = max(tree.top_k, tree.max_nodes_for(method))
        self.cache = head.new_cache(capacity + scratch, None if max_capacity is None else max_capacity + scratch)
        self.root_step: Optional[DraftStep] = None
        self.forwards = 0

    def catch_up(self, tokens: torch.Tensor, features: torch.Tensor) -> None:
        """Run the pairs (tokens[i], features[i]) (token t+1 with the target's feature at t),
        commit them, and keep the last row's output: it predicts the next tree's first layer."""
        n = tokens.shape[0]
        start = int(self.cache.lengths[0])
        positions = torch.arange(start, start + n, device=tokens.device).unsqueeze(0)
        step = self.head(tokens.unsqueeze(0), features.unsqueeze(0), positions, self.cache, causal_tree_mask(1, n))
        self.cache.lengths += n
        self.forwards += 1
        self.root_step = DraftStep(*(None if t is None else t[:, -1:] for t in step))

    def _topk(self, features: torch.Tensor, k: int):
        """Top-k (log-probabilities, target token ids) of features [R, (E,) H] under the draft's LM head."""
        lp, ids = ops.contrastive_topk(features, None, None, self.head.lm_head_weight, k)
        if bool((ids < 0).any()):  # the op's mark of a row whose logits are not finite
            raise RuntimeError("the draft head produced non-finite logits (NaN or inf): no token can be drafted "
                               "(check the head's weights)")
        return lp, self.head.target_ids(ids)

    def _children(self, step: DraftStep, hybrid: bool = False):
        """Candidate children of each row of ``step``: (logprobs, ids) [R, C], and with
        ``hybrid`` also the contrastive branch's candidates two tokens ahead [R, k]. All the
        features of one call share a single pass over the LM head."""
        k = self.tree.top_k if self.tree.choices is None else self._static_width
        if self.method == "jakiro_star":
            lp, ids = self._topk(step.branch_features()[0], k)  # [R, 2, k]
            return _dedupe(lp.flatten(1), ids.flatten(1)), None
        if hybrid:
            both = torch.stack([step.feature[0], step.contrastive_feature()[0]], 1)  # [R, 2, H]
            lp, ids = self._topk(both, k)
            return (lp[:, 0], ids[:, 0]), (lp[:, 1], ids[:, 1])
        return self._topk(step.feature[0], k), None

    def draft(self, root_token: int):
        """Build this round's tree. Returns tokens [T], parents [T] (root first, parents before
        children) and depths [T], as int64 tensors."""
        if self.tree.choices is not None:
            return self._draft_static(root_token)
        return self._draft_dynamic(root_token)

    def _run_layer(self, frontier: List[int], node_tokens: list, parent_of: list, step_rows, depth: int,
                   tree_kv: TreeKV, kv_nodes: List[int]) -> DraftStep:
        """One draft forward over the frontier nodes (all at ``depth``), attending to the
        committed prefix, their ancestors among earlier layers' nodes, and themselves."""
        device = self.cache.kv.device
        n = len(frontier)
        start = int(self.cache.lengths[0])
        tokens = torch.tensor([node_tokens[i] for i in frontier], device=device).unsqueeze(0)
        features = step_rows.unsqueeze(0)
        positions = torch.full((1, n), start - 1 + depth, device=device)
        if kv_nodes:
            slot = {node: j for j, node in enumerate(kv_nodes)}
            visible = torch.zeros(1, n, len(kv_nodes), dtype=torch.bool, device=device)
            for r, node in enumerate(frontier):
                p = parent_of[node]
                while p > 0:
                    visible[0, r, slot[p]] = True
                    p = parent_of[p]
            tree_kv.visible = visible
        rows = torch.arange(n, device=device)
        itself = packed_bit_ranges(rows, rows, n).unsqueeze(0)
        step = self.head(tokens, features, positions, self.cache, itself, tree_kv)
        tree_kv.append(self.cache, n)
        kv_nodes.extend(frontier)
        self.forwards += 1
        return step

    def _draft_dynamic(self, root_token: int):
        tree = self.tree
        k = tree.top_k
        node_tokens, parent_of, depth_of, scores = [root_token], [-1], [0], [0.0]

        def add(parent: int, tokens, logprobs, depth: int) -> List[int]:
            base = scores[parent]
            new = []
            for t, lp in zip(tokens, logprobs):
                if lp == float("-inf"):
                    continue
                new.append(len(node_tokens))
                node_tokens.append(t)
                parent_of.append(parent)
                depth_of.append(depth)
                scores.append(base + lp)
            return new

        (lp, ids), _ = self._children(self.root_step)
        layer = add(0, ids[0].tolist(), lp[0].tolist(), 1)
        parent_rows = {node: 0 for node in layer}  # the step row holding each node's parent's output
        prev_step = self.root_step
        tree_kv, kv_nodes = TreeKV(), []
        expansions = tree.depth - 1 if self.method == "jakiro" else tree.depth
        for d in range(1, expansions + 1):
            frontier = sorted(layer, key=lambda i: -scores[i])[:k]
            rows = torch.stack([prev_step.feature[0, parent_rows[i]] for i in frontier])
            hybrid = self.method == "jakiro" and d == expansions
            step = self._run_layer(frontier, node_tokens, parent_of, rows, d, tree_kv, kv_nodes)
            (lp, ids), contrastive = self._children(step, hybrid)
            lp, ids = lp.tolist(), ids.tolist()
            layer, parent_rows = [], {}
            for r, node in enumerate(frontier):
                children = add(node, ids[r], lp[r], d + 1)
                layer += children
                parent_rows.update({c: r for c in children})
                if contrastive is not None and children:
                    # The contrastive branch at `node` predicts two tokens ahead, assuming the
                    # draft's best next token: attach under node's best child (not under the
                    # r-th selected child, the released code's slip) with that child's score.
                    best = max(children, key=lambda c: scores[c])
                    add(best, contrastive[1][r].tolist(), contrastive[0][r].tolist(), d + 2)
            prev_step = step
        # Keep the best total_tokens - 1 drafted nodes. A child never outscores its parent
        # (log-probabilities <= 0) and ties go to the lower index, so the set holds its ancestors.
        order = torch.tensor(scores[1:], dtype=torch.float64).sort(descending=True, stable=True).indices
        keep = sorted((order[: tree.total_tokens - 1] + 1).tolist())
        return self._pack([0] + keep, node_tokens, parent_of, depth_of)

    @property
    def _static_width(self) -> int:
        return max(int(p[-1]) for p in self.tree.choices) + 1

    def _draft_static(self, root_token: int):
        paths = sorted({tuple(p) for p in self.tree.choices}, key=lambda p: (len(p), p))
        node_of = {(): 0}
        node_tokens, parent_of, depth_of = [root_token], [-1], [0]
        steps = {}  # node -> (the step holding its output, its row there)
        tree_kv, kv_nodes = TreeKV(), []
        by_depth = {}
        for p in paths:
            by_depth.setdefault(len(p), []).append(p)
        candidates = {}
        for d in sorted(by_depth):
            parents = sorted({node_of[p[:-1]] for p in by_depth[d] if p[:-1] in node_of})
            if not parents:  # every node of the layer above was dropped (no distinct candidate left)
                break
            if d == 1:
                step = self.root_step
            else:  # run the parents' layer (depth d - 1) to get their outputs
                rows = torch.stack([steps[parent_of[n]][0].feature[0, steps[parent_of[n]][1]] for n in parents])
                step = self._run_layer(parents, node_tokens, parent_of, rows, d - 1, tree_kv, kv_nodes)
            steps.update({n: (step, r) for r, n in enumerate(parents)})
            (lp, ids), _ = self._children(step)
            lp, ids = lp.tolist(), ids.tolist()
            candidates.update({n: (lp[r], ids[r]) for r, n in enumerate(parents)})
            for p in by_depth[d]:
                parent = node_of.get(p[:-1])
                if parent is None:
                    continue  # its parent had no valid candidate
                lp, ids = candidates[parent]
                if p[-1] >= len(ids) or lp[p[-1]] == float("-inf"):
                    continue
                node_of[p] = len(node_tokens)
                node_tokens.append(ids[p[-1]])
                parent_of.append(parent)
                depth_of.append(d)
        return self._pack(list(range(len(node_tokens))), node_tokens, parent_of, depth_of)

    def _pack(self, keep: List[int], node_tokens, parent_of, depth_of):
        index = {node: i for i, node in enumerate(keep)}
        device = self.cache.kv.device
        tokens = torch.tensor([node_tokens[n] for n in keep], device=device)
        parents = torch.tensor([index[parent_of[n]] if n else -1 for n in keep], device=device)
        depths = torch.tensor([depth_of[n] for n in keep], device=device)
        return tokens, parents, depths


# ----------------------------------------------------------------------------- the loop
def speculative_generate(target: LlamaModel, draft: Optional[DraftHead], input_ids, max_new_tokens: int = 128, *,
                         method: Optional[str] = None, tree: Optional[TreeConfig] = None, temperature: float = 0.0,
                         top_p: float = 1.0, top_k: int = 0, eos_token_id=None, seed: int = 0,
                         max_cache_len: Optional[int] = None,
                         on_tokens: Optional[Callable[[List[int]], None]] = None) -> GenerationOutput:
    """Generate up to ``max_new_tokens`` tokens after ``input_ids``, losslessly: at temperature 0
    the tokens are the target's greedy ones; above it they follow the target's distribution
    (after temperature, top-k, top-p).

    Parameters
    ----------
    target : the target model.
    draft : a draft head bound to ``target`` (``DraftHead.load(path, target)``); None for ``ar``.
    input_ids : the prompt: a list of ints or an integer tensor, [n] or [1, n], of token ids of
        the target's vocabulary. It must leave room for one new token in the target's context
        (``target.config.max_position_embeddings``).
    max_new_tokens : an int >= 1. No token is generated at a position beyond the context limit:
        when the limit comes first, the generation ends there (``stop_reason`` "context_limit").
    method : ``ar`` (plain decoding), ``eagle2`` (dynamic tree, autoregressive drafting),
        ``jakiro`` (the last layer from the contrastive branch, one draft forward fewer) or
        ``jakiro_star`` (each activated expert proposes its own children). Default: ``jakiro``
        for a MoE head, ``eagle2`` for a dense one, ``ar`` without a head.
    tree : a :class:`TreeConfig`. Default on CPU: chosen by measured cost for a head with an
        acceptance profile (:mod:`jakiro_ext.tree_cost`; the machine's costs are measured once
        and cached), else :data:`CPU_TREE`; elsewhere :data:`GPU_TREE`.
    temperature, top_p, top_k : finite temperature >= 0 (0: greedy), top_p in (0, 1], int top_k >= 0 (0: off).
    eos_token_id : None, an int or a list of ints that end the generation (included in the output).
    seed : an int in [0, 2**63): seeds the draws of sampling (temperature > 0).
    max_cache_len : None or a bound (>= 1) on the target's KV cache positions; the generation
        stops with ``stop_reason`` "cache_full" when it runs out. Either way the caches start
        small and grow on demand, up to prompt + the tokens left to generate + the largest tree
        the method can draft (:meth:`TreeConfig.max_nodes_for`).
    on_tokens : None or a callable, called with each batch of newly emitted tokens (streaming).

    Raises
    ------
    TypeError, ValueError : a bad argument (the message names it), before anything is allocated.
    RuntimeError : the target's or the draft head's logits are not finite (NaN or inf); no token
        is ever emitted that the target did not give.
    MemoryError : a KV cache could not be allocated (the message says how many bytes).
    """
    if not isinstance(target, LlamaModel):
        raise TypeError(f"target must be a LlamaModel, got {type(target).__name__}")
    if draft is not None and not isinstance(draft, DraftHead):
        raise TypeError(f"draft must be a DraftHead or None, got {type(draft).__name__}")
    max_new_tokens, temperature, top_p, top_k, seed = check_sampling_options(max_new_tokens, temperature, top_p,
                                                                             top_k, seed)
    ids = _prompt_ids(input_ids, target.config.vocab_size)
    eos = _eos_ids(eos_token_id)
    if max_cache_len is not None:
        max_cache_len = _int_arg("max_cache_len", max_cache_len, 1)
    if method is not None and not isinstance(method, str):
        raise TypeError(f"method must be a str (one of {METHODS}), got {type(method).__name__} {_brief(method)}")
    if tree is not None and not isinstance(tree, TreeConfig):
        raise TypeError(f"tree must be a TreeConfig, got {type(tree).__name__} {_brief(tree)}")
    if on_tokens is not None and not callable(on_tokens):
        raise TypeError(f"on_tokens must be None or a callable, got {type(on_tokens).__name__}")
    if method is None:
        method = ("jakiro" if draft.config.num_experts else "eagle2") if draft is not None else "ar"
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if method != "ar" and draft is None:
        raise ValueError(f"method {method!r} needs a draft head")
    device = target.lm_head.weight.device
    if tree is None and device.type == "cpu" and method != "ar":
        from jakiro_ext.tree_cost import auto_tree

        tree = auto_tree(target, draft, method)
    if tree is None:
        tree = CPU_TREE if device.type == "cpu" else GPU_TREE
    n = ids.numel()
    limit = target.config.max_position_embeddings
    if limit is not None and n >= limit:
        raise ValueError(f"the prompt has {n} tokens, but the target's context holds {limit} positions "
                         f"(max_position_embeddings): no room for a new token")
    budget = max_new_tokens if limit is None else min(max_new_tokens, limit - n)  # new tokens at positions < limit
    tree_nodes = tree.max_nodes_for(method)
    bound = n + budget + tree_nodes  # the most the target's cache can hold: committed tokens + one tree
    if max_cache_len is not None:
        if n + tree_nodes > max_cache_len:
            raise ValueError(f"the prompt has {n} tokens; with a {tree_nodes}-node tree it needs a KV cache of at "
                             f"least {n + tree_nodes} positions, but the cache holds {max_cache_len} (max_cache_len)")
        bound = min(bound, max_cache_len)
    start = min(bound, n + INITIAL_ROOM + tree_nodes)
    ids = ids.to(device)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    stats = GenerationStats()
    out: List[int] = []

    def emit(tokens: List[int]) -> bool:
        """Append tokens up to EOS / the budget; True when the generation is over."""
        for i, t in enumerate(tokens):
            if t in eos or len(out) + i + 1 == budget:
                tokens = tokens[: i + 1]
                stats.stop_reason = ("eos" if t in eos else "max_new_tokens" if budget == max_new_tokens
                                     else "context_limit")
                break
        out.extend(tokens)
        if on_tokens:
            on_tokens(tokens)
        return bool(stats.stop_reason)

    def verify(tokens, parents, logits):
        uniforms = None
        if temperature > 0:
            uniforms = torch.rand(1, tokens.numel() + 1, dtype=torch.float64, generator=generator).to(device)
        path, accepted, bonus = ops.verify_tree(parents.unsqueeze(0), tokens.unsqueeze(0), logits, uniforms,
                                                temperature, top_p, top_k)
        if int(accepted[0]) < 0:  # the op's mark of a logit row it cannot use (on a GPU; on the CPU it raises)
            raise RuntimeError("the target's logits are not finite (NaN or inf): verification cannot choose a "
                               "token (check the model's weights and dtype)")
        return path, accepted, bonus

    t0 = time.perf_counter()
    drafter = Drafter(draft, method, tree, start, bound) if method != "ar" else None  # checks the tree first
    cache = target.new_cache(1, start, bound)
    logits, hidden = target(ids.unsqueeze(0), cache, last_logits_only=True)
    cache.lengths += n
    stats.target_forwards += 1
    root_parent = torch.tensor([-1], device=device)
    _, _, bonus = verify(ids[-1:], root_parent, logits)
    root = int(bonus[0])
    if drafter is not None:
        drafter.catch_up(torch.cat([ids[1:], bonus]), hidden[0])
    stats.prefill_s = time.perf_counter() - t0
    done = emit([root])
    root_mask = ops.build_tree_mask(root_parent.unsqueeze(0))  # plain decoding's one-node tree, every round
    while not done:
        if int(cache.lengths[0]) + tree_nodes > bound:  # only a max_cache_len smaller than the need
            stats.stop_reason = "cache_full"
            break
        if drafter is not None:
            tokens, parents, depths = drafter.draft(root)
            mask = ops.build_tree_mask(parents.unsqueeze(0))
        else:
            tokens, parents, depths = torch.tensor([root], device=device), root_parent, torch.zeros(1, dtype=torch.int64, device=device)
            mask = root_mask
        logits, hidden = target(tokens.unsqueeze(0), cache, mask, depths.unsqueeze(0))
        stats.target_forwards += 1
        path, accepted, bonus = verify(tokens, parents, logits)
        a = int(accepted[0])
        ops.compact_kv(cache.kv, cache.lengths, path, accepted + 1)
        cache.lengths += a + 1
        stats.accept_lengths.append(a)
        kept = path[0, : a + 1]
        new_tokens = torch.cat([tokens[kept[1:]], bonus])
        if drafter is not None:
            drafter.catch_up(new_tokens, hidden[0, kept])
        root = int(bonus[0])
        done = emit(new_tokens.tolist())
    stats.wall_time_s = time.perf_counter() - t0
    stats.new_tokens = len(out)
    stats.draft_forwards = drafter.forwards if drafter is not None else 0
    return GenerationOutput(out, stats)
