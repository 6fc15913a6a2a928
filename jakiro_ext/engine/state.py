"""A decoding batch's per-sequence state (``BatchState``), and the only code that edits it: row b
of the target's KV cache, of the draft's KV cache and of the root step belongs to ``rows[b]``.
Every verb changes them together, so they never fall out of step."""
from __future__ import annotations

from typing import List, NamedTuple, Optional, Tuple

import torch

from jakiro_ext import ops
from jakiro_ext.engine.draft_lag import DraftLag
from jakiro_ext.engine.drafter import Drafter
from jakiro_ext.engine.sequence import DecodeSequence
from jakiro_ext.kv_cache import BufferPool, KVCache
from jakiro_ext.models.heads.step import DraftStep
from jakiro_ext.models.llama import LlamaModel


class Started(NamedTuple):
    """A sequence run alone over its prompt, to be placed in a row: its own target cache, its own
    draft cache and root step rows [1, 1, ...] (both None when nothing is drafted, or when the
    draft's prefill is left for later: then ``draft_pairs``, the prompt's (tokens [n], features
    [n, H]) the draft has not run)."""
    target_kv: KVCache
    draft_kv: Optional[KVCache]
    root_step: Optional[DraftStep]
    draft_pairs: Optional[Tuple[torch.Tensor, torch.Tensor]] = None


