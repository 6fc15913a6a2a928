"""Speculation that never loses: the draft tree chosen round by round from live timing.

The cost model (:mod:`jakiro_ext.engine.tree_cost`) predicts each tree's tokens per second from
costs measured once and cached, and from the head's acceptance on held-out text. Both can be
wrong for the call at hand: the machine is loaded (or was, when the costs were measured), the
batch is not the one measured, the prompt is harder than the held-out text. So when the tree is
left to the engine on a CPU, a :class:`TreeChooser` holds a few candidates, the cost model's best
trees and plain decoding (no drafting: a one-node tree), and times every round as it runs: wall
seconds per round (per number of batch rows) and new tokens per sequence, per candidate, over a
window of its last rounds. It runs the candidate whose live rate (tokens / seconds) is best. At
the start it measures plain decoding first, then every tree the cost model (scaled by plain
decoding's live time) puts within :data:`COMPETITIVE` of the best; at a new number of batch rows,
plain decoding and the best again, the others estimated from their ratio to plain decoding at
other row counts; it re-measures the close ones now and then, and forgets what it measured of a candidate it
has not run for a while, so that within a few rounds of a change it follows the machine and the
prompt. A chooser lives as long as its head, across calls (one per method, batch-size bucket and
machine setting), so a call starts from what the last ones measured.

The tokens are those of any tree: exactly the target's at temperature 0, distributed as the
target's above it. (With sampling, which tree a round uses changes which draws it consumes: a
seed then fixes the distribution, not the tokens. Pass ``tree=`` for reproducible seeded
sampling.)

When a candidate's live seconds per round disagree with the cached costs by more than a factor
:data:`COSTS_DISAGREE` (at the batch size they were measured for), the cost cache is deleted:
the next chooser (a new head, or a new process) measures the costs again. Rounds of plain
decoding leave the draft's catch-up for later: it runs over all their tokens in one draft
forward before the next drafting round (:meth:`BatchState.defer_catch_up`).
"""
from __future__ import annotations

import statistics
import sys
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

from jakiro_ext.config import TreeConfig

WINDOW = 8          # a candidate's live seconds: the median of its last WINDOW rounds (per row count) ...
TOKEN_WINDOW = 16   # ... its tokens per round, the mean of its last TOKEN_WINDOW (noisier: longer, and
PRIOR_ROUNDS = 2    # counting the cost model's expectation as this many rounds)
MIN_SAMPLES = 2     # rounds plain decoding is measured for before it competes (a tree: one)
PROBE_EVERY = 16    # every PROBE_EVERY rounds the stalest other candidate within COMPETITIVE of
COMPETITIVE = 0.85  # the best rate is re-measured
FORGET_AFTER = 64   # a candidate not run for this many rounds is measured again from scratch,
MAX_FORGET_AFTER = 1024  # twice as late each time that shows it far behind (up to this)
COSTS_DISAGREE = 1.4  # live / cached seconds of a round beyond this (or below its inverse)


@dataclass
class Candidate:
    """A tree to choose (None: plain decoding) with the cost model's expected new tokens per
    sequence and seconds per round, and its live measurements: seconds per round for each number
    of batch rows (a round's cost depends on it), new tokens per sequence whatever the rows (the
    head's acceptance on the text at hand)."""
    tree: Optional[TreeConfig]
    expected_tokens: float
    expected_seconds: float
    seconds: Dict[int, deque] = field(default_factory=dict)
    tokens: deque = field(default_factory=lambda: deque(maxlen=TOKEN_WINDOW))
    last_round: int = -1  # the round it last ran
    forget_after: int = FORGET_AFTER  # rounds without a run after which its measurements are dropped

    def samples(self, rows: int) -> int:
        return len(self.seconds.get(rows, ()))

    def measured(self, rows: int) -> bool:
        return self.samples(rows) >= (MIN_SAMPLES if self.tree is None else 1)

    def rate(self, rows: int, seconds: float) -> float:
        """New tokens per sequence per second at ``rows`` rows: live where measured, else with
        ``seconds`` a round (an estimate; and the cost model's tokens until measured)."""
        tokens = (sum(self.tokens) + PRIOR_ROUNDS * self.expected_tokens) / (len(self.tokens) + PRIOR_ROUNDS)
        measured = self.seconds.get(rows)
        return tokens / (statistics.median(measured) if measured else seconds)

    def add(self, rows: int, seconds: float, tokens: float) -> None:
        self.seconds.setdefault(rows, deque(maxlen=WINDOW)).append(seconds)
        self.tokens.append(tokens)

    def forget(self) -> None:
        self.seconds.clear()
        self.tokens.clear()


