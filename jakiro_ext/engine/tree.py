"""The draft tree as a value: each sequence's nodes with their tokens, parents, depths, scores and
bit-packed ancestor mask (bit j of row i: node i sees node j, itself or an ancestor), the mask
grown as nodes are added, a child's row its parent's with its own bit
(:func:`jakiro_ext.ops.masks.child_rows`). The drafter grows a :class:`DraftTree` and reads its
ancestry from the mask; the nodes it keeps are a :class:`VerifyTree`, whose mask the target's
attention reads and whose parents the verifier reads.

Every sequence of a batch gets its own tree; the trees of one round have the same number of node
slots, a tree with fewer real nodes being padded with nodes that verification never accepts
(:meth:`VerifyTree.padded`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from jakiro_ext.ops.masks import child_rows, pack_bits, unpack_bits, widened


class DraftTree:
    """The draft trees of a batch: node i of sequence b has ``tokens[b, i]``, ``parents[b, i]``
    (-1 for the root, node 0; parents come before children), ``depths[b, i]``, ``scores[b, i]``
    (the cumulative draft log-probability, float64; -inf for a repeated candidate, never kept) and
    its mask row ``mask[b, i]`` [ceil(size / 64)] int64."""

    def __init__(self, roots: torch.Tensor):
        B = roots.shape[0]
        self.tokens = roots.reshape(B, 1).to(torch.int64)
        self.parents = torch.full_like(self.tokens, -1)
        self.depths = torch.zeros_like(self.tokens)
        self.scores = torch.zeros(B, 1, dtype=torch.float64, device=roots.device)
        self.mask = torch.ones(B, 1, 1, dtype=torch.int64, device=roots.device)  # the root sees itself

    @property
    def size(self) -> int:
        return self.tokens.shape[1]

    def add_children(self, parents: torch.Tensor, ids: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
        """Append the candidates ids / logprobs [B, R, C] as children of the nodes ``parents``
        [B, R] (row r's C candidates in rank order); returns the new nodes' indices [B, R * C]."""
        B, R, C = ids.shape
        start = self.size
        base = self.scores.gather(1, parents)  # [B, R]
        mask = widened(self.mask, start + R * C)
        above = mask.gather(1, parents.unsqueeze(-1).expand(B, R, mask.shape[-1])).repeat_interleave(C, 1)
        self.mask = torch.cat([mask, child_rows(above, start)], 1)
        self.tokens = torch.cat([self.tokens, ids.reshape(B, R * C)], 1)
        self.parents = torch.cat([self.parents, parents.repeat_interleave(C, 1)], 1)
        self.depths = torch.cat([self.depths, (self.depths.gather(1, parents) + 1).repeat_interleave(C, 1)], 1)
        self.scores = torch.cat([self.scores, (base.unsqueeze(-1) + logprobs.double()).reshape(B, R * C)], 1)
        return torch.arange(start, start + R * C, device=ids.device).expand(B, -1)

    def frontier(self, nodes: torch.Tensor, k: int) -> torch.Tensor:
        """Where among ``nodes`` [B, M] the ``k`` highest-scoring of each sequence are (ties: the
        lower index), best first: positions [B, min(k, M)] into ``nodes``."""
        return self.scores.gather(1, nodes).sort(dim=1, descending=True, stable=True).indices[:, :k]

    def ancestors_among(self, rows: torch.Tensor, earlier: torch.Tensor) -> torch.Tensor:
        """Which of the nodes ``earlier`` [B, M] (none of them the root) are ancestors of the
        nodes ``rows`` [B, R] (each deeper than all of them): bool [B, R, M], read off the mask."""
        B, R = rows.shape
        seen = unpack_bits(self.mask.gather(1, rows.unsqueeze(-1).expand(B, R, self.mask.shape[-1])), self.size)
        return seen.gather(2, earlier.unsqueeze(1).expand(B, R, earlier.shape[1]))

    def kept(self, total: int) -> "VerifyTree":
        """The root and the ``total - 1`` best drafted nodes of each sequence (fewer where fewer
        are real), in index order, padded to a common size. A child never outscores its parent
        (log-probabilities <= 0) and ties go to the lower index, so the kept set holds its ancestors.
        A tree of at most ``total`` nodes is kept whole (:meth:`every_node`: a repeated candidate
        stays in place of a padding node, and verification accepts neither), without the selection's
        thirty-odd small tensor calls (a CPU round of Jakiro's 3-node tree: 0.25 ms)."""
        if self.size <= total:
            return self.every_node()
        scores = self.scores[:, 1:]
        order = scores.sort(dim=1, descending=True, stable=True).indices[:, : total - 1] + 1
        real = self.scores.gather(1, order) > float("-inf")
        counts = real.sum(1) + 1
        # Sorted by index with the unkept (set to a large index) last. Every round verifies the
        # same number of nodes (padding where a tree has fewer real ones): no read of the counts.
        big = self.size
        keep = torch.where(real, order, big).sort(dim=1).values
        keep = torch.cat([torch.zeros_like(keep[:, :1]), keep], 1)  # [B, width], the root first
        return VerifyTree.select(self, keep, counts)

    def every_node(self) -> "VerifyTree":
        """The whole tree (a static one) as it is, its repeated candidates included: a repeat
        of an earlier sibling is never accepted, and neither is anything under it."""
        B, T = self.tokens.shape
        return VerifyTree(self.tokens, self.parents, self.depths, self.mask,
                          torch.full((B,), T, dtype=torch.int64, device=self.tokens.device))


@dataclass
class VerifyTree:
    """The nodes a round verifies: tokens, parents (indices into these), depths [B, T], their
    ancestor mask [B, T, ceil(T / 64)] (what ``jakiro::tree_attention`` reads) and the number of
    real nodes of each sequence ``counts`` [B]; nodes beyond a sequence's count are padding
    (:meth:`padded`). ``errors`` [len(DRAFT_ERRORS)] bool: what went wrong in drafting, found on
    the device and read with the round's accepted tokens (None: nothing drafted)."""
    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    mask: torch.Tensor
    counts: torch.Tensor
    errors: Optional[torch.Tensor] = None

    @classmethod
    def select(cls, tree: DraftTree, keep: torch.Tensor, counts: torch.Tensor) -> "VerifyTree":
        """The nodes ``keep`` [B, W] of ``tree`` (the first counts[b] are real, in index order,
        the root first; the rest is ignored), re-indexed, then padded."""
        B, W = keep.shape
        N = tree.size
        position = torch.arange(W, device=keep.device).expand(B, -1)
        real = position < counts.unsqueeze(1)
        keep = torch.where(real, keep, 0)  # padding, replaced by padded()
        # Each kept node's position among the kept ones (column N: a sink for the padding).
        where = torch.full((B, N + 1), -1, dtype=torch.int64, device=keep.device)
        where.scatter_(1, torch.where(real, keep, N), torch.where(real, position, -1))
        parents = tree.parents.gather(1, keep)
        parents = torch.where(parents >= 0, where.gather(1, parents.clamp(min=0)), -1)
        # A kept node's row: the bits of the kept nodes among its tree row's (its ancestors are kept).
        rows = unpack_bits(tree.mask.gather(1, keep.unsqueeze(-1).expand(B, W, tree.mask.shape[-1])), N)
        mask = pack_bits(rows.gather(2, keep.unsqueeze(1).expand(B, W, W)) & real.unsqueeze(1))
        return cls(tree.tokens.gather(1, keep), parents, tree.depths.gather(1, keep), mask, counts).padded()

    def padded(self) -> "VerifyTree":
        """Nodes beyond a sequence's count become copies of its node 1 (a child of the root, same
        parent and token: seeing the root and itself): verification takes the first child with a
        token (greedy) and skips a repeated sibling (sampling), so a copy is never accepted and the
        trees of a batch can share one size. A tree with its root alone has no node 1 to copy: the
        drafter flags it (the second of ``DRAFT_ERRORS``), and the round raises before anything
        is emitted."""
        B, T = self.tokens.shape
        if T == 1:
            return self
        pad = torch.arange(T, device=self.tokens.device).expand(B, -1) >= self.counts.unsqueeze(1)
        first = lambda t: t[:, 1:2].expand(B, T)  # noqa: E731
        self.tokens = torch.where(pad, first(self.tokens), self.tokens)
        self.parents = torch.where(pad, 0, self.parents)
        self.depths = torch.where(pad, 1, self.depths)
        root_and_itself = child_rows(self.mask[:, :1, :].expand(B, T, -1), 0)
        self.mask = torch.where(pad.unsqueeze(-1), root_and_itself, self.mask)
        return self
