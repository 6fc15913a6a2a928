"""Speculation that never loses: the draft tree chosen round by round from live timing.

The cost model (:mod:`jakiro_ext.engine.tree_cost`) predicts each tree's tokens per second from
costs measured once and cached, and from the head's acceptance on held-out text. Both can be wrong
for the call at hand: the machine is loaded (or was, when the costs were measured), the batch is
not the one measured, the prompt is harder than the held-out text. So when the tree is left to the
engine on a CPU, a :class:`TreeChooser` holds a few candidates, the cost model's best trees and
plain decoding (no drafting: a one-node tree), and times every round as it runs: wall seconds per
round (per number of batch rows) and new tokens per sequence (the mean over the batch; in a batch
that drains, no request waiting for a row, how much nearer the round brought the slowest sequence's
end: :meth:`DecodeBatch._progress`), per candidate, over a window of its last rounds, a tree's tokens weighed against what the cost model expects of it scaled by the
acceptance pooled over every tree's recent rounds (the text and the temperature move every tree's
acceptance alike; one tree's few rounds are noisy). It runs the candidate whose live rate
(tokens / seconds) is best. At the start it
measures plain decoding first; a tree not yet run is estimated by the cost model, scaled by plain
decoding's live seconds and corrected by the model's error on the trees already run that are no
bigger, and is run (explored) when that estimate is the best one by :data:`EXPLORE_MARGIN` (trying
a tree costs the draft's prefill and catch-up), unless the cached costs disagree with the live
seconds (measured under load): then only the smallest tree, at its probe (whatever the model says
of it). At a new number of batch rows, plain decoding and the best are measured again, the others
estimated from their ratio to plain decoding at other row counts. The candidates within
:data:`COMPETITIVE` of the best are re-measured now and then (a probe), less often each time a
probe finds one still behind, and never before :data:`PROBE_BUDGET` of the time since it last ran
pays for what switching to it cost then (after rounds of plain decoding, the draft's catch-up: at
16 rows a round or more). What a candidate has not run for a while is forgotten (its last live
ratio to plain decoding's seconds kept as the estimate until it is measured again), so that within
a few rounds of a change the choice follows the machine and the prompt, and a tree that keeps
losing costs a probe round in a hundred or more. A tree displaces plain decoding only when its live
rate beats plain's by :data:`MARGIN`. A chooser lives as long as its head, across calls (one per
method, batch-size bucket and machine setting), so a call starts from the seconds the last ones
measured (the machine's); their tokens (the texts') fade, the acceptance pooled apart for greedy
and sampling calls (:meth:`TreeChooser.new_call`). What a chooser measured (each tree's seconds
over plain decoding's and what switching to it cost: the machine's; the live acceptance of each
kind of call: the temperature's share) is kept beside the cost cache at the end of each call, and
a new chooser there (another head, the next process) starts from it, for :data:`KEEP_LIVE`
seconds and, for the machine's, while plain decoding's live seconds agree with the kept ones
(:meth:`TreeChooser.start_from`).

The tokens are those of any tree: exactly the target's at temperature 0, distributed as the
target's above it. (With sampling, which tree a round uses changes which draws it consumes: a
seed then fixes the distribution, not the tokens. Pass ``tree=`` for reproducible seeded
sampling.)

When a candidate's live seconds per round disagree with the cached costs by more than a factor
:data:`COSTS_DISAGREE` (at the batch size they were measured for, the costs moved to the live
context by their measured seconds per committed token: at 16 rows a 256-token context costs a
fifth more than 66 tokens), the cost cache is deleted: the next chooser (a new head, or a new
process) measures the costs again. Rounds of plain decoding leave the draft's catch-up for
later: it runs over all their tokens in one draft
forward before the next drafting round, timed apart from it (:meth:`BatchState.defer_catch_up`), and
a draft left behind by more than a window of tokens is rebuilt from the last ones; a prompt
admitted while plain decoding is the best choice leaves its draft prefill to that round too.
"""
from __future__ import annotations

