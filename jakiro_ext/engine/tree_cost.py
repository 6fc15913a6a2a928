"""The draft tree chosen by measured cost.

A round of speculative decoding costs the drafting of a tree (the drafter's head forwards over
the frontier and its LM-head passes), one target forward over the tree's N tokens with its
verification, and the draft's catch-up over the accepted tokens; it yields 1 + (accepted drafted
tokens). The tree (N, depth D, width K) that maximises the expected tokens per second

    (1 + E(N, D, K)) / (c_verify(N) + c_draft(D, K) + c_catch_up(1 + E))

depends on the machine (the c_*) and on the head (E):

- the costs are measured once per machine, thread count, dtype, model shape, method and batch
  size (a power of two up to 64: B sequences verify B x N tokens in one forward, and a bigger
  batch leaves less idle compute to a tree), behind CONTEXT committed tokens, with what each
  committed token adds to a round (``context_slope``: a batch's attention reads every row's keys
  and values: at 16 rows about a fifth of the round behind 256 tokens), and cached in
  ``$JAKIRO_CACHE/costs`` (:func:`load_costs`);
- E comes from the head's acceptance profile, recorded with the head when it is trained
  (``acceptance.json``): p[d][r], the probability that the target's token at depth d is the draft's
  r-th candidate given the path before it was right, measured on held-out answers drafting from
  the head's own features. The dynamic tree is modelled by the drafter's own rule with these
  probabilities as scores: the K best nodes of a depth get K children each (for ``jakiro`` the last
  layer comes from the contrastive branch under each frontier node's best child; for ``gumiho``
  the last J layers from its J MLP heads, with their own table), and the N - 1 best nodes are kept;
  E is the sum of their probabilities (a node is accepted when its whole path is).
"""
from __future__ import annotations

import functools
import itertools
import json
import math
import os
import re
import statistics
import sys
import time
import weakref
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch

import jakiro_ext
from jakiro_ext import atomic, ops
from jakiro_ext.config import TreeConfig
from jakiro_ext.engine.adaptive import CALL_KINDS, Candidate, TreeChooser, forget_cost_file
from jakiro_ext.engine.drafter import Drafter
from jakiro_ext.engine.state import BatchState, Started
from jakiro_ext.machine import cpu_name
from jakiro_ext.methods import METHODS
from jakiro_ext.paths import cache_root

ACCEPTANCE_FILE = "acceptance.json"
SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64)  # target forwards measured at these N
DEPTHS = tuple(range(1, 7))  # per method: tree_depths
WIDTHS = tuple(range(1, 9))
CONTEXT = 256  # committed tokens behind the measured forwards (a typical chat position)
SHORT_CONTEXT = 32  # ... and behind a one-token forward measured beside it: the seconds each committed token adds
MAX_BATCH_MEASURED = 64  # batches beyond it use its costs
MAX_VERIFY_ROWS = 1024  # a batch's target forwards are measured up to this many rows (batch x N)


# ----------------------------------------------------------------------------- expected acceptance
def _prob(table: Sequence[Sequence[float]], depth: int, rank: int, first_depth: int) -> float:
    i = depth - first_depth
    return float(table[i][rank]) if 0 <= i < len(table) and rank < len(table[i]) else 0.0


def node_probabilities(profile: dict, depth: int, top_k: int, method: str) -> List[float]:
    """The probability that each node a dynamic tree of ``depth`` and ``top_k`` can draft is
    accepted, best first (see the module's docstring): a tree of N tokens keeps the first N - 1.
    ``profile``: {"depth_rank": [[p(d=1, r=0), p(1, 1), ...], [p(2, 0), ...], ...]}; for
    ``jakiro`` "contrastive_depth_rank" (the same from depth 2 on); for ``gumiho``
    "mlp_depth_rank" (one row per MLP head, head j drafting the layer j + 1 past the serial ones)."""
    p = profile["depth_rank"]
    m = METHODS[method]
    pc = profile.get("contrastive_depth_rank") if m.hybrid_last_layer else None
    pm = profile["mlp_depth_rank"] if m.parallel_heads else []
    nodes: List[float] = []
    layer = [_prob(p, 1, r, 1) for r in range(top_k)]
    nodes += layer
    expansions = depth - 1 if m.hybrid_last_layer else depth
    serial = depth - len(pm)
    for d in range(1, expansions + 1):
        frontier = sorted(layer, reverse=True)[:top_k]
        table, row = (p, d + 1) if d <= serial else (pm, d - serial)
        layer = [v * _prob(table, row, r, 1) for v in frontier for r in range(top_k)]
        nodes += layer
        if pc is not None and d == expansions:
            nodes += [v * _prob(p, d + 1, 0, 1) * _prob(pc, d + 2, r, 2) for v in frontier for r in range(top_k)]
    return sorted(nodes, reverse=True)


