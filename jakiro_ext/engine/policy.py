"""Which tree a round runs: the tree policy, beside the round (:mod:`jakiro_ext.engine.round`).

A policy chooses the tree of each round for the batch's number of rows (None: plain decoding,
the one-node tree) and observes what each round did (a :class:`RoundResult`). Three of them:

- :class:`FixedTree`: the tree given (``tree=``), or, left to the engine, the cost model's best
  for the batch size on this device (:func:`jakiro_ext.engine.tree_cost.auto_tree`), else the
  presets;
- :class:`LiveTree`: chosen round by round from live timing among the cost model's best trees
  and plain decoding (:mod:`jakiro_ext.engine.adaptive`), the default for a head with an
  acceptance profile, on a CPU or a GPU, eager or replayed as graphs. Its choosers live as long
  as their heads and keep what they measured beside the cost cache (``*.live.json``; with graphs
  ``*.live-cuda.json``, ``*.live-recorded.json``) for the next process.
"""
from __future__ import annotations

import copy
import json
import sys
import weakref
from dataclasses import replace
from pathlib import Path
from typing import Callable, Dict, List, Optional, Protocol

from jakiro_ext import atomic
from jakiro_ext.config import CPU_TREE, GPU_TREE, TreeConfig, brief, tree_key
from jakiro_ext.engine.adaptive import TreeChooser
from jakiro_ext.engine.candidate import CALL_KINDS, Candidate
from jakiro_ext.engine.round import RoundResult
from jakiro_ext.engine.tree_cost import (auto_tree, build_id, choose_tree, costs_path, finite_number, load_costs,
                                         round_seconds)
from jakiro_ext.methods import METHODS, Method
from jakiro_ext.paths import parsed_once


class TreePolicy(Protocol):
    """Chooses each round's tree and observes what the round did."""

    trees: List[Optional[TreeConfig]]  # every tree it may choose (None: plain decoding)

    def choose(self, rows: int) -> Optional[TreeConfig]:
        """The tree of a round over ``rows`` batch rows (one of :attr:`trees`)."""

    def drafting(self, rows: int) -> bool:
        """Whether rounds of ``rows`` rows are expected to draft (else a new prompt's draft prefill
        waits for the next round that does)."""

    def observe(self, result: RoundResult) -> None:
        """What a round of the tree it chose did."""

    def end_call(self) -> None:
        """The call is over (its last round observed)."""


class FixedTree:
    """Every round runs ``tree``."""

    def __init__(self, tree: TreeConfig):
        self.tree, self.trees = tree, [tree]

    def choose(self, rows: int) -> Optional[TreeConfig]:
        return self.tree

    def drafting(self, rows: int) -> bool:
        return True

    def observe(self, result: RoundResult) -> None:
        pass

    def end_call(self) -> None:
        pass


class LiveTree:
    """Each round's tree chosen from live timing by a :class:`TreeChooser`."""

    def __init__(self, chooser: TreeChooser):
        self.chooser = chooser
        # By the trees' values: a graphed call's drafters draft from copies (graph_sessions).
        self._candidates = {tree_key(c.tree): c for c in chooser.candidates}
        self.trees = [c.tree for c in chooser.candidates]

    def choose(self, rows: int) -> Optional[TreeConfig]:
        return self.chooser.choose(rows).tree

    def drafting(self, rows: int) -> bool:
        return self.chooser.drafting(rows)

    def observe(self, result: RoundResult) -> None:
        seconds = None if result.captured else result.seconds  # (a capture is paid once, not by the tree)
        self.chooser.record(self._candidates[tree_key(result.tree)], result.rows, seconds, progress(result),
                            result.catch_up_seconds, result.context, max(result.left_after))

    def end_call(self) -> None:
        self.chooser.end_call()


def progress(result: RoundResult) -> float:
    """What a round brought the call, in new tokens per sequence (what the live choice weighs
    against the round's seconds): their mean, unless the batch is draining (no request waits for
    a row: the call ends with its slowest sequence) and holds several, then how far it brought
    the end nearer: the drop of the most any sequence has left of its budget (at most the
    farthest any went). Rows a tree moves on unevenly finish apart, and the last rounds run for
    the few left: at 4 rows of 64-token samples the live choice ran 0.94-0.95x plain decoding
    while its tree rounds saved 1% of the rounds' time by the mean (docs/benchmarks.md, "never
    loses")."""
    if not result.draining or len(result.accepted) <= 1:
        return 1 + sum(result.accepted) / len(result.accepted)
    return float(min(max(result.left_before) - max(result.left_after), 1 + max(result.accepted)))


