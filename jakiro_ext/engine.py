"""The draft-verify loop: ``speculative_generate``.

Each round the draft head proposes a tree rooted at the last emitted token (not yet in the
target's cache), the target runs the whole tree in one forward (``jakiro::tree_attention`` with
the tree's ancestor mask), ``jakiro::verify_tree`` accepts the longest valid path plus a bonus
token (greedy, or lossless recursive rejection sampling), ``jakiro::compact_kv`` moves the
accepted path's keys/values into place, and the draft catches up on the accepted tokens with the
target's fresh hidden states. Plain autoregressive decoding is the same loop with a one-node tree.

Batch size 1 (the setting every published speedup is measured in).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence

import torch

from jakiro_ext import ops
from jakiro_ext.models.draft_head import DraftHead, DraftStep, TreeKV
from jakiro_ext.models.llama import LlamaModel, causal_tree_mask

METHODS = ("ar", "eagle2", "jakiro", "jakiro_star")


@dataclass
class TreeConfig:
    """Shape of the draft tree.

    Dynamic (EAGLE-2): every expansion keeps the ``top_k`` best nodes of a layer (by cumulative
    draft log-probability) as the next frontier and takes ``top_k`` children of each; after
    ``depth`` expansions (EAGLE-2's convention: a path holds up to depth + 1 drafted tokens)
    the ``total_tokens - 1`` best drafted nodes, with the root, are verified.
    Static (EAGLE-1 / Medusa): ``choices`` lists every node as its path of child ranks from the
    root, e.g. ``[[0], [1], [0, 0]]``: child rank r of a node is its draft's r-th best token.
    """
    total_tokens: int = 60
    depth: int = 5
    top_k: int = 10
    choices: Optional[Sequence[Sequence[int]]] = None

    def __post_init__(self):
        if self.choices is not None:
            try:
                paths = {tuple(int(r) for r in p) for p in self.choices}
            except (TypeError, ValueError):
                raise ValueError(f"static tree choices must be a list of lists of child ranks, got {self.choices!r}") from None
            if not paths or any(len(p) == 0 or min(p) < 0 for p in paths):
                raise ValueError(f"static tree choices must be non-empty paths of ranks >= 0, got {self.choices!r}")
            missing = [p for p in paths if len(p) > 1 and p[:-1] not in paths]
            if missing:
                raise ValueError(f"static tree choices must contain every node's parent; missing parents of {missing[:3]}")
        elif self.total_tokens < 2 or self.depth < 1 or self.top_k < 1:
            raise ValueError(f"dynamic tree needs total_tokens >= 2, depth >= 1, top_k >= 1, got "
                             f"{self.total_tokens}/{self.depth}/{self.top_k}")

    @property
    def max_nodes(self) -> int:
        return len({tuple(p) for p in self.choices}) + 1 if self.choices is not None else self.total_tokens


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
    stop_reason: str = ""  # "eos", "max_new_tokens" or "cache_full"

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
    repeated = (ids.unsqueeze(-1) == ids.unsqueeze(-2)).tril(-1).any(-1)
    # Sort again so the dropped repeats go last: a child's rank is its rank among distinct tokens.
    logprobs, order = logprobs.masked_fill(repeated, float("-inf")).sort(dim=-1, descending=True, stable=True)
    return logprobs, ids.gather(-1, order)


class Drafter:
    """The draft head's side of the loop for one sequence: its KV cache (committed up to the
    last emitted token), the latest catch-up output, and tree building."""

    def __init__(self, head: DraftHead, method: str, tree: TreeConfig, capacity: int):
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
        # Beyond the committed tokens, a tree layer's rows need scratch slots (at most the
        # frontier: top_k nodes, or a whole static layer).
        self.cache = head.new_cache(capacity + max(tree.top_k, tree.max_nodes))
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
        itself = ops.pack_bits(torch.eye(n, dtype=torch.bool, device=device)).unsqueeze(0)
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
        return max(p[-1] for p in self.tree.choices) + 1

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
    input_ids : [n] or [1, n] int64 prompt.
    method : ``ar`` (plain decoding), ``eagle2`` (dynamic tree, autoregressive drafting),
        ``jakiro`` (the last layer from the contrastive branch, one draft forward fewer) or
        ``jakiro_star`` (each activated expert proposes its own children). Default: ``jakiro``
        for a MoE head, ``eagle2`` for a dense one, ``ar`` without a head.
    tree : the draft tree; default :data:`CPU_TREE` on CPU, :data:`GPU_TREE` elsewhere.
    eos_token_id : int or list of ints that end the generation (included in the output).
    seed : seeds the draws of sampling (temperature > 0).
    max_cache_len : KV cache capacity; default prompt + max_new_tokens + tree size.
    on_tokens : called with each batch of newly emitted tokens (streaming).
    """
    ids = torch.as_tensor(input_ids)
    if ids.dim() == 2:
        if ids.shape[0] != 1:
            raise ValueError(f"speculative_generate decodes one sequence (batch size 1); got input_ids {tuple(ids.shape)}")
        ids = ids[0]
    if ids.dim() != 1 or ids.numel() == 0 or ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"input_ids must be a non-empty [n] or [1, n] integer tensor, got {tuple(ids.shape)} {ids.dtype}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
        raise ValueError(f"need temperature >= 0, 0 < top_p <= 1, top_k >= 0; got {temperature}, {top_p}, {top_k}")
    method = method or (("jakiro" if draft.config.num_experts else "eagle2") if draft is not None else "ar")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if method != "ar" and draft is None:
        raise ValueError(f"method {method!r} needs a draft head")
    device = target.lm_head.weight.device
    tree = tree or (CPU_TREE if device.type == "cpu" else GPU_TREE)
    tree_nodes = 1 if method == "ar" else tree.max_nodes
    n = ids.numel()
    capacity = max_cache_len or n + max_new_tokens + tree_nodes
    if n + tree_nodes > capacity:
        raise ValueError(f"the prompt has {n} tokens; with a {tree_nodes}-node tree it needs a KV cache of at least "
                         f"{n + tree_nodes} positions, but the cache holds {capacity} (max_cache_len)")
    vocab = target.config.vocab_size
    if int(ids.min()) < 0 or int(ids.max()) >= vocab:
        raise ValueError(f"input_ids must be token ids in [0, {vocab}) (the target's vocabulary), "
                         f"got values in [{int(ids.min())}, {int(ids.max())}]")
    eos = set() if eos_token_id is None else {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)
    ids = ids.to(device=device, dtype=torch.int64)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    stats = GenerationStats()
    out: List[int] = []

    def emit(tokens: List[int]) -> bool:
        """Append tokens up to EOS / max_new_tokens; True when the generation is over."""
        for i, t in enumerate(tokens):
            if t in eos or len(out) + i + 1 == max_new_tokens:
                tokens = tokens[: i + 1]
                stats.stop_reason = "eos" if t in eos else "max_new_tokens"
                break
        out.extend(tokens)
        if on_tokens:
            on_tokens(tokens)
        return bool(stats.stop_reason)

    def verify(tokens, parents, logits):
        uniforms = None
        if temperature > 0:
            uniforms = torch.rand(1, tokens.numel() + 1, dtype=torch.float64, generator=generator).to(device)
        return ops.verify_tree(parents.unsqueeze(0), tokens.unsqueeze(0), logits, uniforms, temperature, top_p, top_k)

    t0 = time.perf_counter()
    cache = target.new_cache(1, capacity)
    drafter = Drafter(draft, method, tree, capacity) if method != "ar" else None
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
    while not done:
        if int(cache.lengths[0]) + tree_nodes > capacity:
            stats.stop_reason = "cache_full"
            break
        if drafter is not None:
            tokens, parents, depths = drafter.draft(root)
        else:
            tokens, parents, depths = torch.tensor([root], device=device), root_parent, torch.zeros(1, dtype=torch.int64, device=device)
        mask = ops.build_tree_mask(parents.unsqueeze(0))
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