import math
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

from jakiro_ext.config import TreeConfig

WINDOW = 8          # a candidate's live seconds: the median of its last WINDOW rounds (per row count) ...
TOKEN_WINDOW = 16   # ... its tokens per round, the mean of its last TOKEN_WINDOW (noisier: longer, and
TOKEN_PRIOR_ROUNDS = 4  # counting as this many rounds its expectation from the pooled acceptance:)
ACCEPTANCE_WINDOW = 128  # the live accepted drafts over the cost model's, pooled over the last tree rounds
PRIOR_ROUNDS = 2    # of every tree (with the model's own as this many rounds): one ratio for all trees, as
# the text and the temperature scale every tree's acceptance alike (sampling at temperature 1 accepted
# 0.5-0.7 drafts a round where the greedy profile expected 1.3): a tree's own 16 rounds vary by a tenth
# or more, and the best of a few nearly equal trees measured alone is the one whose noise flattered it
CALL_KINDS = ("greedy", "sampling")  # the kinds of call whose acceptance is pooled apart (index: sampling or not)
CARRIED_ROUNDS = 4  # a new call (new texts) keeps the pooled acceptance as this many rounds of its mean:
# the temperature's share carries over, the last text's fades (kept whole, a text the head accepted
# little of put every tree below a probe's reach for the next calls: plain decoding for good)
MIN_SAMPLES = 2     # rounds plain decoding is measured for before it competes (a tree: one)
PROBE_EVERY = 16    # a candidate within COMPETITIVE of the best rate is re-measured after this many
COMPETITIVE = 0.85  # rounds without a run, twice as late each time the probe finds it still behind
MAX_PROBE_EVERY = 256  # (up to this), and no sooner than PROBE_BUDGET of the time since its last run pays for
PROBE_BUDGET = 0.01    # what switching to it cost last time (the draft's catch-up, the round's loss)
FORGET_AFTER = 64   # a candidate not run for this many rounds is measured again from scratch,
MAX_FORGET_AFTER = 1024  # twice as late each time that shows it far behind (up to this)
COSTS_DISAGREE = 1.6  # live / cached seconds of a round beyond this (or below its inverse): costs measured
# beside two busy processes on two cores come out twice the idle ones or more; the 2-core Xeon drifts
# by a quarter within minutes (live plain rounds at 0.75-0.93x of costs cached minutes before), too near
# 1/1.4: a fast stretch crossed it and the chooser distrusted good costs
MARGIN = 1.10  # a tree runs instead of plain decoding when its live rate is at least this many times plain's:
# the rates are means of a few noisy rounds (the candidate that looks best is the one whose noise flattered
# it most), and a call pays for drafting what no round's rate shows: the draft's prefill, its catch-up
# after plain rounds, the probes, a static batch waiting for its slowest row (at 4 rows trees 5-10% ahead
# per round ran 0.94-0.95x plain decoding per call with 1.03; docs/benchmarks.md, "never loses")
KEEP_LIVE = 3600.0  # seconds a tree's live seconds over plain decoding's stay the next chooser's estimate (a new
# head, the next process on this machine and setting): at 4-16 rows the cost model overrated trees by a quarter
# or more, and each first call spent rounds finding that out again
EXPLORE_MARGIN = 1.15  # ... and a tree never run, estimated from the cost model alone, by this: the model's
# error on a tree's seconds over plain decoding's is about 10% at 16 rows, and trying a tree costs the
# draft's prefill and catch-up over every row (at 16 rows, a few percent of a 64-token call)


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
    probe_every: int = PROBE_EVERY  # rounds without a run after which a probe re-measures it
    forget_after: int = FORGET_AFTER  # rounds without a run after which its measurements are dropped
    switch_cost: float = 0.0  # seconds lost the last time it ran after another candidate
    # Its seconds over plain decoding's when its measurements were dropped: the estimate of its
    # seconds until it is measured again (its tokens: the cost model's scaled by the live acceptance).
    remembered_ratio: Optional[float] = None
    measured_at: float = 0.0  # wall time (time.time()) of its last live round, or of the kept ratio it starts from

    def samples(self, rows: int) -> int:
        return len(self.seconds.get(rows, ()))

    def measured(self, rows: int) -> bool:
        return self.samples(rows) >= (MIN_SAMPLES if self.tree is None else 1)

    def mean_tokens(self, prior: float) -> float:
        """New tokens per sequence and round: the live mean, with ``prior`` as TOKEN_PRIOR_ROUNDS rounds."""
        return (sum(self.tokens) + TOKEN_PRIOR_ROUNDS * prior) / (len(self.tokens) + TOKEN_PRIOR_ROUNDS)

    def rate(self, rows: int, seconds: float, tokens: float) -> float:
        """``tokens`` new tokens per sequence a round over its seconds at ``rows`` rows: live where
        measured, else ``seconds`` (an estimate)."""
        measured = self.seconds.get(rows)
        return tokens / (statistics.median(measured) if measured else seconds)

    @property
    def tried(self) -> bool:
        """Whether it has live seconds (now, or as a ratio kept when they were forgotten)."""
        return bool(self.seconds) or self.remembered_ratio is not None

    def add(self, rows: int, seconds: float, tokens: float) -> None:
        self.seconds.setdefault(rows, deque(maxlen=WINDOW)).append(seconds)
        self.tokens.append(tokens)

    def forget(self, ratio: Optional[float]) -> None:
        """Drop the measurements, keeping ``ratio`` (its seconds over plain decoding's, None: not
        known) as the estimate."""
        self.remembered_ratio = ratio if ratio is not None else self.remembered_ratio
        self.seconds.clear()
        self.tokens.clear()


