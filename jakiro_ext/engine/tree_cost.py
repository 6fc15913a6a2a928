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
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch

import jakiro_ext
from jakiro_ext import atomic, ops
from jakiro_ext.config import MAX_TREE_DEPTH, MAX_TREE_NODES, MAX_TREE_TOP_K, TreeConfig, brief
from jakiro_ext.engine.drafter import Drafter
from jakiro_ext.engine.state import BatchState, Started
from jakiro_ext.machine import cpu_name
from jakiro_ext.methods import METHODS
from jakiro_ext.models.weights import cache_dtype, weight_format
from jakiro_ext.paths import cache_root, parsed_once

ACCEPTANCE_FILE = "acceptance.json"
SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64)  # target forwards measured at these N
DEPTHS = tuple(range(1, 7))  # per method: tree_depths
WIDTHS = tuple(range(1, 9))
CONTEXT = 256  # committed tokens behind the measured forwards (a typical chat position)
SHORT_CONTEXT = 32  # ... and behind a one-token forward measured beside it: the seconds each committed token adds
MAX_BATCH_MEASURED = 64  # batches beyond it use its costs
MAX_VERIFY_ROWS = 1024  # a batch's target forwards are measured up to this many rows (batch x N)


# ----------------------------------------------------------------------------- expected acceptance
def expected_accepted(profile: dict, total_tokens: int, depth: int, top_k: int, method: str) -> float:
    """Expected drafted tokens accepted per round by a dynamic tree of ``total_tokens`` tokens (the
    root's included): the sum of its N - 1 best nodes' probabilities (:func:`node_probabilities`)."""
    return float(sum(METHODS[method].node_probabilities(profile, depth, top_k)[: total_tokens - 1]))


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


def _no_sync() -> None:
    pass


def _seconds(fn, sync: Callable[[], None] = _no_sync) -> float:
    """Wall seconds of fn(), its device work included (``sync``: the device's synchronize on a GPU,
    whose launches return before their work is done)."""
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def _interleaved_medians(parts: Dict[str, Callable[[], object]], repeats: int, step: Callable[[], None],
                         sync: Callable[[], None] = _no_sync) -> Dict[str, float]:
    """Each part's median seconds over ``repeats`` passes, every pass timing each part once in
    turn (after a warm-up pass; ``step`` called after each part run): the machine drifts by a
    quarter within minutes, and parts timed one after the other took their drift into the costs'
    ratios (a 3-token forward measured at 1.57x a one-token one, 1.04-1.20x in other runs; the
    live choice then found a tree's rounds at 0.6x their cost and threw the costs away)."""
    for fn in parts.values():
        fn()
        step()
    seconds: Dict[str, List[float]] = {name: [] for name in parts}
    for _ in range(repeats):
        for name, fn in parts.items():
            seconds[name].append(_seconds(fn, sync))
            step()
    return {name: statistics.median(times) for name, times in seconds.items()}


def tree_depths(head, method: str) -> List[int]:
    """The tree depths a method's costs are known at: as many as DEPTHS, from the least its trees
    take (``gumiho``: one past its J MLP heads' layers)."""
    least = METHODS[method].min_depth(getattr(head.config, "num_mlp_heads", 0))
    return [d - DEPTHS[0] + least for d in DEPTHS]


def batch_bucket(batch: int) -> int:
    """The batch size whose costs stand for ``batch``: the power of two at or below it, at most
    MAX_BATCH_MEASURED (one cost file per bucket)."""
    return min(1 << (max(1, batch).bit_length() - 1), MAX_BATCH_MEASURED)