class BatchState:
    """The rows of a decoding batch (``rows[b]``: the sequence in row b, None: a free row) with
    their target cache rows, draft cache rows and root steps. Caches hold ``room`` positions per
    row to start with and grow on demand up to ``bound``; the draft cache also has the drafter's
    scratch beyond them."""

    def __init__(self, target: LlamaModel, drafter: Drafter, batch: int, room: int, bound: Optional[int] = None,
                 pool: Optional[BufferPool] = None):
        """``pool``: where the caches take their buffers and leave them (:meth:`release`)."""
        self.rows: List[Optional[DecodeSequence]] = [None] * batch
        self.target_kv = target.new_cache(batch, room, bound, pool)
        self.draft_kv = drafter.new_cache(batch, room, bound, pool)
        self.drafter, self.scratch = drafter, drafter.scratch
        self.root_step: Optional[DraftStep] = None  # [B, 1, ...], made by the first load
        self.lag = DraftLag(batch, drafter.window)  # what each row's draft has not run yet (rounds that drafted nothing)

    @property
    def seqs(self) -> List[DecodeSequence]:
        """The sequences in flight."""
        return [seq for seq in self.rows if seq is not None]

    @property
    def free(self) -> List[int]:
        return [b for b, seq in enumerate(self.rows) if seq is None]

    @property
    def host_lengths(self) -> List[int]:
        """Each row's committed positions (as the host keeps them: no device read)."""
        return self.target_kv.host_lengths

    def release(self) -> None:
        """The state is not used again: its caches' buffers go back to their pool."""
        for cache in (self.target_kv, self.draft_kv):
            if cache is not None:
                cache.release()

    # ------------------------------------------------------------------ rows come and go
    def make_room(self, count: int, bound: int) -> List[int]:
        """At least ``count`` free rows (new ones after the current rows) and room for ``bound``
        committed positions per row; returns the free rows."""
        extra = count - len(self.free)
        if extra > 0:
            self._select(list(range(len(self.rows))) + [-1] * extra, bound)  # -1: a new row
        else:
            self.target_kv.allow(bound)
            if self.draft_kv is not None:
                self.draft_kv.allow(bound + self.scratch)
        return self.free

    def load(self, b: int, seq: Optional[DecodeSequence], started: Started) -> None:
        """Row ``b`` (free) takes a started sequence: its caches' committed positions and root step
        (or, its draft prefill left for later, the prompt's pairs as what the draft is behind)."""
        self.target_kv.load(b, started.target_kv)
        self.lag.restart(b)
        if self.draft_kv is not None and started.draft_kv is None:
            self.draft_kv.clear([b])
            self.lag.remember(b, *started.draft_pairs)
        elif self.draft_kv is not None:
            self.draft_kv.load(b, started.draft_kv)
            if self.root_step is None:
                self.root_step = self._new_root_step(started.root_step)
            for mine, new in zip(self.root_step, started.root_step):
                if mine is not None:
                    mine[b] = new[0]
        self.rows[b] = seq

    def _new_root_step(self, like: DraftStep) -> DraftStep:
        """A root step of zeros for the batch's rows, shaped as ``like`` (rows [1 or B, 1, ...])."""
        return DraftStep(*(None if t is None else t.new_zeros((len(self.rows), *t.shape[1:])) for t in like))

    def drop_done(self) -> List[DecodeSequence]:
        """Free the rows of the finished sequences; returns them."""
        done = [seq for seq in self.rows if seq is not None and seq.done]
        self.rows = [None if seq is None or seq.done else seq for seq in self.rows]
        return done

    def compact(self) -> bool:
        """Drop the free rows when they outnumber the busy ones: one copy for every halving, not
        one per finish. Returns whether any row is left."""
        busy = [b for b, seq in enumerate(self.rows) if seq is not None]
        if busy and len(self.rows) - len(busy) > len(busy):
            self._select(busy)
        return bool(busy)

    def _select(self, rows: List[int], bound: Optional[int] = None) -> None:
        """The rows become ``rows`` (indices of the current ones, in their new order; -1: a new,
        free one); ``bound`` raises the bound on committed positions."""
        self.target_kv.select_rows(rows, bound)
        index = None
        if self.draft_kv is not None:
            self.draft_kv.select_rows(rows, None if bound is None else bound + self.scratch)
            index = ops.to_device(torch.tensor([max(r, 0) for r in rows]), self.draft_kv.kv.device)
            if self.root_step is not None:
                self.root_step = self.root_step.of_sequences(index)
        self.lag.select(rows, index)
        self.rows = [self.rows[r] if r >= 0 else None for r in rows]

    # ------------------------------------------------------------------ a round
    def prepare_round(self, tree_nodes: int) -> None:
        """Before a round's device work: free rows held at length 0 (they compute a throw-away
        tree that never grows), and room for what drafting and verification write beyond the
        committed tokens (a CUDA-graph replay cannot grow a cache)."""
        idle = self.free
        if idle:
            self.target_kv.clear(idle)
            if self.draft_kv is not None:
                self.draft_kv.clear(idle)
        self.target_kv.reserve(max(self.target_kv.host_lengths) + tree_nodes)
        if self.draft_kv is not None:
            self.draft_kv.reserve(max(self.draft_kv.host_lengths) + self.scratch)

    def commit(self, path: torch.Tensor, counts: List[int], draft_step: Optional[DraftStep]) -> None:
        """A round's end: row b keeps ``counts[b]`` new positions, in the target's cache the tree
        nodes ``path[b, :counts[b]]`` (the root, then the accepted drafts), in the draft's the first
        ``counts[b]`` rows of its catch-up (``draft_step`` [B, n, ...], None when nothing is drafted),
        whose last kept row becomes the root step."""
        if path.shape[1] == 1 and draft_step is None:  # (plain decoding: every row keeps its root)
            self.target_kv.commit(1)
            return
        on_device = ops.to_device(torch.tensor(counts), path.device)
        self.target_kv.commit_path(path, on_device, counts)
        if draft_step is not None:
            self._commit_draft(draft_step, on_device, counts)

    def committed(self, counts: List[int], root_step: Optional[DraftStep]) -> None:
        """A captured round's end, its device's half done in its capture (:class:`~jakiro_ext.engine.round.Round`):
        row b kept ``counts[b]`` new positions in both caches (in the draft's, with a draft step)
        and ``root_step`` [B, 1, ...] is the root step (a capture's output: rewritten by its next
        replay, when it is the next round's)."""
        self.target_kv.commit_on_host(counts)
        if root_step is not None:
            self.draft_kv.commit_on_host(counts)
            self.root_step = root_step

    def _commit_draft(self, step: DraftStep, on_device: torch.Tensor, counts: List[int]) -> None:
        """The draft's cache keeps the first ``counts[b]`` rows of a catch-up forward's ``step``
        (``on_device``: the counts on the device); the last kept row becomes the row's root step
        (a row keeping none keeps its root step)."""
        self.draft_kv.commit(on_device, counts)
        last = step.last_kept(on_device)
        if self.root_step is None or min(counts) > 0:
            self.root_step = last
        else:
            kept = on_device > 0
            self.root_step = DraftStep(*(None if t is None else torch.where(kept.view(-1, *([1] * (t.dim() - 1))), t, old)
                                         for t, old in zip(last, self.root_step)))

    def defer_catch_up(self, tokens: torch.Tensor, features: torch.Tensor) -> None:
        """After :meth:`commit` of a round that drafted nothing (one new token per row): the draft
        catches up on ``tokens`` [B, 1] with ``features`` [B, 1, H] later, with the next ones, in one
        forward (:meth:`catch_up_pending`; beyond a window of them, a rebuild from the last ones)."""
        if self.draft_kv is not None:
            self.lag.defer(tokens, features)

    def catch_up_pending(self) -> int:
        """Bring every row's draft up to date before it drafts, in one forward over each row's
        pairs it is behind (:class:`DraftLag`; the rows behind by more than its window emptied
        first; the drafting scratch holds the window). Each row keeps its own, its last becomes
        its root step. Returns the forwards run."""
        pending = None if self.draft_kv is None else self.lag.take([seq is not None for seq in self.rows])
        if pending is None:
            return 0
        self.draft_kv.clear(pending.rebuilt)
        self.draft_kv.reserve(max(self.draft_kv.host_lengths) + pending.tokens.shape[1])
        step = self.drafter.catch_up(self.draft_kv, pending.tokens, pending.features)
        self._commit_draft(step, ops.to_device(torch.tensor(pending.counts), pending.tokens.device), pending.counts)
        return 1