def expected_accepted(profile: dict, total_tokens: int, depth: int, top_k: int, method: str) -> float:
    """Expected drafted tokens accepted per round by a dynamic tree of ``total_tokens`` tokens (the
    root's included): the sum of its N - 1 best nodes' probabilities (:func:`node_probabilities`)."""
    return float(sum(node_probabilities(profile, depth, top_k, method)[: total_tokens - 1]))


# ----------------------------------------------------------------------------- measured costs
def _interpolate(curve: Dict[str, float], x: float) -> float:
    points = sorted((float(k), v) for k, v in curve.items())
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = points[-2], points[-1]
    return y1 + (y1 - y0) * (x - x1) / (x1 - x0)


def capped_by_larger(curve: Dict[str, float]) -> Dict[str, float]:
    """A curve of seconds by size (str keys) with each size's seconds at most those of every
    larger size: a forward over fewer tokens never costs more, so a size measured in a slow moment
    (the machine drifts by a quarter within minutes) is capped by the next one. Such an outlier
    (seen: 5 tokens at 0.051 s between 4 and 6 at 0.039 and 0.040) makes live rounds of that tree
    look up to 1.6x faster than the cached costs, which are then deleted as measured under load."""
    sizes = sorted(curve, key=float)
    capped = dict(curve)
    for smaller, larger in reversed(list(zip(sizes, sizes[1:]))):
        capped[smaller] = min(capped[smaller], capped[larger])
    return capped


def _seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    return statistics.median(_seconds(fn) for _ in range(repeats))


def tree_depths(head, method: str) -> List[int]:
    """The tree depths a method's costs are known at: DEPTHS, deeper by the layers it drafts past
    the serial expansions (``jakiro``: its contrastive step; ``gumiho``: its J MLP heads' layers)."""
    return [d + METHODS[method].extra_layers(head) for d in DEPTHS]


def batch_bucket(batch: int) -> int:
    """The batch size whose costs stand for ``batch``: the power of two at or below it, at most
    MAX_BATCH_MEASURED (one cost file per bucket)."""
    return min(1 << (max(1, batch).bit_length() - 1), MAX_BATCH_MEASURED)


