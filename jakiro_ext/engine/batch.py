"""The sequences decoding together (``DecodeBatch``): admission and compaction (continuous
batching) and one draft-verify round, read top to bottom in :meth:`DecodeBatch.round`. What each
sequence holds on the device (its cache rows and root step) is the batch state's
(:mod:`jakiro_ext.engine.state`); what the host reads of a round is a :class:`RoundReadback`."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch

from jakiro_ext import ops
from jakiro_ext.config import INITIAL_ROOM, TreeConfig
from jakiro_ext.engine.adaptive import TreeChooser
from jakiro_ext.engine.drafter import DRAFT_ERRORS, Drafter
from jakiro_ext.engine.graphs import Replay
from jakiro_ext.engine.sequence import DecodeSequence, DecodeSettings, no_distribution_error
from jakiro_ext.engine.state import BatchState, Started
from jakiro_ext.methods import BASELINE, METHODS, Method
from jakiro_ext.models.heads.draft_head import DraftHead
from jakiro_ext.models.heads.step import DraftStep
from jakiro_ext.models.llama import LlamaModel

# Called with True when a round starts and False when it ends: a diagnostic's hook
# (jakiro_ext.engine.host_reads tells the reads of the rounds from the others).
ROUND_LISTENERS: List[Callable[[bool], None]] = []


@dataclass
class RoundReadback:
    """What the host reads of a round, in one read of the device: the kernels' error word, the
    drafter's error flags (``DRAFT_ERRORS``), and per row the accepted drafts' count (-1: a logit
    row no distribution can be made of) and its new tokens (the accepted drafts, then the bonus)."""
    device_errors: int
    draft_errors: List[bool]
    accepted: List[int]
    tokens: List[List[int]]

    @staticmethod
    def pack(logits: torch.Tensor, draft_errors: torch.Tensor, accepted: torch.Tensor,
             tokens: torch.Tensor) -> torch.Tensor:
        """The device side: one int64 vector to read (accepted [B], tokens [B, width])."""
        return torch.cat([ops.device_errors(logits).long(), draft_errors.long(),
                          torch.cat([accepted.unsqueeze(1), tokens], 1).flatten()])

    @classmethod
    def read(cls, packed: torch.Tensor, batch: int) -> "RoundReadback":
        """The host side: the one read, unpacked; raises the errors it carries."""
        values = packed.tolist()
        first = 1 + len(DRAFT_ERRORS)
        width = (len(values) - first) // batch
        rows = [values[first + b * width: first + (b + 1) * width] for b in range(batch)]
        back = cls(values[0], [bool(v) for v in values[1:first]], [r[0] for r in rows],
                   [r[1: r[0] + 2] for r in rows])
        ops.raise_device_errors(back.device_errors)
        for message, flagged in zip(DRAFT_ERRORS, back.draft_errors):
            if flagged:
                raise RuntimeError(message)
        if min(back.accepted) < 0:
            raise no_distribution_error()
        return back


class DecodeBatch:
    """The sequences decoding together, one per row of the batch state. A finished sequence
    frees its row and a waiting request takes it in place (continuous batching); free rows ride
    along in the forwards (lengths held at 0) until they are more than the busy ones, when the
    rows are compacted."""

    def __init__(self, target: LlamaModel, draft: Optional[DraftHead], method: Method, tree: TreeConfig,
                 s: DecodeSettings, max_rows: int, chooser: Optional[TreeChooser] = None):
        """``tree``: the round's tree; with a ``chooser``, the largest of its trees (what the caches
        are sized by), each round running the tree the chooser picks (:mod:`jakiro_ext.engine.adaptive`)."""
        self.target, self.draft, self.method, self.tree, self.settings = target, draft, method, tree, s
        self.max_rows = max_rows
        self.tree_nodes = tree.max_nodes_for(method)
        self.device = target.lm_head.weight.device
        self.drafter = Drafter(draft, method, tree)  # checks the method, head and tree; catches the draft up
        self.chooser = chooser
        self.drafters = {} if chooser is None else {  # each candidate's own (plain decoding: drafts nothing)
            id(c): Drafter(draft, method, c.tree) if c.tree is not None else Drafter(None, METHODS[BASELINE], tree)
            for c in chooser.candidates}
        self._drafting = self.drafter  # the drafter of the round under way
        self.draining = False  # no request waits for a row (set by the caller before each round)
        self.state: Optional[BatchState] = None
        self.root_parent = torch.tensor([[-1]], device=self.device)
        self.replay = None if s.graphs == "eager" else Replay(self._draft_and_verify, s.graphs)
        self._one_node_masks: dict = {}  # (_tree_mask)
        # The target's layers an EAGLE-3 head reads (None: its final hidden states, as the others)
        self.feature_layers = getattr(draft, "feature_layers", None) if method.drafts else None

    @property
    def seqs(self) -> List[DecodeSequence]:
        """The sequences in flight."""
        return [] if self.state is None else self.state.seqs

    # ------------------------------------------------------------------ a sequence starts
    def _prefill(self, seq: DecodeSequence, draft_later: bool = False) -> Started:
        """Run the prompt alone and choose the first token; the draft's prefill too, unless
        ``draft_later`` (its pairs are then the row's to catch up on when it drafts)."""
        seq.t0 = time.perf_counter()
        ids = seq.ids.to(self.device)
        n = ids.numel()
        one = self.target.new_cache(1, n)
        logits, hidden = self.target(ids.unsqueeze(0), one, last_logits_only=True, feature_layers=self.feature_layers)
        one.commit(n)
        seq.stats.target_forwards += 1
        s = self.settings
        uniforms = seq.draws(2).to(self.device) if s.temperature > 0 else None
        _, accepted, bonus = ops.verify_tree(self.root_parent, ids[-1:].unsqueeze(0), logits, uniforms,
                                             s.temperature, s.top_p, s.top_k)
        device_errors, accepted_0, seq.root = torch.cat([ops.device_errors(logits).long(), accepted, bonus]).tolist()
        ops.raise_device_errors(device_errors)
        if accepted_0 < 0:  # the op's mark of a logit row it cannot use (on a GPU; on the CPU it raises)
            raise no_distribution_error()
        if s.keep_features:
            seq.features.append(hidden[0])
        seq.stats.prefill_s = time.perf_counter() - seq.t0
        seq.emit([seq.root])
        if seq.done:
            return Started(one, None, None)
        if draft_later and self.drafter.drafts:
            return Started(one, None, None, (torch.cat([ids[1:], bonus]), hidden[0]))
        before = self.drafter.forwards
        draft_kv, root_step = self.drafter.prefill(torch.cat([ids[1:], bonus]), hidden[0])
        seq.stats.draft_forwards += self.drafter.forwards - before
        return Started(one, draft_kv, root_step)

    def admit(self, pending: List[DecodeSequence]) -> List[DecodeSequence]:
        """Start the sequences ``pending`` (at most the free rows); returns those already done
        (their first token ended them), the others take rows."""
        # While plain decoding runs at this many rows, the draft's prefill waits for a drafting round.
        draft_later = self.chooser is not None and not self.chooser.drafting(len(self.seqs) + len(pending))
        started = [(seq, self._prefill(seq, draft_later)) for seq in pending]
        done = [seq for seq, _ in started if seq.done]
        started = [(seq, state) for seq, state in started if not seq.done]
        if started:
            seqs = [seq for seq, _ in started]
            room = max(min(seq.bound, seq.ids.numel() + INITIAL_ROOM + self.tree_nodes) for seq in seqs)
            bound = max(seq.bound for seq in seqs)
            if self.state is None:
                self.state = BatchState(self.target, self.drafter, len(seqs), room, bound)
            free = self.state.make_room(len(seqs), bound)
            for b, (seq, state) in zip(free, started):
                self.state.load(b, seq, state)
        return done

    def drop_done(self) -> List[DecodeSequence]:
        """Free the rows of the finished sequences; returns them."""
        return [] if self.state is None else self.state.drop_done()

    def compact(self) -> None:
        """Drop the free rows when they outnumber the busy ones (the whole state when none is busy)."""
        if self.state is not None and not self.state.compact():
            self.state = None

    # ------------------------------------------------------------------ a round
    def round(self) -> None:
        """Draft, verify and commit once for every sequence of the batch (:meth:`_round`), its
        listeners told when it starts and ends."""
        for listen in ROUND_LISTENERS:
            listen(True)
        try:
            if self.chooser is None:
                self._round(self.drafter, self._catch_up(self.drafter))
            else:
                rows = len(self.state.rows)
                candidate = self.chooser.choose(rows)
                drafter = self.drafters[id(candidate)]
                # What the draft is behind (rounds of plain decoding) is not the round's: timed apart.
                t0 = time.perf_counter()
                caught_up = self._catch_up(drafter)
                t1 = time.perf_counter()
                lengths = [n for seq, n in zip(self.state.rows, self.state.host_lengths) if seq is not None]
                seqs = self.state.seqs
                left = self._budgets_left(seqs)
                accepted = self._round(drafter, caught_up)
                if accepted:
                    self.chooser.record(candidate, rows, time.perf_counter() - t1, self._progress(seqs, left, accepted),
                                        t1 - t0, statistics.fmean(lengths))
        finally:
            for listen in ROUND_LISTENERS:
                listen(False)

    def _budgets_left(self, seqs: List[DecodeSequence]) -> Optional[List[int]]:
        """What each of ``seqs`` has left of its budget before a round, where :meth:`_progress`
        reads it (a draining batch of several sequences); else None."""
        return [seq.budget - len(seq.out) for seq in seqs] if self.draining and len(seqs) > 1 else None

    def _progress(self, seqs: List[DecodeSequence], left: Optional[List[int]], accepted: List[int]) -> float:
        """What a round that accepted ``accepted`` drafts for ``seqs`` brought the call, in new
        tokens per sequence (what the chooser weighs against the round's seconds): their mean,
        unless the batch is draining (no request waits for a row: the call ends with its slowest
        sequence) and holds several (``left``: the new tokens of their budgets they had before the
        round; None otherwise), then how far it brought the end nearer: the drop of the most any
        sequence has left of its budget (at most the farthest any went). Rows a tree moves on
        unevenly finish apart, and the last rounds run for the few left: at 4 rows of 64-token
        samples the live choice ran 0.94-0.95x plain decoding while its tree rounds saved 1% of
        the rounds' time by the mean (docs/benchmarks.md, "never loses")."""
        if left is None:
            return 1 + statistics.fmean(accepted)
        now = [0 if seq.done else seq.budget - len(seq.out) for seq in seqs]
        return float(min(max(left) - max(now), 1 + max(accepted)))

    def _catch_up(self, drafter: Drafter) -> int:
        """Before a round that drafts with ``drafter``: the draft's catch-up on what it is behind
        (rounds of plain decoding, prompts admitted without its prefill); the forwards it ran."""
        return self.state.catch_up_pending() if drafter.drafts else 0

    def _round(self, drafter: Drafter, caught_up: int = 0) -> List[int]:
        """The round: draft (with ``drafter``), verify, commit. The host reads the device once (a
        RoundReadback). ``caught_up``: the draft forwards run before it for it (counted with its
        own). Returns the accepted drafts of each sequence in flight (none: no round ran)."""
        s, state = self.settings, self.state
        for seq, length in zip(state.rows, state.host_lengths):
            if seq is not None and length + self.tree_nodes > seq.bound:  # only a max_cache_len smaller than the need
                seq.stats.stop_reason = "cache_full"
        if any(seq.done for seq in state.seqs):
            return []
        seqs, B = state.rows, len(state.rows)
        nodes = drafter.tree.max_nodes_for(self.method) if drafter.drafts else 1
        state.prepare_round(nodes)
        self._drafting = drafter
        inputs = [ops.to_device(torch.tensor([seq.root if seq else 0 for seq in seqs]), self.device)]
        if s.temperature > 0:
            # Node i of a sequence's tree uses its i-th draw, the bonus token its last: a sequence
            # draws the same whatever the round's padded tree size (set by the other sequences).
            draws = torch.full((B, nodes + 1), 0.5, dtype=torch.float64)  # free rows: never read
            for b, seq in enumerate(seqs):
                if seq is not None:
                    draws[b] = seq.draws(nodes + 1)[0]
            inputs.append(ops.to_device(draws, self.device))
        root_step = [] if state.root_step is None else [t for t in state.root_step if t is not None]
        if self.replay is None:
            (path, tokens, hidden, packed), drafted = self._draft_and_verify(*inputs, *root_step)
        else:
            key = (B, s.temperature > 0, *(t.data_ptr() for t in state.buffers()))
            (path, tokens, hidden, packed), drafted = self.replay(key, inputs + root_step)
        back = RoundReadback.read(packed, B)
        counts = [a + 1 for a in back.accepted]
        # The target's hidden states at the root and the accepted nodes are the draft's catch-up.
        n = max(counts)
        index = path[:, :n].clamp(min=0).unsqueeze(-1).expand(-1, -1, hidden.shape[-1])
        features = hidden.gather(1, index)
        forwards = self.drafter.forwards
        deferred = self.drafter.drafts and not drafter.drafts  # plain decoding chosen: catch up later
        step = self.drafter.catch_up(state.draft_kv, tokens[:, :n], features) if self.drafter.drafts and not deferred \
            else None
        state.commit(path, counts, step)
        if deferred:
            state.defer_catch_up(tokens[:, :1], features)
        drafted += self.drafter.forwards - forwards + caught_up
        for b, (seq, a, new) in enumerate(zip(seqs, back.accepted, back.tokens)):
            if seq is None:
                continue
            seq.stats.target_forwards += 1
            seq.stats.draft_forwards += drafted
            seq.stats.accept_lengths.append(a)
            if s.keep_features:
                seq.features.append(features[b, : a + 1])
            seq.root = new[a]
            seq.emit(new)
        return [a for seq, a in zip(seqs, back.accepted) if seq is not None]

    def _tree_mask(self, parents: torch.Tensor) -> torch.Tensor:
        """The tree's mask; a round of plain decoding's (one node a row) made once per batch size
        and kept (making it took 0.09 ms of a 9 ms round, its code out of the caches)."""
        if parents.shape[1] > 1:
            return ops.build_tree_mask(parents, check=False)
        key = (parents.shape[0], parents.device)
        mask = self._one_node_masks.get(key)
        if mask is None:
            mask = self._one_node_masks[key] = ops.build_tree_mask(parents, check=False)
        return mask

    def _draft_and_verify(self, roots: torch.Tensor, *rest: torch.Tensor):
        """The round's device work, from the roots [B] (and with sampling the draws [B, nodes + 1])
        and the root step (its non-None tensors) to what the host reads: a function of these
        tensors and of the caches alone, with no read of the device, so a CUDA graph can replay it
        (:mod:`jakiro_ext.engine.graphs`). Returns ((path, tokens [B, width], hidden, packed
        readback), the draft forwards it ran)."""
        s, state = self.settings, self.state
        draws, root_tensors = (rest[0], rest[1:]) if s.temperature > 0 else (None, rest)
        root_step = None
        if root_tensors:
            fields = iter(root_tensors)
            root_step = DraftStep(*(None if t is None else next(fields) for t in state.root_step))
        drafter = self._drafting
        forwards = drafter.forwards
        tree = drafter.draft(roots, state.draft_kv, root_step)
        logits, hidden = self.target(tree.tokens, state.target_kv, self._tree_mask(tree.parents), tree.depths,
                                     feature_layers=self.feature_layers)
        T = tree.tokens.shape[1]
        uniforms = None if draws is None else torch.cat([draws[:, :T], draws[:, -1:]], 1)
        path, accepted, bonus = ops.verify_tree(tree.parents, tree.tokens, logits, uniforms, s.temperature,
                                                s.top_p, s.top_k)
        # Each sequence's new tokens: its accepted drafts, then the bonus (row b: accepted[b] + 1 of them).
        tokens = torch.cat([tree.tokens.gather(1, path[:, 1:].clamp(min=0)), torch.zeros_like(bonus).unsqueeze(1)], 1)
        tokens.scatter_(1, accepted.clamp(min=0).unsqueeze(1), bonus.unsqueeze(1))
        errors = tree.errors if tree.errors is not None else torch.zeros(len(DRAFT_ERRORS), dtype=torch.bool,
                                                                         device=roots.device)
        packed = RoundReadback.pack(logits, errors, accepted, tokens)
        return (path, tokens, hidden, packed), drafter.forwards - forwards
