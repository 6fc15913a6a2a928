"""One draft-verify round, the engine's mechanism, read top to bottom in :meth:`Round.run`.

A round starts from each sequence's root (its last emitted token, not yet in the target's cache)
and the draft's root step: the drafter it is given drafts a tree per sequence, the target runs
every tree of the batch in one forward, ``jakiro::verify_tree`` accepts each sequence's longest
valid path and a bonus token, both caches keep the accepted paths and the tokens are emitted.
Which tree (which drafter) is the tree policy's, chosen before the round
(:mod:`jakiro_ext.engine.policy`); what the round did is a :class:`RoundResult` the policy
observes after it. The round's data:

- :class:`RoundInputs`: the device tensors the round's device work starts from (a pytree: a
  CUDA-graph capture flattens it, :class:`jakiro_ext.engine.graphs.Replay`);
- :class:`RoundOutputs`: what the device work gives back;
- :class:`RoundReadback`: what the host reads of it, in one read;
- :class:`RoundResult`: what the round did, per sequence.
"""
from __future__ import annotations

import statistics
import time
import weakref
from dataclasses import dataclass
from typing import List, NamedTuple, Optional, Tuple

import torch

from jakiro_ext import ops
from jakiro_ext.config import TreeConfig
from jakiro_ext.engine.drafter import DRAFT_ERRORS, Drafter
from jakiro_ext.engine.graphs import KEPT_CAPTURES, Replay
from jakiro_ext.engine.sequence import DecodeSettings, no_distribution_error
from jakiro_ext.engine.state import BatchState
from jakiro_ext.kv_cache import KVCache
from jakiro_ext.models.heads.step import DraftStep
from jakiro_ext.models.llama import LlamaModel
from jakiro_ext.models.weights import TargetWeights


class RoundInputs(NamedTuple):
    """What a round's device work starts from: each row's root token ``roots`` [B], with sampling
    its draws ``draws`` [B, nodes + 1] (node i's draw, the bonus token's last), and the draft's
    root step [B, 1, ...] (None when nothing is drafted)."""
    roots: torch.Tensor
    draws: Optional[torch.Tensor]
    root_step: Optional[DraftStep]


class RoundOutputs(NamedTuple):
    """What a round's device work gives back: each row's accepted ``path`` (tree nodes, the root
    first), its new ``tokens`` [B, width] (the accepted drafts, then the bonus), the target's
    ``hidden`` states over the tree, the ``packed`` readback (:meth:`RoundReadback.pack`) and, a
    captured round that drafted (which commits in its capture), the draft's new ``root_step``."""
    path: torch.Tensor
    tokens: torch.Tensor
    hidden: torch.Tensor
    packed: torch.Tensor
    root_step: Optional[DraftStep] = None


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


@dataclass(frozen=True)
class RoundResult:
    """What a round did, what a tree policy observes. Per sequence in flight (in row order): the
    drafts it accepted (``accepted``), the new tokens of its budget it had left before the round
    and after it (``left_before``, ``left_after``: 0 once done). ``tree``: the tree run (None:
    plain decoding); ``rows``: the batch's rows, free ones included; ``context``: the sequences'
    mean committed tokens before it; ``seconds``: its wall time, ``catch_up_seconds`` the draft's
    catch-up before it on what it was behind (not the round's); the forwards it ran, the draft's
    catch-up included; ``captured``: the round captured its graph (its seconds are not its rate)."""
    tree: Optional[TreeConfig]
    rows: int
    accepted: List[int]
    left_before: List[int]
    left_after: List[int]
    draining: bool
    context: float
    seconds: float
    catch_up_seconds: float
    target_forwards: int
    draft_forwards: int
    captured: bool = False


