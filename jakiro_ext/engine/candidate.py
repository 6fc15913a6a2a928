"""The live tree choice's settings (what each is, and the measurements behind it), a
:class:`Candidate`: a tree the chooser may run (:mod:`jakiro_ext.engine.adaptive`) with its live
measurements, and how what a chooser keeps names and compares them (:func:`tree_key`, :func:`adds_to`)."""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Dict, Optional

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
QUIET_ROUNDS = 8  # plain decoding the best, no probe or forgetting due: chosen again without a look for up to
# this many rounds (a look cost 35-45 us a round beside a quantized target's 3 ms step: 1.3%, the most of what
# plain decoding chosen live cost over plain decoding alone)
SETTLE_ROUNDS = 8  # a call's first rounds are not timed (a candidate not yet measured excepted): its prefill's
# memory traffic slows them (beside the Q4_1 file, whose weights the Xeon's cache holds, plain steps took 1.7-2x
# their later ones for 8-10 rounds), and against trees' steady seconds they made a tree look best in most calls
KEPT_CHANGE = 0.05  # what a chooser keeps is written again only if a value moved by more than this (plain
# decoding's seconds drift by a few percent from call to call; the next chooser acts on 1.6x, COSTS_DISAGREE):
# a write (fsync) cost 2 ms, 1% of a 64-token call of the Q4_1 model, at the end of every call
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
    measured_at: float = 0.0  # a tree's: wall time (time.time()) of its last live round, or of the kept ratio it starts from
    # The median of seconds[rows], kept until they change (read a few dozen times a round).
    _medians: Dict[int, float] = field(default_factory=dict, repr=False)
    _restarted: set = field(default_factory=set, repr=False)  # rows where :meth:`restart` kept it measured

    def samples(self, rows: int) -> int:
        return len(self.seconds.get(rows, ()))

    def measured(self, rows: int) -> bool:
        return self.samples(rows) >= (MIN_SAMPLES if self.tree is None and rows not in self._restarted else 1)

    def mean_tokens(self, prior: float) -> float:
        """New tokens per sequence and round: the live mean, with ``prior`` as TOKEN_PRIOR_ROUNDS rounds."""
        return (sum(self.tokens) + TOKEN_PRIOR_ROUNDS * prior) / (len(self.tokens) + TOKEN_PRIOR_ROUNDS)

    def median_seconds(self, rows: int) -> Optional[float]:
        """The median of its live seconds at ``rows`` rows (None: none)."""
        median = self._medians.get(rows)
        if median is None and self.seconds.get(rows):
            median = self._medians[rows] = statistics.median(self.seconds[rows])
        return median

    def rate(self, rows: int, seconds: float, tokens: float) -> float:
        """``tokens`` new tokens per sequence a round over its seconds at ``rows`` rows: live where
        measured, else ``seconds`` (an estimate)."""
        measured = self.median_seconds(rows)
        return tokens / (measured if measured is not None else seconds)

    @property
    def tried(self) -> bool:
        """Whether it has live seconds (now, or as a ratio kept when they were forgotten)."""
        return bool(self.seconds) or self.remembered_ratio is not None

    def add(self, rows: int, seconds: Optional[float], tokens: float) -> None:
        """A round's seconds at ``rows`` rows (None: not timed) and new tokens per sequence."""
        if seconds is not None:
            self.seconds.setdefault(rows, deque(maxlen=WINDOW)).append(seconds)
            self._medians.pop(rows, None)
        self.tokens.append(tokens)

    def restart(self, rows: int) -> None:
        """Drop its live seconds at ``rows`` rows, staying measured there: its next round's are its seconds."""
        if self.measured(rows):
            self._restarted.add(rows)
        self.seconds.pop(rows, None)
        self._medians.pop(rows, None)

    def forget(self, ratio: Optional[float]) -> None:
        """Drop the measurements, keeping ``ratio`` (its seconds over plain decoding's, None: not
        known) as the estimate."""
        self.remembered_ratio = ratio if ratio is not None else self.remembered_ratio
        self.seconds.clear()
        self._medians.clear()
        self._restarted.clear()
        self.tokens.clear()


def adds_to(kept: dict, last: Optional[dict]) -> bool:
    """Whether ``kept`` (:meth:`TreeChooser.kept`) tells the next chooser more than ``last``: other
    rows or keys, a tree's ratio or a kind of call's acceptance measured anew (another wall
    time), or a value moved by more than KEPT_CHANGE."""
    if last is None or kept["rows"] != last["rows"]:
        return True
    values = [(kept["plain_seconds"], last["plain_seconds"])]
    for table in ("ratios", "acceptance", "switch"):
        new, old = kept[table], last[table]
        if new.keys() != old.keys():
            return True
        for key, value in new.items():
            if table == "switch":
                values.append((value, old[key]))
            elif value[1] != old[key][1]:
                return True
            else:
                values.append((value[0], old[key][0]))
    return any(abs(a - b) > KEPT_CHANGE * max(abs(a), abs(b)) for a, b in values)


def tree_key(tree: TreeConfig) -> str:
    """A tree as kept (:meth:`TreeChooser.kept`): "N,D,K"."""
    return f"{tree.total_tokens},{tree.depth},{tree.top_k}"