@torch.no_grad()
def measure_costs(target, head, method: str, repeats: int = 5, batch: int = 1) -> dict:
    """The seconds of each part of a round on this machine (see the module's docstring) for
    ``batch`` sequences decoding together, with the target and the head as given (their dtype
    and device, torch's thread count). A batch's target forward is measured up to
    MAX_VERIFY_ROWS rows (batch x N)."""
    device = target.lm_head.weight.device
    B = batch
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, target.config.vocab_size, (CONTEXT + 1,), generator=g).to(device)
    depths = tree_depths(head, method)
    widest = Drafter(head, METHODS[method], TreeConfig(64, max(depths), max(WIDTHS)))

    def batch_state(context: int) -> Tuple[BatchState, torch.Tensor]:
        """B copies of the prompt's first ``context`` tokens, the draft side started as the engine
        starts it, in caches with the drafting scratch of the largest tree measured (every
        measured tree fits in it), and the target's hidden states of those tokens."""
        one = target.new_cache(1, context)
        _, hidden = target(prompt[:context].unsqueeze(0), one, last_logits_only=True)
        one.commit(context)
        state = BatchState(target, widest, B, context + max(SIZES))
        started = Started(one, *widest.prefill(prompt[1:context + 1], hidden[0]))
        for b in range(B):
            state.load(b, None, started)
        return state, hidden

    state, hidden = batch_state(CONTEXT)
    short, _ = batch_state(SHORT_CONTEXT)

    def verify_once(n: int, state: BatchState = state):
        tokens = prompt[:n].expand(B, n)
        parents = (torch.arange(n, device=device) - 1).expand(B, n)
        logits, _ = target(tokens, state.target_kv, ops.build_tree_mask(parents))
        ops.verify_tree(parents, tokens, logits, None, 0.0, 1.0, 0)

    # The one-token forward behind both contexts in turn (the machine drifts by a quarter within
    # minutes: the difference of neighbours is what the context adds).
    verify_once(1), verify_once(1, short)  # warm-up
    pairs = [(_seconds(lambda: verify_once(1)), _seconds(lambda: verify_once(1, short))) for _ in range(max(repeats, 5))]
    context_slope = max(0.0, statistics.median(a - b for a, b in pairs) / (CONTEXT - SHORT_CONTEXT))
    verify = capped_by_larger({str(n): _median_seconds(lambda: verify_once(n), repeats)
                               for n in SIZES if B * n <= MAX_VERIFY_ROWS})
    draft, catch_up = {}, {}
    roots = prompt[:1].expand(B)
    for k in WIDTHS:
        for d in depths:
            drafter = Drafter(head, METHODS[method], TreeConfig(max(2, min(64, 1 + d * k)), d, k))
            draft[f"{d},{k}"] = _median_seconds(lambda: drafter.draft(roots, state.draft_kv, state.root_step), repeats)
    for n in range(1, 9):  # (a catch-up writes after the committed prefix and commits nothing)
        catch_up[str(n)] = _median_seconds(
            lambda: widest.catch_up(state.draft_kv, prompt[:n].expand(B, n), hidden[:, :n].expand(B, n, -1)), repeats)
    catch_up = capped_by_larger(catch_up)
    return dict(verify=verify, draft=draft, catch_up=catch_up, context=CONTEXT, context_slope=context_slope, batch=B)


def costs_key(target, head, method: str, batch: int = 1) -> str:
    """What the costs depend on: the CPU (or GPU), the threads, the dtype (and whether the steps
    read bf16 copies of the weights: :meth:`LlamaModel.streamed_weights`) and the shapes."""
    device = target.lm_head.weight.device
    where = (torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()) + \
        f"-{torch.get_num_threads()}t"
    t, h = target.config, head.config
    shape = (f"h{t.hidden_size}-l{t.num_layers}-i{t.intermediate_size}-v{t.vocab_size}-"
             f"e{h.num_experts}x{h.intermediate_size}-dv{h.draft_vocab_size}")
    if getattr(h, "num_mlp_heads", 0):
        shape += f"-l{h.num_layers}-m{h.num_mlp_heads}x{h.mlp_blocks}"
    dtype = str(target.lm_head.weight.dtype).replace("torch.", "")
    if target.streamed_weights() is not None:  # a bf16 checkpoint in float32: its steps read half the bytes
        dtype += "-bf16_weights"
    batched = f"-b{batch}" if batch > 1 else ""
    return re.sub(r"[^A-Za-z0-9.,_-]+", "_", f"{where}-{dtype}-{shape}-{method}{batched}")


def costs_path(target, head, method: str, batch: int = 1, cache_dir: Optional[Path] = None) -> Path:
    """Where the costs of this machine and setting for ``batch`` sequences are cached."""
    return Path(cache_dir or cache_root() / "costs") / (costs_key(target, head, method, batch_bucket(batch)) + ".json")


def build_id() -> str:
    """What else the costs depend on: this package's version and its compiled kernels (the
    library file's size and modification time; "reference" without it). Costs measured with
    another build are measured again: a faster kernel changes which tree wins."""
    try:
        stat = os.stat(ops._C.__file__)
        return f"{jakiro_ext.__version__}-{stat.st_size}-{int(stat.st_mtime)}"
    except (AttributeError, TypeError, OSError):
        return f"{jakiro_ext.__version__}-reference"