class TreeChooser:
    """The candidate to run each round (:meth:`choose`) and what the round measured
    (:meth:`record`)."""

    def __init__(self, candidates: List[Candidate], batch: int, forget_costs: Optional[Callable[[], None]] = None,
                 keep: Optional[Callable[[dict], None]] = None, context: float = 0.0, context_slope: float = 0.0):
        if not any(c.tree is None for c in candidates):
            raise ValueError("the candidates must include plain decoding (tree None)")
        if not (0 <= context < math.inf and 0 <= context_slope < math.inf):
            raise ValueError(f"context and context_slope must be finite numbers >= 0, got {context} and {context_slope}")
        self.candidates = candidates
        self.plain = next(c for c in candidates if c.tree is None)
        self.batch = batch  # the rows the cost model's seconds are for
        # The committed tokens behind the cost model's seconds, and what each more costs a round.
        self.context, self.context_slope = context, context_slope
        self.forget_costs = forget_costs
        self.keep = keep  # called with :meth:`kept` at the end of each call (for the next chooser: :meth:`start_from`)
        self.kept_plain: Optional[tuple] = None  # (rows, plain decoding's seconds) the kept ratios were measured with
        self.costs_disagree = False  # live seconds found far from the cached costs (measured under load)
        self.round = 0
        self.accepted: deque = deque(maxlen=ACCEPTANCE_WINDOW)  # (live, expected) accepted drafts of tree rounds
        # The model's expected accepted drafts, the mean over the trees: its prior in the pooled acceptance.
        self.prior_accepted = statistics.fmean([c.expected_tokens - 1 for c in candidates if c.tree is not None] or [0.0])
        self.scale = 1.0  # :meth:`acceptance_scale`, kept as the pool changes (read many times a round)
        self.sampling = False  # the kind of the call under way (:meth:`new_call`): sampling, or greedy
        # Per kind of call (sampling or not): the last pool's mean (live, expected) and when it was measured.
        self.carried: Dict[bool, tuple] = {}
        self.accepted_at = 0.0  # wall time of the pool's last round
        self._rates: Optional[dict] = None  # (id(candidate), rows) -> rate, while :meth:`choose` runs

    def new_call(self, sampling: bool = False) -> None:
        """A new call, new texts (``sampling``: at a temperature above 0): the seconds measured stay
        (they are the machine's), each tree's own tokens go (they were the last text's), and the
        probes' back-off starts again. The pooled acceptance is kept per kind of call, greedy or
        sampling (sampling accepts about half of what greedy decoding does): the last call's pool
        as CARRIED_ROUNDS rounds of its mean is the prior of the next call of its kind."""
        for c in self.candidates:
            c.tokens.clear()
            c.probe_every = PROBE_EVERY
        self.carried = self.acceptance_by_kind()
        self.sampling = sampling
        kept = self.carried.get(sampling)
        self.accepted = deque([] if kept is None else [kept[:2]] * CARRIED_ROUNDS, maxlen=ACCEPTANCE_WINDOW)
        self.accepted_at = 0.0 if kept is None else kept[2]
        self.scale = self.pooled_scale()

    def acceptance_by_kind(self) -> Dict[bool, tuple]:
        """Per kind of call (sampling or not): the mean (live, expected) accepted drafts a round
        and when measured, the call under way's from its pool."""
        now = self.carried_acceptance()
        return self.carried if now is None else {**self.carried, self.sampling: now}

    def carried_acceptance(self) -> Optional[tuple]:
        """The pool's mean (live, expected) accepted drafts a round and the wall time of its last round, None when empty."""
        expected = sum(e for _, e in self.accepted)
        if expected <= 0:
            return None
        mean = expected / len(self.accepted)
        return sum(a for a, _ in self.accepted) / expected * mean, mean, self.accepted_at

    def end_call(self) -> None:
        """A call ended: what it measured is kept for the next chooser (``keep``)."""
        kept = self.kept()
        if self.keep is not None and kept["ratios"]:
            self.keep(kept)

    def kept(self) -> dict:
        """What the next chooser of this machine and setting starts from (:meth:`start_from`): each
        tree's live seconds over plain decoding's (at the rows nearest the batch size the costs are
        for; or as kept when forgotten) with the wall time it was measured, plain decoding's
        seconds at those rows, what switching to each tree cost the last time (over plain
        decoding's seconds: the draft's catch-up, a round or more at 16 rows), and the live
        acceptance over the cost model's for each kind of call (greedy, sampling) with the wall
        time it was measured."""
        rows = min(self.plain.seconds, key=lambda r: abs(r - self.batch), default=None)
        if rows is None or not self.plain.measured(rows):
            return dict(rows=0, plain_seconds=0.0, ratios={}, switch={}, acceptance={})
        plain = statistics.median(self.plain.seconds[rows])
        ratios = {tree_key(c.tree): [ratio, c.measured_at] for c in self.candidates
                  if c is not self.plain and (ratio := self.live_ratio(c, rows)) is not None}
        switch = {tree_key(c.tree): c.switch_cost / plain for c in self.candidates
                  if c is not self.plain and c.switch_cost > 0}
        acceptance = {CALL_KINDS[kind]: [live / expected, when]
                      for kind, (live, expected, when) in self.acceptance_by_kind().items()}
        return dict(rows=rows, plain_seconds=plain, ratios=ratios, switch=switch, acceptance=acceptance)

    def start_from(self, kept: dict, now: Optional[float] = None) -> None:
        """Start from what an earlier chooser of this machine and setting measured (:meth:`kept`):
        each tree's ratio to plain decoding's seconds, if measured within KEEP_LIVE seconds, is its
        estimate until it runs (as when forgotten), and what switching to it cost, its probes'
        budget, unless plain decoding's live seconds, once measured at those rows, disagree with
        the kept ones by COSTS_DISAGREE (the machine is not as it was: both are dropped); the live
        acceptance of each kind of call measured within KEEP_LIVE is the prior of the next call of
        its kind (scaled to this chooser's trees: another head keeps the temperature's share)."""
        now = time.time() if now is None else now
        for c in self.candidates:
            ratio, when = kept["ratios"].get(tree_key(c.tree), (None, 0.0)) if c is not self.plain else (None, 0.0)
            if ratio is not None and 0 <= now - when <= KEEP_LIVE:
                c.remembered_ratio, c.measured_at = ratio, when
                c.switch_cost = kept["switch"].get(tree_key(c.tree), 0.0) * kept["plain_seconds"]
        for kind, (scale, when) in kept["acceptance"].items():
            if 0 <= now - when <= KEEP_LIVE and self.prior_accepted > 0:
                self.carried[kind == "sampling"] = (scale * self.prior_accepted, self.prior_accepted, when)
        self.kept_plain = (kept["rows"], kept["plain_seconds"])

    @property
    def trees(self) -> List[TreeConfig]:
        return [c.tree for c in self.candidates if c.tree is not None]

    def ratio(self, c: Candidate, rows: int) -> Optional[float]:
        """``c``'s live seconds over plain decoding's at the number of rows nearest ``rows`` where
        both ran (None: nowhere)."""
        both = [r for r in c.seconds if r in self.plain.seconds]
        if not both:
            return None
        r = min(both, key=lambda r: abs(r - rows))
        return statistics.median(c.seconds[r]) / statistics.median(self.plain.seconds[r])

    def live_ratio(self, c: Candidate, rows: int) -> Optional[float]:
        """``c``'s live ratio at the nearest rows (:meth:`ratio`), else the one kept when forgotten."""
        ratio = self.ratio(c, rows)
        return ratio if ratio is not None else c.remembered_ratio

    def acceptance_scale(self) -> float:
        """Live accepted drafts over the cost model's expectation, pooled over the last tree rounds
        (the model's as PRIOR_ROUNDS rounds of the mean expectation)."""
        return self.scale

    def pooled_scale(self) -> float:
        """:meth:`acceptance_scale` computed from the pool."""
        prior = PRIOR_ROUNDS * self.prior_accepted
        live = sum(a for a, _ in self.accepted) + prior
        return live / (sum(e for _, e in self.accepted) + prior) if prior > 0 else 1.0

    def expected_tokens(self, c: Candidate) -> float:
        """``c``'s new tokens per round by the cost model, its accepted drafts scaled by the live
        acceptance (:meth:`acceptance_scale`)."""
        return 1.0 if c is self.plain else 1.0 + (c.expected_tokens - 1.0) * self.acceptance_scale()

    def tokens(self, c: Candidate) -> float:
        """``c``'s new tokens per round: its live mean with :meth:`expected_tokens` as a prior."""
        return 1.0 if c is self.plain else c.mean_tokens(self.expected_tokens(c))

    def model_ratio(self, c: Candidate) -> float:
        """The cost model's seconds of a round of ``c`` over plain decoding's."""
        return c.expected_seconds / self.plain.expected_seconds

    def model_error(self, c: Candidate, rows: int) -> float:
        """How far the cost model's rate for ``c`` is from the live one, as far as the trees that
        ran and are no bigger than ``c`` tell: the median over them of live rate / the model's
        (both with plain decoding's live seconds, at the nearest number of rows where the tree and
        plain decoding ran, or as it was when forgotten); 1 when none ran. A batch of many rows
        costs more beyond its parts than the model measured, and more so for a bigger tree: one
        small tree found slow spares running the bigger ones, but a big tree found slow says
        nothing of a small one (costs measured on a loaded machine overrate big trees)."""
        errors = []
        for d in self.candidates:
            ratio = None if d is self.plain or d.tree.total_tokens > c.tree.total_tokens else self.live_ratio(d, rows)
            if ratio is not None:
                errors.append(self.tokens(d) / self.expected_tokens(d) * self.model_ratio(d) / ratio)
        return statistics.median(errors) if errors else 1.0

    def rate(self, c: Candidate, rows: int) -> float:
        """``c``'s rate at ``rows`` rows. Where it has not run at that many, its seconds are
        estimated from plain decoding's live seconds there: times its own live ratio to them (at
        the nearest number of rows where both ran, else the one it had when forgotten), else
        times the cost model's ratio, the rate then corrected by the model's live error."""
        memo = self._rates
        if memo is None:
            return self._rate(c, rows)
        key = (id(c), rows)
        if key not in memo:
            memo[key] = self._rate(c, rows)
        return memo[key]

    def _rate(self, c: Candidate, rows: int) -> float:
        plain = self.plain.seconds.get(rows)
        tokens = self.tokens(c)
        if not plain:
            return c.rate(rows, c.expected_seconds, tokens)
        ratio = self.live_ratio(c, rows)
        if ratio is None:
            return c.rate(rows, statistics.median(plain) * self.model_ratio(c), tokens) * self.model_error(c, rows)
        return c.rate(rows, statistics.median(plain) * ratio, tokens)

    def best(self, rows: int) -> Candidate:
        """The candidate to run at ``rows`` rows: the highest live rate, a tree's counted
        :data:`MARGIN` times less than plain decoding's (:data:`EXPLORE_MARGIN` for one never run;
        never the best while the costs disagree with live seconds: then a tree is tried only at its
        probe, as the model's relative costs are as suspect as its absolute ones)."""
        def margin(c: Candidate) -> float:
            if c is self.plain:
                return 1.0
            return MARGIN if c.tried else math.inf if self.costs_disagree else EXPLORE_MARGIN
        return max(self.candidates, key=lambda c: self.rate(c, rows) / margin(c))

    def drafting(self, rows: int) -> bool:
        """Whether rounds of ``rows`` rows are expected to draft: a tree is the best candidate
        there (else the draft's work can wait for the next tree round)."""
        return self.best(rows) is not self.plain

    def round_seconds(self, rows: int) -> float:
        """Seconds of a round of the best candidate at ``rows`` rows (0 before plain decoding is
        measured there)."""
        if not self.plain.measured(rows):
            return 0.0
        best = self.best(rows)
        return self.tokens(best) / self.rate(best, rows)

    def affordable(self, c: Candidate, round_seconds: float) -> bool:
        """Whether PROBE_BUDGET of the time since ``c`` last ran (rounds of ``round_seconds``) pays
        for what switching to it cost last time (a catch-up over 16 rows' tokens: a round or more)."""
        return PROBE_BUDGET * (self.round - c.last_round) * round_seconds >= c.switch_cost

    def choose(self, rows: int) -> Candidate:
        """The candidate for a round of ``rows`` batch rows."""
        overdue = [c for c in self.candidates if c.seconds and self.round - c.last_round >= c.forget_after]
        if overdue:  # (measured again from scratch: not before a probe would be)
            seconds = self.round_seconds(rows)
            for c in overdue:
                if self.affordable(c, seconds):
                    c.forget(None if c is self.plain else self.ratio(c, rows))
        # First plain decoding is measured (the cost model may be wrong about it by any factor),
        # then the best if it is not (the others not measured wait for their probes).
        if not self.plain.measured(rows):
            return self.plain
        # Nothing changes until the round is recorded: each candidate's rate is computed once
        # (a round of plain decoding at 4 rows spent 1% of its time choosing, most of it here).
        self._rates = {}
        try:
            best = self.best(rows)
            if not best.measured(rows):
                return best
            rates = [self.rate(c, rows) for c in self.candidates]
            close = [c for c, r in zip(self.candidates, rates) if r >= COMPETITIVE * max(rates)
                     or (self.costs_disagree and c is self.smallest_tree)]  # (its estimate is the model's: suspect)
            seconds = self.round_seconds(rows)
            due = [c for c in close if c is not best and self.round - c.last_round >= c.probe_every
                   and self.affordable(c, seconds) and self.probed_untried(c)]
            return min(due, key=lambda c: c.last_round) if due else best
        finally:
            self._rates = None

    def probed_untried(self, c: Candidate) -> bool:
        """Whether ``c`` may be probed as far as trying an untried tree goes: always, but while the
        cached costs disagree with live seconds only if it is the smallest tree (the model's
        relative costs are then as wrong as its absolute ones: one of 16 rows measured under load
        put trees of 6 nodes at half of plain decoding's seconds, live they took 4x; a small
        tree's probe costs least). The bigger ones wait for costs measured again (the next chooser)."""
        return c is self.plain or c.tried or not self.costs_disagree or c is self.smallest_tree

    @property
    def smallest_tree(self) -> Candidate:
        return min((c for c in self.candidates if c is not self.plain), key=lambda c: c.tree.total_tokens)

    def record(self, candidate: Candidate, rows: int, seconds: float, tokens_per_sequence: float,
               catch_up_seconds: float = 0.0, context: Optional[float] = None) -> None:
        """A round of ``candidate`` over ``rows`` batch rows took ``seconds`` and gave
        ``tokens_per_sequence`` new tokens (the mean over the batch's sequences); before it, the
        draft's catch-up on what it was behind took ``catch_up_seconds`` (not the round's).
        ``context``: the mean committed tokens of its sequences (None: the cost model's)."""
        fresh = not candidate.seconds
        if candidate.last_round != self.round - 1:  # switched to: what that cost, against the best
            best = self.best(rows)
            lost = 0.0 if best is candidate else seconds - tokens_per_sequence / self.rate(best, rows)
            candidate.switch_cost = catch_up_seconds + max(0.0, lost)
        probe = self.round - candidate.last_round >= candidate.probe_every
        candidate.add(rows, seconds, tokens_per_sequence)
        candidate.measured_at = time.time()
        if candidate is self.plain and self.kept_plain is not None and rows == self.kept_plain[0] \
                and candidate.measured(rows):  # the kept ratios' machine against this one
            if not 1 / COSTS_DISAGREE <= statistics.median(candidate.seconds[rows]) / self.kept_plain[1] <= COSTS_DISAGREE:
                for c in self.candidates:
                    if not c.seconds:
                        c.remembered_ratio, c.switch_cost = None, 0.0
            self.kept_plain = None
        if candidate is not self.plain:
            self.accepted.append((tokens_per_sequence - 1.0, candidate.expected_tokens - 1.0))
            self.accepted_at = candidate.measured_at
            self.scale = self.pooled_scale()
        candidate.last_round = self.round
        self.round += 1
        if fresh and candidate.tree is not None:  # (re)measured from scratch
            behind = self.rate(candidate, rows) < COMPETITIVE * self.rate(self.best(rows), rows)
            candidate.forget_after = min(2 * candidate.forget_after, MAX_FORGET_AFTER) if behind else FORGET_AFTER
        if probe:  # still behind: probed less often; ahead: as often as at first
            behind = self.best(rows) is not candidate
            candidate.probe_every = min(2 * candidate.probe_every, MAX_PROBE_EVERY) if behind else PROBE_EVERY
        if rows == self.batch and not self.costs_disagree:
            ratio = statistics.median(candidate.seconds[rows]) / self.expected_seconds_at(candidate, context)
            allowed = COSTS_DISAGREE if candidate.samples(rows) >= MIN_SAMPLES else COSTS_DISAGREE ** 2  # one round: wider
            if not 1 / allowed <= ratio <= allowed:
                self.costs_disagree = True
                if self.forget_costs is not None:
                    self.forget_costs()

    def expected_seconds_at(self, c: Candidate, context: Optional[float]) -> float:
        """The cost model's seconds of a round of ``c`` behind ``context`` committed tokens per
        sequence (None: the model's own context), never below a quarter of the model's."""
        shift = 0.0 if context is None else self.context_slope * (context - self.context)
        return max(c.expected_seconds + shift, c.expected_seconds / 4)


def tree_key(tree: TreeConfig) -> str:
    """A tree as kept (:meth:`TreeChooser.kept`): "N,D,K"."""
    return f"{tree.total_tokens},{tree.depth},{tree.top_k}"