@torch.no_grad()
def measure_costs(target, head, method: str, repeats: int = 5, batch: int = 1, progress: bool = False) -> dict:
    """The seconds of each part of a round on this machine (see the module's docstring) for
    ``batch`` sequences decoding together, with the target and the head as given (their dtype
    and device, torch's thread count). A batch's target forward is measured up to
    MAX_VERIFY_ROWS rows (batch x N). ``progress``: a bar on stderr, a step per part measured."""
    from tqdm import tqdm

    device = target.lm_head.weight.device
    sync = torch.cuda.synchronize if device.type == "cuda" else _no_sync
    B = batch
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, target.config.vocab_size, (CONTEXT + 1,), generator=g).to(device)
    depths = tree_depths(head, method)
    weights = target.prepare()
    widest = Drafter(head, METHODS[method], TreeConfig(64, max(depths), max(WIDTHS)), B)  # (the window of B rows)

    def batch_state(context: int) -> Tuple[BatchState, torch.Tensor]:
        """B copies of the prompt's first ``context`` tokens, the draft side started as the engine
        starts it, in caches with the drafting scratch of the largest tree measured (every
        measured tree fits in it), and the target's hidden states of those tokens."""
        one = target.new_cache(1, context)
        _, hidden = target(prompt[:context].unsqueeze(0), one, last_logits_only=True,
                           feature_layers=getattr(head, "feature_layers", None))
        one.commit(context)
        state = BatchState(target, widest, B, context + max(SIZES))
        started = Started(one, *widest.prefill(prompt[1:context + 1], hidden[0]))
        for b in range(B):
            state.load(b, None, started)
        return state, hidden

    sizes = [n for n in SIZES if B * n <= MAX_VERIFY_ROWS]
    parts_measured = len(sizes) + len(WIDTHS) * len(depths) + 8
    bar = tqdm(total=2 + (repeats + 1) * parts_measured, desc="measuring round costs", unit="part",
               file=sys.stderr, disable=not progress, leave=False)

    state, hidden = batch_state(CONTEXT)
    short, _ = batch_state(SHORT_CONTEXT)
    bar.update(2)

    def verify_once(n: int, state: BatchState = state):
        tokens = prompt[:n].expand(B, n)
        parents = (torch.arange(n, device=device) - 1).expand(B, n)
        logits, _ = target(tokens, state.target_kv, ops.build_tree_mask(parents), weights=weights)
        ops.verify_tree(parents, tokens, logits, None, 0.0, 1.0, 0)

    # The one-token forward behind both contexts in turn (the machine drifts by a quarter within
    # minutes: the difference of neighbours is what the context adds).
    verify_once(1), verify_once(1, short)  # warm-up
    pairs = [(_seconds(lambda: verify_once(1), sync), _seconds(lambda: verify_once(1, short), sync))
             for _ in range(max(repeats, 5))]
    context_slope = max(0.0, statistics.median(a - b for a, b in pairs) / (CONTEXT - SHORT_CONTEXT))
    roots = prompt[:1].expand(B)
    parts = {f"verify {n}": functools.partial(verify_once, n) for n in sizes}
    for k in WIDTHS:
        for d in depths:
            drafter = Drafter(head, METHODS[method], TreeConfig(max(2, min(64, 1 + d * k)), d, k))
            parts[f"draft {d},{k}"] = functools.partial(drafter.draft, roots, state.draft_kv, state.root_step)
    for n in range(1, 9):  # (a catch-up writes after the committed prefix and commits nothing; so do the others)
        parts[f"catch_up {n}"] = functools.partial(widest.catch_up, state.draft_kv, prompt[:n].expand(B, n),
                                                   hidden[:, :n].expand(B, n, -1))
    seconds = _interleaved_medians(parts, repeats, bar.update, sync)
    bar.close()
    table = {kind: {name.split(" ", 1)[1]: s for name, s in seconds.items() if name.startswith(kind + " ")}
             for kind in ("verify", "draft", "catch_up")}
    verify, draft, catch_up = capped_by_larger(table["verify"]), table["draft"], capped_by_larger(table["catch_up"])
    return dict(verify=verify, draft=draft, catch_up=catch_up, context=CONTEXT, context_slope=context_slope, batch=B)


def costs_key(target, head, method: str, batch: int = 1) -> str:
    """What the costs depend on: the CPU (or GPU), the threads, the dtype (and whether the steps
    read bf16 copies of the weights: :meth:`LlamaModel.streamed_weights`, and a bf16 KV cache:
    :func:`~jakiro_ext.models.weights.cache_dtype`), the shapes, and whether
    the compiled kernels run (a run on the reference ops keeps its costs apart)."""
    device = target.lm_head.weight.device
    where = (torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()) + \
        f"-{torch.get_num_threads()}t"
    t, h = target.config, head.config
    shape = (f"h{t.hidden_size}-l{t.num_layers}-i{t.intermediate_size}-v{t.vocab_size}-"
             f"e{h.num_experts}x{h.intermediate_size}-dv{h.draft_vocab_size}")
    if getattr(h, "num_mlp_heads", 0):
        shape += f"-l{h.num_layers}-m{h.num_mlp_heads}x{h.mlp_blocks}"
    if getattr(head, "feature_layers", None):  # (a head on the target's layers: its input fused, wider)
        shape += "-f" + "_".join(str(i) for i in head.feature_layers)
    dtype = weight_format(target)
    if target.streamed_weights() is not None:  # a bf16 checkpoint in float32: its steps read half the bytes
        dtype += "-bf16_weights"
    if cache_dtype(target.activation_dtype, target.layers[0].projections()[0]) != target.activation_dtype:
        dtype += "-bf16_cache"  # (a quantized target's on the CPU: its rows' attention reads half the bytes)
    batched = f"-b{batch}" if batch > 1 else ""
    kernels = "" if ops.compiled_available() else "-reference"  # (never the compiled build's file)
    return re.sub(r"[^A-Za-z0-9.,_-]+", "_", f"{where}-{dtype}-{shape}-{method}{batched}{kernels}")


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