def tree_policy(target, draft, method: Method, tree: Optional[TreeConfig], batch: int, sampling: bool,
                graphs: str = "eager") -> TreePolicy:
    """The policy of a call: the tree given; else, for a head with an acceptance profile (on a
    CPU or a GPU, eager or replayed as graphs: a round ends with its read of the device, so its
    wall time is its work), the live choice; else the cost model's tree or the presets
    (:func:`default_tree`)."""
    if tree is None and method.drafts:
        chooser = tree_chooser(target, draft, method.name, batch, sampling, graphs)
        if chooser is not None:
            return LiveTree(chooser)
    return FixedTree(default_tree(target, draft, method, tree, batch))


def largest_tree(policy: TreePolicy, method: Method) -> TreeConfig:
    """The policy's tree with the most nodes (what the caches are sized by)."""
    return max((t for t in policy.trees if t is not None), key=lambda t: t.max_nodes_for(method))


def default_tree(target, draft, method, tree: Optional[TreeConfig] = None, batch: int = 1) -> TreeConfig:
    """The tree given, else the one chosen by this device's measured costs for ``batch`` sequences
    (for a head with an acceptance profile), else CPU_TREE on a CPU, GPU_TREE elsewhere (deepened
    to a serial step and the head's MLP heads for ``gumiho``). ``method``: a name or a :class:`Method`."""
    method = METHODS[method] if isinstance(method, str) else method
    device = target.lm_head.weight.device
    if tree is None and method.drafts:
        tree = auto_tree(target, draft, method.name, batch)
    if tree is None:
        tree = CPU_TREE if device.type == "cpu" else GPU_TREE
        if draft is not None:  # deep enough for the layers the method drafts without a forward (Gumiho's MLP heads)
            tree = replace(tree, depth=max(tree.depth, method.min_depth(getattr(draft.config, "num_mlp_heads", 0))))
    return tree


# head -> {(cost file, id(target), graph mode): its TreeChooser}: a head's live measurements outlive a call.
_CHOOSERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
CANDIDATES = 3  # the cost model's best trees of distinct sizes a TreeChooser runs live, besides
SMALL_TREE = 4  # plain decoding, and its best tree of at most this many nodes


def tree_chooser(target, head, method: str, batch: int = 1, sampling: bool = False,
                 graphs: str = "eager") -> Optional[TreeChooser]:
    """The live choice among the cost model's best trees and plain decoding for ``head`` on this
    machine, ``batch`` sequences decoding together (:mod:`jakiro_ext.engine.adaptive`), for a call
    that samples (temperature > 0) or not, its rounds launched as ``graphs`` says (eager or
    replayed: each way its own chooser, as its rounds cost otherwise); None without the head's
    acceptance profile. The costs are measured eagerly: with graphs only their ratios between
    trees are used, and rounds faster than them do not condemn the file."""
    profile = getattr(head, "acceptance", None)
    if not profile:
        return None
    path = costs_path(target, head, method, batch)
    kept = _CHOOSERS.setdefault(head, {})
    key = (path, id(target), graphs)
    if key in kept:
        kept[key].new_call(sampling)
        return kept[key]
    costs = load_costs(target, head, method, batch=batch, path=path)
    candidates = [Candidate(*spec) for spec in candidate_specs(path, costs, profile, method)]
    live, eager = live_path(path, graphs), graphs == "eager"
    chooser = kept[key] = TreeChooser(candidates, costs.get("batch", 1), forget_cost_file(path) if eager else None,
                                      lambda measured: keep_live(live, measured), costs["context"],
                                      costs["context_slope"], absolute=eager)
    measured = load_live(live)
    if measured is not None:
        chooser.start_from(measured)
    chooser.new_call(sampling)
    return chooser


# cost file -> (its costs as read, the profile, the method, the candidates' specs): made again
# only when the costs are read anew or the profile or method differ (5 ms, paid by every new
# head's first call otherwise: a few percent of a short call).
_SPECS: Dict[Path, tuple] = {}


def candidate_specs(path: Path, costs: dict, profile: dict, method: str) -> List[tuple]:
    """The live choice's candidates as (tree, expected new tokens, expected seconds): the cost
    model's best trees of CANDIDATES distinct sizes and its best of at most SMALL_TREE nodes by
    ``costs`` (read from ``path``) and ``profile``, then plain decoding (tree None). One tree of
    each size: trees of one size and other depths or widths cost and accept about the same, and
    measuring several of them live buys nothing."""
    known = _SPECS.get(path)
    if known is not None and known[0] is costs and known[1] == profile and known[2] == method:
        return known[3]
    sizes = {}
    for row in choose_tree(costs, profile, method)[1]:
        sizes.setdefault(row[2], row)
    best = list(sizes.values())
    picked = best[:CANDIDATES] + [next((row for row in best if row[2] <= SMALL_TREE), best[0])]
    specs = [(TreeConfig(n, depth, top_k), 1 + accepted, round_seconds(costs, n, depth, top_k, accepted))
             for _, accepted, n, depth, top_k in dict.fromkeys(picked)]
    specs.append((None, 1.0, round_seconds(costs, 1, 0, 0, 0.0)))
    _SPECS[path] = (costs, copy.deepcopy(profile), method, specs)
    return specs