class TreeChooser:
    """The candidate to run each round (:meth:`choose`) and what the round measured
    (:meth:`record`)."""

    def __init__(self, candidates: List[Candidate], batch: int, forget_costs: Optional[Callable[[], None]] = None):
        if not any(c.tree is None for c in candidates):
            raise ValueError("the candidates must include plain decoding (tree None)")
        self.candidates = candidates
        self.plain = next(c for c in candidates if c.tree is None)
        self.batch = batch  # the rows the cost model's seconds are for
        self.forget_costs = forget_costs
        self.round = 0

    @property
    def trees(self) -> List[TreeConfig]:
        return [c.tree for c in self.candidates if c.tree is not None]

    def rate(self, c: Candidate, rows: int) -> float:
        """``c``'s rate at ``rows`` rows. Where it has not run at that many, its seconds are
        estimated from plain decoding's live seconds there: times its own ratio to them at the
        nearest number of rows where both ran, else times the cost model's ratio."""
        plain = self.plain.seconds.get(rows)
        if not plain:
            return c.rate(rows, c.expected_seconds)
        both = [r for r in c.seconds if r in self.plain.seconds]
        if both:
            r = min(both, key=lambda r: abs(r - rows))
            ratio = statistics.median(c.seconds[r]) / statistics.median(self.plain.seconds[r])
        else:
            ratio = c.expected_seconds / self.plain.expected_seconds
        return c.rate(rows, statistics.median(plain) * ratio)

    def best(self, rows: int) -> Candidate:
        return max(self.candidates, key=lambda c: self.rate(c, rows))

    def choose(self, rows: int) -> Candidate:
        """The candidate for a round of ``rows`` batch rows."""
        for c in self.candidates:
            if self.round - c.last_round >= c.forget_after:
                c.forget()
        # First plain decoding is measured (the cost model may be wrong about it by any factor),
        # then every competitive tree.
        if not self.plain.measured(rows):
            return self.plain
        rates = [self.rate(c, rows) for c in self.candidates]
        best = self.candidates[rates.index(max(rates))]
        close = [c for c, r in zip(self.candidates, rates) if r >= COMPETITIVE * max(rates)]
        for c in close:  # (a tree run at other row counts has its estimate from there: probed, not explored)
            if not c.measured(rows) and (c is best or not c.seconds):
                return c
        if self.round % PROBE_EVERY == PROBE_EVERY - 1 and len(close) > 1:
            return min((c for c in close if c is not best), key=lambda c: c.last_round)
        return best

    def record(self, candidate: Candidate, rows: int, seconds: float, tokens_per_sequence: float) -> None:
        """A round of ``candidate`` over ``rows`` batch rows took ``seconds`` and gave
        ``tokens_per_sequence`` new tokens (the mean over the batch's sequences)."""
        fresh = not candidate.seconds
        candidate.add(rows, seconds, tokens_per_sequence)
        candidate.last_round = self.round
        self.round += 1
        if fresh and candidate.tree is not None:  # (re)measured from scratch
            behind = self.rate(candidate, rows) < COMPETITIVE * self.rate(self.best(rows), rows)
            candidate.forget_after = min(2 * candidate.forget_after, MAX_FORGET_AFTER) if behind else FORGET_AFTER
        if self.forget_costs is not None and rows == self.batch:
            ratio = statistics.median(candidate.seconds[rows]) / candidate.expected_seconds
            allowed = COSTS_DISAGREE if candidate.samples(rows) >= MIN_SAMPLES else COSTS_DISAGREE ** 2  # one round: wider
            if not 1 / allowed <= ratio <= allowed:
                self.forget_costs()
                self.forget_costs = None  # once


def forget_cost_file(path: Path) -> Callable[[], None]:
    """A ``forget_costs`` that deletes the cached costs at ``path`` (the next call measures them)."""
    def forget() -> None:
        print(f"note: this machine's live round times disagree with the cached costs {path}; they are deleted "
              "and will be measured again by the next call", file=sys.stderr)
        path.unlink(missing_ok=True)
    return forget
