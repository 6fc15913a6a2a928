"""Speculation that never loses: the draft tree chosen round by round from live timing.

The cost model (:mod:`jakiro_ext.engine.tree_cost`) predicts each tree's tokens per second from
costs measured once and cached and from the head's acceptance on held-out text; both can be wrong
for the call at hand (a loaded machine, another batch size, a harder prompt). A
:class:`TreeChooser` (the live tree policy's, :class:`jakiro_ext.engine.policy.LiveTree`) holds a
few candidates, the cost model's best trees and plain decoding (a one-node tree), times every round
as it runs (seconds per round per number of batch rows; new tokens per sequence,
:func:`jakiro_ext.engine.policy.progress`) and runs the candidate whose live rate is best: a tree
not yet run estimated by the cost model corrected by its live error, close candidates probed now
and then (less often while they stay behind, and only as far as a share of the time pays for
switching), what has not run for a while forgotten, a tree displacing plain decoding only by a
margin. Costs that disagree with live seconds are deleted (measured again by the next chooser);
what a chooser measured is kept for the next (:meth:`TreeChooser.kept`, :meth:`TreeChooser.start_from`).
How and why, with the measurements behind each constant: docs/methods.md ("The tree chosen live").

The tokens are those of any tree: exactly the target's at temperature 0, distributed as the
target's above it (with sampling, which tree a round uses changes which draws it consumes: a seed
then fixes the distribution, not the tokens; pass ``tree=`` for reproducible seeded sampling).
"""
from __future__ import annotations

import math
import statistics
import time
from collections import deque
from typing import Callable, Dict, List, Optional

from jakiro_ext.config import TreeConfig
from jakiro_ext.engine.candidate import (ACCEPTANCE_WINDOW, CARRIED_ROUNDS, COMPETITIVE, COSTS_DISAGREE,
                                         EXPLORE_MARGIN, FORGET_AFTER, MARGIN, MAX_FORGET_AFTER, MAX_PROBE_EVERY,
                                         MIN_SAMPLES, PRIOR_ROUNDS, PROBE_BUDGET, PROBE_EVERY, QUIET_ROUNDS,
                                         SETTLE_ROUNDS, WINDOW, Candidate, tree_key)
from jakiro_ext.engine.chooser_memory import ChooserMemory