def load_costs(target, head, method: str, cache_dir: Optional[Path] = None, progress: bool = True,
               batch: int = 1) -> dict:
    """The cached costs of this machine and setting for ``batch`` sequences (its
    :func:`batch_bucket`), measured (seconds to a minute) when missing or measured with another
    build (:func:`build_id`)."""
    path = costs_path(target, head, method, batch, cache_dir)
    batch = batch_bucket(batch)
    build = build_id()
    if path.exists():
        try:
            costs = json.loads(path.read_text())
            if not (isinstance(costs, dict) and {"verify", "draft", "catch_up", "context", "context_slope"} <= set(costs)):
                raise ValueError("not a cost table")
            if not all(isinstance(costs[k], (int, float)) and 0 <= costs[k] < math.inf for k in ("context", "context_slope")):
                raise ValueError(f"context {costs['context']!r} and context_slope {costs['context_slope']!r} must be "
                                 "finite numbers >= 0")
            if costs.get("build") == build:
                return costs
            print(f"the cached costs {path} were measured with another build ({costs.get('build')}, this one "
                  f"{build}); measuring them again", file=sys.stderr)
        except (ValueError, UnicodeDecodeError) as exc:  # a cache: measured again
            print(f"warning: the cached costs {path} are damaged ({exc}); measuring them again", file=sys.stderr)
    if progress:
        print(f"measuring this machine's round costs once for the tree choice (cached in {path})", file=sys.stderr)
    costs = dict(measure_costs(target, head, method, repeats=5 if batch == 1 else 3, batch=batch), build=build)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic.write_text(path, json.dumps(costs, indent=1) + "\n")
    return costs


# ----------------------------------------------------------------------------- the choice
def round_seconds(costs: dict, total_tokens: int, depth: int, top_k: int, accepted: float) -> float:
    """Expected seconds of a round of a tree (``depth`` 0: plain decoding, nothing drafted and
    nothing for the draft to catch up on: the engine defers that to the next drafting round, so a
    plain round costs its one-token verification alone)."""
    if not depth:
        return _interpolate(costs["verify"], total_tokens)
    draft = costs["draft"][f"{depth},{top_k}"]
    return _interpolate(costs["verify"], total_tokens) + draft + _interpolate(costs["catch_up"], 1 + accepted)


def rate(costs: dict, total_tokens: int, depth: int, top_k: int, accepted: float) -> float:
    """Expected tokens per second of the whole batch the costs were measured for, by a tree that
    accepts ``accepted`` drafted tokens per sequence and round."""
    return costs.get("batch", 1) * (1 + accepted) / round_seconds(costs, total_tokens, depth, top_k, accepted)


def choose_tree(costs: dict, profile: dict, method: str):
    """The dynamic tree with the highest expected tokens per second, and every candidate's
    (tokens/s, accepted, N, D, K), best first."""
    rows = []
    for key in costs["draft"]:
        depth, top_k = map(int, key.split(","))
        most = 1 + sum(top_k ** i for i in range(1, depth + 2))  # nodes the drafting can produce, root included
        # A tree of N tokens accepts the sum of the N - 1 best nodes: one ranking for every N.
        accepted = [0.0, *itertools.accumulate(node_probabilities(profile, depth, top_k, method))]
        for n in SIZES[1:]:
            if n <= most and str(n) in costs["verify"]:
                a = accepted[min(n - 1, len(accepted) - 1)]
                rows.append((rate(costs, n, depth, top_k, a), a, n, depth, top_k))
    rows.sort(key=lambda row: -row[0])
    _, _, n, depth, top_k = rows[0]
    return TreeConfig(n, depth, top_k), rows


def auto_tree(target, head, method: str, batch: int = 1):
    """The tree for ``head`` on this machine, ``batch`` sequences decoding together: chosen by
    measured cost when the head has an acceptance profile, else None (the caller's preset). A
    bigger batch leaves less idle compute to the extra tree tokens: the chosen tree shrinks."""
    profile = getattr(head, "acceptance", None)
    if not profile:
        return None
    return choose_tree(load_costs(target, head, method, batch=batch), profile, method)[0]




# head -> {(cost file, id(target)): its TreeChooser}: a head's live measurements outlive a call.
_CHOOSERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
CANDIDATES = 3  # the cost model's best trees of distinct sizes a TreeChooser runs live, besides
SMALL_TREE = 4  # plain decoding, and its best tree of at most this many nodes