def finite_number(name: str, value, positive: bool = False) -> float:
    """``value`` of a cached file as a float: a finite real number >= 0 (> 0 with ``positive``),
    else a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf \
            or (positive and value == 0):
        raise ValueError(f"{name} must be a finite number {'> 0' if positive else '>= 0'}, got {brief(value)}")
    return float(value)


def _positive_seconds(name: str, table, key_ok, least: int) -> None:
    """``table``: a dict of at least ``least`` entries, keys that ``key_ok`` accepts, values
    finite seconds > 0 (a ValueError naming ``name`` otherwise)."""
    if not isinstance(table, dict) or len(table) < least:
        raise ValueError(f"{name} must be a table of at least {least} entries, got {brief(table)}")
    for key, value in table.items():
        if not key_ok(key):
            raise ValueError(f"{name} has the key {key!r}")
        finite_number(f"{name}[{key!r}]", value, positive=True)


def _size_key(key: str) -> bool:
    return key.isdigit() and 1 <= int(key) <= MAX_TREE_NODES


def _depth_width_key(key: str) -> bool:
    parts = key.split(",")
    return (len(parts) == 2 and all(p.isdigit() for p in parts) and 1 <= int(parts[0]) <= MAX_TREE_DEPTH
            and 1 <= int(parts[1]) <= MAX_TREE_TOP_K)


def check_costs(costs) -> dict:
    """``costs`` as read from a cost file, checked as user input is (a ValueError saying what is
    wrong): the tables :func:`measure_costs` writes, every value finite seconds > 0 (a target
    forward of 1 and 2 tokens among them, a draft entry at least), ``context`` and
    ``context_slope`` finite numbers >= 0, ``batch`` an int >= 1."""
    if not isinstance(costs, dict):
        raise ValueError(f"not a cost table: {brief(costs)}")
    missing = {"verify", "draft", "catch_up", "context", "context_slope"} - set(costs)
    if missing:
        raise ValueError(f"not a cost table: no {sorted(missing)}")
    _positive_seconds("verify", costs["verify"], _size_key, 2)
    if not {"1", "2"} <= set(costs["verify"]):
        raise ValueError(f"verify must hold the seconds of 1 and 2 tokens, got the sizes {sorted(costs['verify'])}")
    _positive_seconds("draft", costs["draft"], _depth_width_key, 1)
    _positive_seconds("catch_up", costs["catch_up"], _size_key, 2)
    for k in ("context", "context_slope"):
        finite_number(k, costs[k])
    batch = costs.get("batch", 1)
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be an int >= 1, got {brief(batch)}")
    return costs


def _costs_of(text: str) -> dict:
    """A cost file's text, parsed and checked (:func:`check_costs`)."""
    return check_costs(json.loads(text))


def _read_costs(path: Path) -> dict:
    """The checked costs at ``path``, parsed and checked again only when its text changed (a new
    head's first call reads them: 0.6 ms of every short call; the same object while the text
    stays, which what is made from them keeps by)."""
    return parsed_once(path, _costs_of)


def load_costs(target, head, method: str, cache_dir: Optional[Path] = None, progress: bool = True,
               batch: int = 1, path: Optional[Path] = None) -> dict:
    """The cached costs of this machine and setting for ``batch`` sequences (its
    :func:`batch_bucket`), measured (seconds to a minute) when missing, damaged in syntax or in
    value (:func:`check_costs`: a warning) or measured with another build (:func:`build_id`). A
    cache that cannot be read or written is a warning: the call goes on with the costs measured.
    ``path``: their :func:`costs_path`, where the caller has it (a new head's every call asks)."""
    path = path or costs_path(target, head, method, batch, cache_dir)
    batch = batch_bucket(batch)
    build = build_id()
    try:
        costs = _read_costs(path)
        if costs.get("build") == build:
            return costs
        print(f"note: the round costs cached for the tree choice ({path}) were measured by another build of "
              f"jakiro_ext: measuring them again", file=sys.stderr)
    except FileNotFoundError:
        pass
    except (ValueError, UnicodeDecodeError, OSError) as exc:  # a cache: measured again
        print(f"warning: the cached costs {path} are damaged or unreadable ({exc}); measuring them again",
              file=sys.stderr)
    if progress:
        print(f"measuring this machine's round costs once for the tree choice (about a minute; cached in {path})",
              file=sys.stderr)
    costs = dict(measure_costs(target, head, method, repeats=5 if batch == 1 else 3, batch=batch, progress=progress),
                 build=build)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic.write_text(path, json.dumps(costs, indent=1) + "\n")
    except OSError as exc:
        print(f"warning: could not keep the costs in {path} ({exc}); they will be measured again by the next call",
              file=sys.stderr)
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
        accepted = [0.0, *itertools.accumulate(METHODS[method].node_probabilities(profile, depth, top_k))]
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