def forget_cost_file(path: Path) -> Callable[[str], None]:
    """A ``forget_costs`` that deletes the cached costs at ``path`` (the next call measures them;
    a file that cannot be deleted is a warning), saying why."""
    def forget(why: str) -> None:
        print(f"note: this machine's live round times disagree with the cached costs {path} ({why}); they are "
              "deleted and will be measured again by the next call", file=sys.stderr)
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            print(f"warning: could not delete {path} ({exc})", file=sys.stderr)
    return forget


def live_path(costs_file: Path, graphs: str = "eager") -> Path:
    """Where what the live choice measured for the costs at ``costs_file`` is kept
    (:meth:`TreeChooser.kept`), for rounds launched as ``graphs`` says."""
    return costs_file.with_name(costs_file.stem + (".live.json" if graphs == "eager" else f".live-{graphs}.json"))


def keep_live(path: Path, measured: dict) -> None:
    """Keep a chooser's live measurements (:meth:`TreeChooser.kept`) at ``path``, with this build,
    written behind the call (:func:`jakiro_ext.atomic.write_text_behind`: the next call does not
    wait for the disk; :func:`load_live` waits for it). A cache: a failed write is a warning,
    never the call's failure."""
    def failed(exc: OSError) -> None:
        print(f"warning: could not keep the live round times in {path} ({exc})", file=sys.stderr)
    atomic.write_text_behind(path, json.dumps(dict(measured, build=build_id())) + "\n", failed)


def _pairs(name: str, table, keys=None) -> dict:
    """A table of "key": [value >= 0, wall time] pairs (``keys``: the keys allowed)."""
    if not isinstance(table, dict):
        raise ValueError(f"{name} must be a table, got {brief(table)}")
    checked = {}
    for key, pair in table.items():
        if keys is not None and key not in keys:
            raise ValueError(f"{name} of {key!r}, expected some of {list(keys)}")
        if not isinstance(pair, list) or len(pair) != 2:
            raise ValueError(f"{name}[{key!r}] must be [value, wall time], got {brief(pair)}")
        checked[key] = [finite_number(f"{name}[{key!r}]", pair[0]), finite_number(f"{name}[{key!r}]'s time", pair[1])]
    return checked


def check_live(measured) -> dict:
    """A chooser's kept measurements as read from a file (:meth:`TreeChooser.kept`), checked as
    user input is (a ValueError saying what is wrong): ``rows`` an int >= 0, plain decoding's
    seconds finite > 0 (or 0 with nothing measured), each tree's ratio finite > 0, switch costs
    finite >= 0, the acceptance of each kind of call (greedy, sampling) finite >= 0 (0: no draft
    accepted), wall times finite."""
    if not isinstance(measured, dict):
        raise ValueError(f"not a table: {brief(measured)}")
    rows = measured.get("rows")
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 0:
        raise ValueError(f"rows must be an int >= 0, got {brief(rows)}")
    ratios = _pairs("ratios", measured.get("ratios"))
    if not all(r > 0 for r, _ in ratios.values()):
        raise ValueError("a tree's ratio to plain decoding's seconds must be > 0")
    switch = measured.get("switch", {})
    if not isinstance(switch, dict):
        raise ValueError(f"switch must be a table, got {brief(switch)}")
    switch = {k: finite_number(f"switch[{k!r}]", v) for k, v in switch.items()}
    plain = finite_number("plain_seconds", measured.get("plain_seconds"), positive=bool(ratios))
    return dict(rows=rows, plain_seconds=plain, ratios=ratios, switch=switch,
                acceptance=_pairs("acceptance", measured.get("acceptance", {}), CALL_KINDS))


def _live_of(text: str) -> tuple:
    """A kept file's text: its measurements, checked (:func:`check_live`), and their build."""
    measured = json.loads(text)
    return check_live(measured), measured.get("build")


def load_live(path: Path) -> Optional[dict]:
    """The live measurements kept at ``path`` (:func:`keep_live`); None when there are none, they
    were measured with another build, or the file is damaged in syntax or in value
    (:func:`check_live`; a cache: a warning, and written again). Parsed and checked again only
    when its text changed (a new head's first call reads it)."""
    atomic.wait_for_writes_behind()  # (what a chooser of this process kept last)
    try:
        checked, build = parsed_once(path, _live_of)
        return checked if build == build_id() else None
    except FileNotFoundError:
        return None
    except (ValueError, UnicodeDecodeError, OSError) as exc:
        print(f"warning: the kept live round times {path} are damaged or unreadable ({exc}); ignored", file=sys.stderr)
        return None
