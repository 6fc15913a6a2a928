"""How far each row's draft is behind the target (:class:`DraftLag`).

A round that drafts nothing (plain decoding, chosen by the tree policy while it pays better) and a
prompt admitted without the draft's prefill leave the draft behind: it catches up on those
(token, feature) pairs in one forward before the next round that drafts
(:meth:`BatchState.catch_up_pending`), not a forward every round. A row behind by more than its
window (:func:`window`) is rebuilt from its last ones alone.
"""
from __future__ import annotations

from typing import List, NamedTuple, Optional

import torch

from jakiro_ext import ops

# A row's draft left behind by more than its window of tokens is rebuilt from its last ones alone
# when it drafts again, not caught up on all of them: while plain decoding wins, the draft costs a
# window's forward per return to drafting, not a forward every few rounds (about 3% of a round at
# 16 rows, the head's share of the compute). RoPE is relative, so the rebuilt rows attend as a
# window of the sequence would; only the context the draft sees is shorter, and the draft accepts
# less: beside the Q4_1 target, a tree round after 40 plain rounds accepted 0.40 drafts rebuilt
# from 32 pairs, 0.69 caught up on all (0.71 after 16), and the live choice, which measures trees
# by such rounds, took them for worse than they are. So the window is DRAFT_PAIRS over the batch's
# rows (a whole 64-token call and its prompt at one row, where a catch-up of 256 pairs costs 2-3
# plain steps), never below DRAFT_WINDOW.
DRAFT_WINDOW = 32
DRAFT_PAIRS = 256


def window(rows: int) -> int:
    """The pairs a row's draft is kept behind by, at most, in a batch of up to ``rows`` rows."""
    return max(DRAFT_WINDOW, DRAFT_PAIRS // max(rows, 1))


class Pending(NamedTuple):
    """What the draft is to run to catch up: row b's pairs in order, tokens [B, n] and features
    [B, n, H] (the last one repeated past ``counts[b]``: computed, not committed), and the rows to
    empty first (``rebuilt``: behind by more than the window)."""
    tokens: torch.Tensor
    features: torch.Tensor
    counts: List[int]
    rebuilt: List[int]


class DraftLag:
    """Row b's last ``window`` pairs the draft has not run, in a ring (pair i of the row at
    column i % window), and how many it is behind (``behind[b]``). The rounds deferred since
    the ring was last written are held as they came (``_deferred``) and written in one call when
    the ring is next read or its rows move, at the latest every ``window`` rounds: a plain round
    of a drafting call appends to a list instead of making four tensor calls."""

    def __init__(self, batch: int, window: int):
        self.window = window
        self.tokens: Optional[torch.Tensor] = None  # [B, window], made by the first use
        self.features: Optional[torch.Tensor] = None  # [B, window, H]
        self.behind: List[int] = [0] * batch
        self._deferred: list = []  # (tokens [B, 1], features [B, 1, H], each row's behind before it)

    @property
    def rebuild(self) -> List[bool]:
        """Which rows' drafts are behind by more than the window (rebuilt when they catch up)."""
        return [n > self.window for n in self.behind]

    def select(self, rows: List[int], index: Optional[torch.Tensor]) -> None:
        """The rows become ``rows`` (indices of the current ones; -1: a new one, not behind);
        ``index``: the same on the ring's device, -1 as 0 (None: no draft, no ring)."""
        self._write_deferred()
        if self.tokens is not None:
            self.tokens, self.features = self.tokens[index], self.features[index]
        self.behind = [self.behind[r] if r >= 0 else 0 for r in rows]

    def restart(self, b: int) -> None:
        """Row ``b`` takes a new sequence: its draft is behind by nothing."""
        self._write_deferred()
        self.behind[b] = 0

    def defer(self, tokens: torch.Tensor, features: torch.Tensor) -> None:
        """Every row is behind by one more pair: ``tokens`` [B, 1], ``features`` [B, 1, H] (the
        round's own tensors, kept until written: not to be written to after)."""
        self._deferred.append((tokens, features, self.behind))
        self.behind = [n + 1 for n in self.behind]
        if len(self._deferred) == self.window:
            self._write_deferred()

    def _write_deferred(self) -> None:
        """The deferred rounds into the ring, each row's pairs at their columns, in one call per tensor."""
        if not self._deferred:
            return
        tokens = torch.cat([t for t, _, _ in self._deferred], 1)  # [B, n]
        features = torch.cat([f for _, f, _ in self._deferred], 1)  # [B, n, H]
        self._make(features)
        W = self.window
        columns = [[before[b] % W for _, _, before in self._deferred] for b in range(tokens.shape[0])]
        column = ops.to_device(torch.tensor(columns), tokens.device)  # (n <= W: a row's columns distinct)
        self.tokens.scatter_(1, column, tokens)
        self.features.scatter_(1, column.unsqueeze(-1).expand(*column.shape, features.shape[-1]), features)
        self._deferred.clear()

    def remember(self, b: int, tokens: torch.Tensor, features: torch.Tensor) -> None:
        """Row ``b``'s draft (empty) is behind by the pairs ``tokens`` [n], ``features`` [n, H]:
        the last ``window`` of them kept."""
        self._write_deferred()
        self._make(features)
        n, W = tokens.numel(), self.window
        column = ops.to_device(torch.arange(max(n - W, 0), n) % W, tokens.device)
        self.tokens[b, column] = tokens[-W:]
        self.features[b, column] = features[-W:].to(self.features.dtype)
        self.behind[b] = n

    def _make(self, features: torch.Tensor) -> None:
        if self.tokens is None:
            B, W = len(self.behind), self.window
            self.tokens = torch.zeros(B, W, dtype=torch.int64, device=features.device)
            self.features = features.new_zeros(B, W, features.shape[-1])

    def take(self, busy: List[bool]) -> Optional[Pending]:
        """What the busy rows' drafts are to run to catch up (None: nothing), every row then
        counted as up to date."""
        self._write_deferred()
        W = self.window
        behind = [n if b else 0 for n, b in zip(self.behind, busy)]
        self.behind = [0] * len(self.behind)
        counts = [min(n, W) for n in behind]
        n = max(counts, default=0)
        if n == 0:
            return None
        # Row b's kept pairs in order: pairs m - k .. m - 1 (m behind, k kept) at their ring columns,
        # the last repeated past k (padding: computed, not committed).
        index = torch.tensor([[(m - k + min(i, max(k - 1, 0))) % W for i in range(n)] for m, k in zip(behind, counts)])
        index = ops.to_device(index, self.tokens.device)
        features = self.features.gather(1, index.unsqueeze(-1).expand(*index.shape, self.features.shape[-1]))
        return Pending(self.tokens.gather(1, index), features, counts, [b for b, m in enumerate(behind) if m > W])