class TreeChooser(ChooserMemory):
    """The candidate to run each round (:meth:`choose`) and what the round measured
    (:meth:`record`); what it keeps for the next chooser: :class:`ChooserMemory`."""

    def __init__(self, candidates: List[Candidate], batch: int, forget_costs: Optional[Callable[[str], None]] = None,
                 keep: Optional[Callable[[dict], None]] = None, context: float = 0.0, context_slope: float = 0.0,
                 absolute: bool = True):
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
        # Whether live rounds compare with the cost model's seconds (not when replayed as graphs:
        # the model measured eager launches), else only its ratios between trees are used.
        self.absolute = absolute
        self.keep = keep  # called with :meth:`kept` at the end of each call (for the next chooser: :meth:`start_from`)
        self.kept_plain: Optional[tuple] = None  # (rows, plain decoding's seconds) the kept ratios were measured with
        self.last_kept: Optional[dict] = None  # what was last kept (or started from)
        self.costs_disagree = False  # live seconds found far from the cached costs (the model suspect)
        self.round = 0
        self.left: Optional[float] = None  # new tokens the call's sequences have left (:meth:`record`)
        self.quiet_until, self.quiet_rows = -1, 0  # plain decoding chosen without a look until then (:meth:`quiet`)
        self.settle_until = -1  # the call's rounds before it are not timed (SETTLE_ROUNDS)
        self.accepted: deque = deque(maxlen=ACCEPTANCE_WINDOW)  # (live, expected) accepted drafts of tree rounds
        # The model's expected accepted drafts, the mean over the trees: its prior in the pooled acceptance.
        self.prior_accepted = statistics.fmean([c.expected_tokens - 1 for c in candidates if c.tree is not None] or [0.0])
        self.scale = 1.0  # :meth:`acceptance_scale`, kept as the pool changes (read many times a round)
        self.sampling = False  # the kind of the call under way (:meth:`new_call`): sampling, or greedy
        # Per kind of call (sampling or not): the last pool's mean (live, expected) and when it was measured.
        self.carried: Dict[bool, tuple] = {}
        self.accepted_at = 0.0  # wall time of the pool's last round
        self._rates: Optional[dict] = None  # (id(candidate), rows) -> rate, while :meth:`choose` runs
        # A tree's switch round just ran (:meth:`record`): (the tree, its rows, whether it was a
        # probe, whether it had no live seconds), its next round due at those rows.
        self.confirm: Optional[tuple] = None

    def new_call(self, sampling: bool = False) -> None:
        """A new call, new texts (``sampling``: at a temperature above 0): the seconds measured stay
        (they are the machine's), each tree's own tokens go (they were the last text's), and the
        probes' back-off starts again. The pooled acceptance is kept per kind of call, greedy or
        sampling (sampling accepts about half of what greedy decoding does): the last call's pool
        as CARRIED_ROUNDS rounds of its mean is the prior of the next call of its kind."""
        for c in self.candidates:
            c.tokens.clear()
            c.probe_every = PROBE_EVERY
        self.left, self.quiet_until, self.settle_until = None, -1, self.round + SETTLE_ROUNDS
        self.confirm = None
        self.carried = self.acceptance_by_kind()
        self.sampling = sampling
        kept = self.carried.get(sampling)
        self.accepted = deque([] if kept is None else [kept[:2]] * CARRIED_ROUNDS, maxlen=ACCEPTANCE_WINDOW)
        self.accepted_at = 0.0 if kept is None else kept[2]
        self.scale = self.pooled_scale()

    def ratio(self, c: Candidate, rows: int) -> Optional[float]:
        """``c``'s live seconds over plain decoding's at the number of rows nearest ``rows`` where
        both ran (None: nowhere)."""
        both = [r for r in c.seconds if r in self.plain.seconds]
        if not both:
            return None
        r = min(both, key=lambda r: abs(r - rows))
        return c.median_seconds(r) / self.plain.median_seconds(r)

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
        plain = self.plain_seconds(rows)
        tokens = self.tokens(c)
        if plain is None:
            return c.rate(rows, c.expected_seconds, tokens)
        if c is self.plain:
            return c.rate(rows, plain, tokens)
        ratio = self.live_ratio(c, rows)
        if ratio is None:
            return c.rate(rows, plain * self.model_ratio(c), tokens) * self.model_error(c, rows)
        return c.rate(rows, plain * ratio, tokens)

    def plain_seconds(self, rows: int) -> Optional[float]:
        """Plain decoding's live seconds at ``rows`` rows, else (not yet measured) the ones kept
        there by an earlier chooser (:meth:`start_from`): a new head's first call then knows,
        before its first round, what the kept ratios make of its trees (whether it drafts: the
        draft's prefill of the prompt and its weights' copies, 15 ms of a 64-token call, wait for
        a tree round). None: neither."""
        live = self.plain.median_seconds(rows)
        if live is None and self.kept_plain is not None and self.kept_plain[0] == rows and self.kept_plain[1] > 0:
            return self.kept_plain[1]
        return live

    def best(self, rows: int) -> Candidate:
        """The candidate to run at ``rows`` rows: the highest live rate, a tree's counted
        :data:`MARGIN` times less than plain decoding's (:data:`EXPLORE_MARGIN` for one never run;
        never the best while the costs disagree with live seconds: then a tree is tried only at its
        probe, as the model's relative costs are as suspect as its absolute ones)."""
        def margin(c: Candidate) -> float:
            if c is self.plain:
                return 1.0
            return MARGIN if c.tried else math.inf if self.costs_disagree else EXPLORE_MARGIN
        return max(self.candidates, key=lambda c: self.switched_rate(c, rows) / margin(c))

    def switched_rate(self, c: Candidate, rows: int) -> float:
        """``c``'s rate, what switching to it cost the last time (the draft's catch-up: beside a
        quantized target, a prompt and 60 tokens took 14 ms, 4.5 plain steps) spread over the
        rounds the call has left (unless it ran last, is plain decoding, or ``left`` is unknown)."""
        rate = self.rate(c, rows)
        if c is self.plain or c.last_round == self.round - 1 or not c.switch_cost or self.left is None:
            return rate
        tokens = self.tokens(c)
        return tokens / (tokens / rate + c.switch_cost * tokens / max(self.left, tokens))

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
        if self.confirm is not None and self.confirm[1] == rows:  # (a switch round's tree: its first timed round)
            return self.confirm[0]
        if self.round < self.quiet_until and rows == self.quiet_rows:
            return self.plain
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
            # (Plain decoding is always probed: its seconds are every tree's reference, and a stretch
            # of slow ones, the machine busy for ten rounds, kept a tree 2x slower running for 60.)
            close = [c for c, r in zip(self.candidates, rates) if r >= COMPETITIVE * max(rates) or c is self.plain
                     or (self.costs_disagree and c is self.smallest_tree)]  # (its estimate is the model's: suspect)
            seconds = self.round_seconds(rows)
            due = [c for c in close if c is not best and self.round - c.last_round >= c.probe_every
                   and self.affordable(c, seconds) and self.probed_untried(c)]
            if best is self.plain and not due:
                self.quiet(rows, [c for c in close if c is not self.plain], seconds)
            return min(due, key=lambda c: c.last_round) if due else best
        finally:
            self._rates = None

    def quiet(self, rows: int, close: List[Candidate], seconds: float) -> None:
        """Plain decoding is the best and no probe is due: it stays the choice, without a look, for
        up to QUIET_ROUNDS rounds at ``rows`` rows, until the first round a ``close`` tree's probe
        comes due (and affordable, at rounds of ``seconds``) or a tree would be forgotten. A plain
        round moves no tree's estimate relative to plain decoding's seconds (its ratio, or the
        model's) nor its tokens; only plain decoding's drift against a tree's own live seconds can
        make that tree the best, a few rounds later than a look would."""
        events = [c.last_round + c.forget_after for c in self.candidates if c.seconds and c is not self.plain]
        for c in close:  # (seconds > 0: plain decoding is measured)
            events.append(c.last_round + max(c.probe_every, math.ceil(c.switch_cost / (PROBE_BUDGET * seconds))))
        self.quiet_until = min([self.round + QUIET_ROUNDS] + [r for r in events if r > self.round])
        self.quiet_rows = rows

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

    def record(self, candidate: Candidate, rows: int, seconds: Optional[float], tokens_per_sequence: float,
               catch_up_seconds: float = 0.0, context: Optional[float] = None, left: Optional[float] = None) -> None:
        """A round of ``candidate`` over ``rows`` batch rows took ``seconds`` (None: not timed, a
        round that captured its graph: a cost paid once, kept for later calls) and gave
        ``tokens_per_sequence`` new tokens (the mean over the batch's sequences); before it, the
        draft's catch-up on what it was behind took ``catch_up_seconds`` (not the round's).
        ``context``: the mean committed tokens of its sequences (None: the cost model's);
        ``left``: the new tokens its sequences have left after it, the most of them (None: not known)."""
        self.left = left
        if (candidate is self.plain and self.round < self.quiet_until and rows == self.quiet_rows
                and candidate.last_round == self.round - 1 and self.kept_plain is None):
            # Plain decoding again while it is chosen without a look (:meth:`quiet`): its seconds
            # are all that moves (and are judged against the cached costs at the next look).
            candidate.add(rows, None if self.round < self.settle_until else seconds, tokens_per_sequence)
            candidate.last_round = self.round
            self.round += 1
            return
        if candidate is not self.plain:
            self.quiet_until = -1
        confirmed, self.confirm = self.confirm, None
        switched = candidate.last_round != self.round - 1
        if confirmed is not None and confirmed[:2] == (candidate, rows):  # (the round after its switch round)
            probe, fresh = confirmed[2:]
        else:
            probe, fresh = self.round - candidate.last_round >= candidate.probe_every, not candidate.seconds
        # Switched to from plain decoding (from a tree nothing is caught up): what that cost, against the best.
        if switched and seconds is not None and (candidate is self.plain or self.plain.last_round == self.round - 1):
            best = self.best(rows)
            lost = 0.0 if best is candidate else seconds - tokens_per_sequence / self.rate(best, rows)
            candidate.switch_cost = catch_up_seconds + max(0.0, lost)
        settling = self.round < self.settle_until and candidate.measured(rows)  # (its seconds: see SETTLE_ROUNDS)
        if candidate is self.plain and switched and not settling:
            candidate.restart(rows)  # (back after trees: its older rounds are another stretch's)
        # A tree's first round after plain decoding is not its rate: the draft's weights and LM
        # head rows come cold from plain rounds (a 3-token tree's first round took 1.08-1.13x its
        # later ones beside the Q4_1 file: at one row as much as the tree gains, and probes timed
        # so kept it behind for good); its excess is in the switch cost above, and the next round
        # runs the tree again and times it.
        cold = candidate is not self.plain and self.plain.last_round == self.round - 1
        candidate.add(rows, None if settling or cold else seconds, tokens_per_sequence)
        if candidate is self.plain and self.kept_plain is not None and rows == self.kept_plain[0] \
                and candidate.samples(rows) >= WINDOW:  # the kept ratios' machine against this one
            # (on WINDOW rounds: a new chooser's first ones run slow, see SETTLE_ROUNDS, and dropped what was kept)
            if not 1 / COSTS_DISAGREE <= candidate.median_seconds(rows) / self.kept_plain[1] <= COSTS_DISAGREE:
                for c in self.candidates:
                    if not c.seconds:
                        c.remembered_ratio, c.switch_cost = None, 0.0
            self.kept_plain = None
        if candidate is not self.plain:  # (a tree's wall time: what a kept ratio's age is read from)
            candidate.measured_at = self.accepted_at = time.time()
            self.accepted.append((tokens_per_sequence - 1.0, candidate.expected_tokens - 1.0))
            self.scale = self.pooled_scale()
        candidate.last_round = self.round
        self.round += 1
        if cold:
            self.confirm = (candidate, rows, probe, fresh)
            return
        if fresh and candidate.tree is not None:  # (re)measured from scratch
            behind = self.rate(candidate, rows) < COMPETITIVE * self.rate(self.best(rows), rows)
            candidate.forget_after = min(2 * candidate.forget_after, MAX_FORGET_AFTER) if behind else FORGET_AFTER
        if probe:  # still behind: probed less often; ahead: as often as at first
            behind = self.best(rows) is not candidate
            candidate.probe_every = min(2 * candidate.probe_every, MAX_PROBE_EVERY) if behind else PROBE_EVERY
        # A greedy round far from its cached cost: the model's relative costs are suspect, and this
        # chooser tries the trees it has not run only at their probes (smallest first). Only a round
        # faster than the costs condemns the file (measured under load, they are too slow): a
        # slower one carries host work the cost model does not time (the tree's selection, the
        # caches' compaction, the chooser: beside a quantized target's 3 ms step plain rounds took
        # 1.6x their cost, a 3-token tree's 1.8x), or ran on a machine loaded now, which says
        # nothing of the idle one the costs were measured on. (The costs are greedy decoding's: a
        # sampling call's verification draws from the filtered distribution, 1.7-2.2x.)
        if self.absolute and rows == self.batch and not self.costs_disagree and not self.sampling \
                and candidate.samples(rows):
            ratio = candidate.median_seconds(rows) / self.expected_seconds_at(candidate, context)
            allowed = COSTS_DISAGREE if candidate.samples(rows) >= MIN_SAMPLES else COSTS_DISAGREE ** 2  # one round: wider
            if not 1 / allowed <= ratio <= allowed:
                self.costs_disagree = True
                if ratio < 1 / allowed and self.forget_costs is not None:
                    what = "plain decoding's" if candidate is self.plain else f"a {candidate.tree.total_tokens}-token tree's"
                    self.forget_costs(f"{what} rounds took {ratio:.2f}x the cached seconds")

    def expected_seconds_at(self, c: Candidate, context: Optional[float]) -> float:
        """The cost model's seconds of a round of ``c`` behind ``context`` committed tokens per
        sequence (None: the model's own context), never below a quarter of the model's."""
        shift = 0.0 if context is None else self.context_slope * (context - self.context)
        return max(c.expected_seconds + shift, c.expected_seconds / 4)
