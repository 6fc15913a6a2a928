"""The sequences decoding together (``DecodeBatch``): admission and compaction (continuous
batching) and each round: the tree policy's choice (:mod:`jakiro_ext.engine.policy`), the draft's
catch-up on what it is behind, the round itself (:mod:`jakiro_ext.engine.round`) and what the
policy observes of it. What each sequence holds on the device (its cache rows and root step) is
the batch state's (:mod:`jakiro_ext.engine.state`).

Everything that touches the batch's tensors runs in ``torch.inference_mode`` (no autograd
bookkeeping: a round's hundreds of small ops cost less), never across a yield to the caller."""
from __future__ import annotations

import copy
import time
from typing import Callable, Dict, List, NamedTuple, Optional

import torch

from jakiro_ext import ops
from jakiro_ext.config import INITIAL_ROOM, tree_key
from jakiro_ext.engine.drafter import Drafter
from jakiro_ext.engine.graph_sessions import GraphSession
from jakiro_ext.engine.policy import TreePolicy, largest_tree
from jakiro_ext.engine.round import Round, RoundResult
from jakiro_ext.engine.sequence import DecodeSequence, DecodeSettings, no_distribution_error
from jakiro_ext.engine.state import BatchState, Started
from jakiro_ext.kv_cache import BufferPool
from jakiro_ext.methods import BASELINE, METHODS, Method
from jakiro_ext.models.heads.head import Head
from jakiro_ext.models.llama import LlamaModel
from jakiro_ext.models.weights import TargetWeights

# Called with True when a round starts and False when it ends: a diagnostic's hook
# (jakiro_ext.engine.host_reads tells the reads of the rounds from the others).
ROUND_LISTENERS: List[Callable[[bool], None]] = []


class RoundParts(NamedTuple):
    """What a batch makes for its rounds (a graphed call's are kept for the next: :mod:`.graph_sessions`):
    the drafter of its largest tree, which catches the draft up (``catch_up``), each tree's own
    drafter by :meth:`TreeConfig.key` (None: plain decoding's, which drafts nothing), the target's
    prepared weights and the round."""
    catch_up: Drafter
    drafters: Dict[Optional[tuple], Drafter]
    weights: TargetWeights
    round: Round


class DecodeBatch:
    """The sequences decoding together, one per row of the batch state. A finished sequence
    frees its row and a waiting request takes it in place (continuous batching); free rows ride
    along in the forwards (lengths held at 0) until they are more than the busy ones, when the
    rows are compacted."""

    def __init__(self, target: LlamaModel, draft: Optional[Head], method: Method, policy: TreePolicy,
                 s: DecodeSettings, max_rows: int, session: Optional[GraphSession] = None):
        """``policy``: each round's tree; the caches are sized by the largest of its trees.
        ``session``: a graphed call's (:mod:`.graph_sessions`): the round's parts come from the
        last call that ran them, and the caches' buffers from its pool (and go back there)."""
        self.target, self.draft, self.method, self.policy, self.settings = target, draft, method, policy, s
        self.max_rows = max_rows
        self.device = target.lm_head.weight.device
        # The target's layers an EAGLE-3 head reads (None: its final hidden states, as the others)
        self.feature_layers = getattr(draft, "feature_layers", None) if method.drafts else None
        if session is not None and session.parts is None:
            session.parts = self._parts(kept=True)
        parts = self._parts() if session is None else session.parts
        self.drafter, self.drafters, self.weights, self.rounds = parts
        # Where the caches' buffers come from: capacities by the pool's quantum either way, kept
        # for the next call in a graphed call's session.
        self.pool = BufferPool(most=0) if session is None else session.pool
        self.tree_nodes = self.drafter.max_nodes
        self.draining = False  # no request waits for a row (set by the caller before each round)
        self.state: Optional[BatchState] = None
        self.root_parent = torch.tensor([[-1]], device=self.device)

    def _parts(self, kept: bool = False) -> RoundParts:
        """The drafters (each checks the method, the head and its tree), the target's weights as
        they are when the call starts (the call's) and the round. ``kept``: a session's, whose
        drafters serve later calls found by the trees' values: they draft from copies of the trees
        (a caller may change its objects after this call)."""
        draft, method, rows = self.draft, self.method, self.max_rows
        own = copy.deepcopy if kept else (lambda t: t)
        tree = largest_tree(self.policy, method)
        catch_up = Drafter(draft, method, own(tree), rows)
        drafters = {tree_key(t): catch_up if t is tree else Drafter(draft, method, own(t), rows) if t is not None
                    else Drafter(None, METHODS[BASELINE], catch_up.tree) for t in self.policy.trees}
        weights = self.target.prepare()
        return RoundParts(catch_up, drafters, weights,
                          Round(self.target, weights, catch_up, self.settings, self.feature_layers,
                                len(self.policy.trees)))

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
        logits, hidden = self.target(ids.unsqueeze(0), one, last_logits_only=True, feature_layers=self.feature_layers,
                                     weights=self.weights)
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

    @torch.inference_mode()
    def admit(self, pending: List[DecodeSequence]) -> List[DecodeSequence]:
        """Start the sequences ``pending`` (at most the free rows); returns those already done
        (their first token ended them), the others take rows."""
        # While plain decoding runs at this many rows, the draft's prefill waits for a drafting round.
        draft_later = not self.policy.drafting(len(self.seqs) + len(pending))
        started = [(seq, self._prefill(seq, draft_later)) for seq in pending]
        done = [seq for seq, _ in started if seq.done]
        started = [(seq, state) for seq, state in started if not seq.done]
        if started:
            seqs = [seq for seq, _ in started]
            room = max(min(seq.bound, seq.ids.numel() + INITIAL_ROOM + self.tree_nodes) for seq in seqs)
            bound = max(seq.bound for seq in seqs)
            if self.state is None:
                self.state = BatchState(self.target, self.drafter, len(seqs), room, bound, self.pool)
            free = self.state.make_room(len(seqs), bound)
            for b, (seq, state) in zip(free, started):
                self.state.load(b, seq, state)
        return done

    @torch.inference_mode()
    def drop_done(self) -> List[DecodeSequence]:
        """Free the rows of the finished sequences; returns them."""
        return [] if self.state is None else self.state.drop_done()

    @torch.inference_mode()
    def compact(self) -> None:
        """Drop the free rows when they outnumber the busy ones (the whole state when none is busy)."""
        if self.state is not None and not self.state.compact():
            self.close()

    def close(self) -> None:
        """The batch state is let go (its caches' buffers back to the pool, if any)."""
        if self.state is not None:
            self.state.release()
            self.state = None

    # ------------------------------------------------------------------ a round
    @torch.inference_mode()
    def round(self) -> Optional[RoundResult]:
        """One round for every sequence of the batch: the policy's tree, the draft's catch-up on
        what it is behind (rounds of plain decoding, prompts admitted without its prefill: timed
        apart, not the round's), the round, and the policy's look at what it did; the listeners
        told when it starts and ends. None: no round ran (a sequence was done)."""
        for listen in ROUND_LISTENERS:
            listen(True)
        try:
            drafter = self.drafters[tree_key(self.policy.choose(len(self.state.rows)))]
            t0 = time.perf_counter()
            caught_up = self.state.catch_up_pending() if drafter.drafts else 0
            result = self.rounds.run(self.state, drafter, self.draining, caught_up, time.perf_counter() - t0)
            if result is not None:
                self.policy.observe(result)
            return result
        finally:
            for listen in ROUND_LISTENERS:
                listen(False)