def tree_chooser(target, head, method: str, batch: int = 1, sampling: bool = False) -> Optional[TreeChooser]:
    """The live choice among the cost model's best trees and plain decoding for ``head`` on this
    machine, ``batch`` sequences decoding together (:mod:`jakiro_ext.engine.adaptive`), for a call
    that samples (temperature > 0) or not; None without the head's acceptance profile."""
    profile = getattr(head, "acceptance", None)
    if not profile:
        return None
    path = costs_path(target, head, method, batch)
    kept = _CHOOSERS.setdefault(head, {})
    if (path, id(target)) in kept:
        kept[path, id(target)].new_call(sampling)
        return kept[path, id(target)]
    costs = load_costs(target, head, method, batch=batch)
    ranked = _ranked_trees(json.dumps(costs, sort_keys=True), json.dumps(profile, sort_keys=True), method)
    # One tree of each size (trees of one size and other depths or widths cost and accept about
    # the same: measuring several of them live buys nothing).
    sizes = {}
    for row in ranked:
        sizes.setdefault(row[2], row)
    best = list(sizes.values())
    picked = best[:CANDIDATES] + [next((row for row in best if row[2] <= SMALL_TREE), best[0])]
    candidates = []
    for _, accepted, n, depth, top_k in dict.fromkeys(picked):
        candidates.append(Candidate(TreeConfig(n, depth, top_k), 1 + accepted,
                                    round_seconds(costs, n, depth, top_k, accepted)))
    candidates.append(Candidate(None, 1.0, round_seconds(costs, 1, 0, 0, 0.0)))
    live = live_path(path)
    chooser = kept[path, id(target)] = TreeChooser(candidates, costs.get("batch", 1), forget_cost_file(path),
                                                    lambda measured: keep_live(live, measured), costs["context"],
                                                    costs["context_slope"])
    measured = load_live(live)
    if measured is not None:
        chooser.start_from(measured)
    chooser.new_call(sampling)
    return chooser


@functools.lru_cache(maxsize=16)
def _ranked_trees(costs: str, profile: str, method: str) -> list:
    """:func:`choose_tree`'s ranking for the costs and profile as JSON: computed once per process
    (5 ms, paid by every new head's first call otherwise: a few percent of a short call)."""
    return choose_tree(json.loads(costs), json.loads(profile), method)[1]


def live_path(costs_file: Path) -> Path:
    """Where what the live choice measured for the costs at ``costs_file`` is kept (:meth:`TreeChooser.kept`)."""
    return costs_file.with_name(costs_file.stem + ".live.json")


def keep_live(path: Path, measured: dict) -> None:
    """Keep a chooser's live measurements (:meth:`TreeChooser.kept`) at ``path``, with this build
    (a cache: a failed write is a warning, never the call's failure)."""
    try:
        atomic.write_text(path, json.dumps(dict(measured, build=build_id())) + "\n")
    except OSError as exc:
        print(f"warning: could not keep the live round times in {path} ({exc})", file=sys.stderr)


def load_live(path: Path) -> Optional[dict]:
    """The live measurements kept at ``path`` (:func:`keep_live`); None when there are none, they
    were measured with another build, or the file is damaged (a cache: written again)."""
    try:
        measured = json.loads(path.read_text())
        checked = {str(k): [float(r), float(t)] for k, (r, t) in measured["ratios"].items()}
        switch = {str(k): float(r) for k, r in measured.get("switch", {}).items()}
        acceptance = {str(k): [float(r), float(t)] for k, (r, t) in measured.get("acceptance", {}).items()}
        plain = float(measured["plain_seconds"])
        if not all(0 < r < math.inf for r, _ in checked.values()) or not 0 < plain < math.inf:
            raise ValueError("a ratio or plain decoding's seconds not a positive finite number")
        if not all(0 <= r < math.inf for r, _ in acceptance.values()):  # (0: no draft accepted, with sampling)
            raise ValueError("an acceptance not a finite number >= 0")
        if not all(0 <= r < math.inf for r in switch.values()):
            raise ValueError("a switch cost not a finite number >= 0")
        if not set(acceptance) <= set(CALL_KINDS):
            raise ValueError(f"acceptance of kinds of call {sorted(acceptance)}, expected some of {list(CALL_KINDS)}")
        if measured.get("build") != build_id():
            return None
        return dict(rows=int(measured["rows"]), plain_seconds=plain, ratios=checked, switch=switch,
                    acceptance=acceptance)
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as exc:
        print(f"warning: the kept live round times {path} are damaged ({exc}); ignored", file=sys.stderr)
        return None