class Round:
    """A batch's rounds: the target and its prepared weights (the call's), the settings and the
    drafter that catches the draft up (``catch_up``: the largest tree's, whose scratch the caches
    are sized by) are fixed; the state and the round's drafter come with each :meth:`run`.
    ``trees``: how many trees the rounds may run (plain decoding counted), each captured apart
    when graphed."""

    def __init__(self, target: LlamaModel, weights: TargetWeights, catch_up: Drafter, s: DecodeSettings,
                 feature_layers=None, trees: int = 1):
        # The target held weakly: a graphed call's round is kept with the target (graph_sessions),
        # and a cycle would keep the target's memory until Python's cycle collector ran.
        self._target = weakref.ref(target)
        self.weights, self.catch_up, self.settings = weights, catch_up, s
        self.feature_layers = feature_layers
        # (graphed: KEPT_CAPTURES captures for each of the ``trees`` the rounds may run)
        self.replay = None if s.graphs == "eager" else Replay(self._device_work, s.graphs, KEPT_CAPTURES * trees)

    @property
    def target(self) -> LlamaModel:
        return self._target()

    def run(self, state: BatchState, drafter: Drafter, draining: bool = False, caught_up: int = 0,
            catch_up_seconds: float = 0.0) -> Optional[RoundResult]:
        """Draft (with ``drafter``), verify, commit and emit once for every sequence of ``state``;
        the host reads the device once (a RoundReadback). ``caught_up``: the draft forwards run
        before it for it (``catch_up_seconds`` long). None: no round ran (a sequence is done)."""
        t0, s, seqs, B = time.perf_counter(), self.settings, state.rows, len(state.rows)
        nodes = drafter.max_nodes
        for seq, length in zip(seqs, state.host_lengths):
            if seq is not None and length + self.catch_up.max_nodes > seq.bound:  # (a max_cache_len below the need)
                seq.stats.stop_reason = "cache_full"
        if any(seq.done for seq in state.seqs):
            return None
        left_before = [seq.budget - len(seq.out) for seq in state.seqs]
        context = statistics.fmean(n for seq, n in zip(seqs, state.host_lengths) if seq is not None)
        state.prepare_round(nodes)
        inputs = self._inputs(state, nodes)
        work = (drafter, state.target_kv, state.draft_kv, inputs)
        if self.replay is None:
            (out, drafted), captured = self._device_work(*work), False
        else:
            before = self.replay.captures
            out, drafted = self.replay(B, work)  # (and the caches' buffers: graphs._constant_key)
            out, captured = RoundOutputs(*out), self.replay.captures > before
        back = RoundReadback.read(out.packed, B)
        counts = [a + 1 for a in back.accepted]
        # The target's hidden states at the root and the accepted nodes are the draft's catch-up:
        # now (a captured round: done in its capture), or (a round that drafted nothing) with the
        # next round that drafts.
        n, features = max(counts), None
        deferred = self.catch_up.drafts and not drafter.drafts
        if s.keep_features or deferred or (drafter.drafts and self.replay is None):
            if out.hidden.shape[1] == 1:  # a one-node tree's: the root's (a replay's outputs are its buffers)
                features = out.hidden if self.replay is None else out.hidden.clone()
            else:
                features = path_features(out.hidden, out.path, n)
        if self.replay is None:
            forwards = self.catch_up.forwards
            step = self.catch_up.catch_up(state.draft_kv, out.tokens[:, :n], features) if drafter.drafts else None
            state.commit(out.path, counts, step)
            drafted += self.catch_up.forwards - forwards
        else:
            state.committed(counts, out.root_step)
        if deferred:  # (kept as they are: a replay's buffers copied)
            state.defer_catch_up(out.tokens[:, :1] if self.replay is None else out.tokens[:, :1].clone(), features)
        drafted += caught_up
        for b, (seq, a, new) in enumerate(zip(seqs, back.accepted, back.tokens)):
            if seq is None:
                continue
            seq.stats.target_forwards += 1
            seq.stats.draft_forwards += drafted
            seq.stats.accept_lengths.append(a)
            seq.stats.plain_rounds += not drafter.drafts
            if s.keep_features:
                seq.features.append(features[b, : a + 1])
            seq.root = new[a]
            seq.emit(new)
        return RoundResult(drafter.tree if drafter.drafts else None, B,
                           [a for seq, a in zip(seqs, back.accepted) if seq is not None], left_before,
                           [0 if seq.done else seq.budget - len(seq.out) for seq in state.seqs], draining, context,
                           time.perf_counter() - t0, catch_up_seconds, 1, drafted, captured)

    def _inputs(self, state: BatchState, nodes: int) -> RoundInputs:
        """The roots, the draws with sampling (node i of a sequence's tree uses its i-th draw, the
        bonus token its last: a sequence draws the same whatever the round's padded tree size, set
        by the other sequences) and the root step."""
        device = self.target.lm_head.weight.device
        roots = ops.to_device(torch.tensor([seq.root if seq else 0 for seq in state.rows]), device)
        draws = None
        if self.settings.temperature > 0:
            draws = torch.full((len(state.rows), nodes + 1), 0.5, dtype=torch.float64)  # free rows: never read
            for b, seq in enumerate(state.rows):
                if seq is not None:
                    draws[b] = seq.draws(nodes + 1)[0]
            draws = ops.to_device(draws, device)
        return RoundInputs(roots, draws, state.root_step)

    def _device_work(self, drafter: Drafter, target_kv: KVCache, draft_kv: Optional[KVCache],
                     inputs: RoundInputs) -> Tuple[RoundOutputs, int]:
        """The round's device work, from its inputs to what the host reads: a function of these
        tensors and of the caches alone, with no read of the device, so a CUDA graph can replay it
        (:mod:`jakiro_ext.engine.graphs`). Returns (its outputs, the draft forwards it ran)."""
        s = self.settings
        forwards = drafter.forwards
        tree = drafter.draft(inputs.roots, draft_kv, inputs.root_step)
        logits, hidden = self.target(tree.tokens, target_kv, tree.mask, tree.depths,
                                     feature_layers=self.feature_layers, weights=self.weights)
        T = tree.tokens.shape[1]
        uniforms = None if inputs.draws is None else torch.cat([inputs.draws[:, :T], inputs.draws[:, -1:]], 1)
        path, accepted, bonus = ops.verify_tree(tree.parents, tree.tokens, logits, uniforms, s.temperature,
                                                s.top_p, s.top_k)
        # Each sequence's new tokens: its accepted drafts, then the bonus (row b: accepted[b] + 1 of them).
        if T == 1:  # (the root alone: the bonus)
            tokens = bonus.unsqueeze(1)
        else:
            drafts = tree.tokens.gather(1, path[:, 1:].clamp(min=0))
            tokens = torch.cat([drafts, torch.zeros_like(bonus).unsqueeze(1)], 1)
            tokens.scatter_(1, accepted.clamp(min=0).unsqueeze(1), bonus.unsqueeze(1))
        errors = tree.errors if tree.errors is not None else torch.zeros(len(DRAFT_ERRORS), dtype=torch.bool,
                                                                         device=inputs.roots.device)
        packed = RoundReadback.pack(logits, errors, accepted, tokens)
        root_step = None
        if self.replay is not None:  # (captured: the commit too, and the draft's catch-up)
            root_step = self._commit_captured(drafter, target_kv, draft_kv, path, accepted, tokens, hidden)
        return RoundOutputs(path, tokens, hidden, packed, root_step), drafter.forwards - forwards

    @staticmethod
    def _commit_captured(drafter: Drafter, target_kv: KVCache, draft_kv: Optional[KVCache], path: torch.Tensor,
                         accepted: torch.Tensor, tokens: torch.Tensor, hidden: torch.Tensor) -> Optional[DraftStep]:
        """A captured round's commit, the device's half (:meth:`BatchState.committed` is the
        host's), and the draft's catch-up, in the capture, so that a round is one replay: row b
        keeps its ``accepted[b] + 1`` new positions in both caches, the target's its path's, the
        draft's the first of a catch-up forward over the round's new tokens with the target's
        hidden states at the path's nodes. That forward's width is fixed, the tree's longest path
        (a row's rows past its own computed, not kept, as a tree's padding is); the eager round's
        is the longest accepted path, which only the host knows. Returns the new root step: each
        row's last kept row of it (None when nothing is drafted)."""
        counts = (accepted + 1).clamp(min=0)  # (-1: a logit row with no distribution; the readback raises)
        target_kv.commit_on_device(counts, path)
        if not drafter.drafts:
            return None
        width = min(path.shape[1], drafter.longest_path)
        step = drafter.catch_up(draft_kv, tokens[:, :width], path_features(hidden, path, width))
        draft_kv.commit_on_device(counts)
        return step.last_kept(counts)


def path_features(hidden: torch.Tensor, path: torch.Tensor, n: int) -> torch.Tensor:
    """The target's hidden states [B, n, H] at each row's first ``n`` path nodes (``hidden`` [B,
    T, H] over the tree; a path's -1 padding reads the root's): what the draft catches up on."""
    index = path[:, :n].clamp(min=0).unsqueeze(-1).expand(-1, -1, hidden.shape[-1])
    return hidden.gather(1, index)
