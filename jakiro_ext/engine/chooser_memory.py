"""What a live tree chooser (:class:`jakiro_ext.engine.adaptive.TreeChooser`) keeps for the next
one of this machine and setting (a new head, the next process: the file beside the cost cache,
:func:`jakiro_ext.engine.policy.keep_live`) and starts from: each tree's live seconds over plain
decoding's, what switching to it cost, and the live acceptance of greedy and sampling calls."""
from __future__ import annotations

import time
from typing import Dict, Optional

from jakiro_ext.engine.candidate import CALL_KINDS, KEEP_LIVE, adds_to, tree_key


class ChooserMemory:
    """The kept measurements' side of a :class:`~jakiro_ext.engine.adaptive.TreeChooser` (whose
    attributes and :meth:`live_ratio` these methods read and set)."""

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
        """A call ended: what it measured is kept for the next chooser (``keep``), unless it
        changes nothing there (:func:`adds_to`: a write costs 2 ms, 1% of a 64-token call)."""
        kept = self.kept()
        if self.keep is not None and kept["ratios"] and adds_to(kept, self.last_kept):
            self.keep(kept)
            self.last_kept = kept

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
        plain = self.plain.median_seconds(rows)
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
        self.last_kept = kept
