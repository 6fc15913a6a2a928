"""The KV caches and the attention masks: the only code that moves cache rows and lengths.

``KVCache`` holds a model's keys and values with each sequence's committed length; ``TreeKV``
the keys and values a draft tree's layers add within one round (the masks: :mod:`jakiro_ext.ops.masks`);
``BufferPool`` keeps caches' buffers for reuse (a graphed call's, for the next call's captures).
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
from torch import nn

from jakiro_ext import ops
from jakiro_ext.memory import memory_errors

@dataclass(frozen=True)
class CacheShape:
    """What a model's KV cache is shaped by: its layers, key-value heads and head size, and its
    sliding window (None: none; a cache beyond it is refused, not silently wrong)."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    sliding_window: Optional[int] = None


class BufferPool:
    """Where a decoding batch's caches get their buffers: capacities rounded up to a multiple of
    ``quantum`` positions (so caches of calls alike have buffers alike), and buffers kept for
    reuse by shape, at most ``most`` of them (the least recently given let go first; 0: none
    kept, an eager call's). What a graphed call's caches leave (:mod:`jakiro_ext.engine.graph_sessions`):
    the next call's caches are made of the same buffers, so its rounds replay the captures made
    on them. A buffer is taken for its exact shape: a cache's capacity is what it would be with
    a pool that keeps nothing (on a GPU the attention's splits follow it)."""

    def __init__(self, most: int = 8, quantum: int = 256):
        self.most, self.quantum = most, quantum
        self.kept: "OrderedDict[tuple, List[torch.Tensor]]" = OrderedDict()  # (shape, dtype, device) -> buffers

    @staticmethod
    def _key(shape: Tuple[int, ...], dtype: torch.dtype, device) -> tuple:
        return tuple(shape), dtype, torch.get_default_device() if device is None else torch.device(device)

    def take(self, shape: Tuple[int, ...], dtype: torch.dtype, device) -> Optional[torch.Tensor]:
        """A kept buffer of ``shape``, zeroed (what a cache holds beyond its lengths must be finite:
        attention weighs it by 0); None when none is kept."""
        found = self.kept.get(self._key(shape, dtype, device))
        # The first given first: caches released and made again in one order (a batch state's:
        # the target's, then the draft's) get back the buffers they had.
        return found.pop(0).zero_() if found else None

    def give(self, buffer: torch.Tensor) -> None:
        """Keep ``buffer`` (which its cache no longer uses) for a later :meth:`take`."""
        key = self._key(buffer.shape, buffer.dtype, buffer.device)
        found = self.kept.setdefault(key, [])
        if all(t is not buffer for t in found):
            found.append(buffer)
        self.kept.move_to_end(key)
        while sum(map(len, self.kept.values())) > self.most:
            oldest = next(k for k, v in self.kept.items() if v)
            self.kept[oldest].pop(0)


class KVCache(nn.Module):
    """Every layer's keys and values in one buffer ``kv`` [L, 2, B, Hkv, S, D] (so one
    ``compact_kv`` call serves all layers) and each sequence's committed length ``lengths`` [B],
    with the same lengths kept on the host (``host_lengths``): sizing a forward never reads the
    device (on a GPU such a read stalls the launch queue). Change the lengths only through the
    verbs below, which keep the two equal.

    The buffer starts at ``capacity`` positions and grows on demand (:meth:`reserve`, called by
    the forwards) up to ``max_capacity`` (default ``capacity``: a fixed cache), so a caller sizes
    it by what can happen and pays for what does. With a ``pool`` (:class:`BufferPool`), every
    capacity and the bound are rounded up to its quantum (within the sliding window), and the
    buffers come from the pool where it keeps one of the shape and go back to it when let go (a
    growth, a selection of rows, :meth:`release`)."""

    def __init__(self, shape: CacheShape, batch: int, capacity: int, dtype: torch.dtype = torch.float32,
                 device=None, max_capacity: Optional[int] = None, pool: Optional[BufferPool] = None):
        super().__init__()
        self.shape, self.batch, self.pool = shape, batch, pool
        self.quantum = 1 if pool is None else pool.quantum
        max_capacity = capacity if max_capacity is None else max_capacity
        if not 1 <= capacity <= max_capacity:
            raise ValueError(f"cache capacity must be in [1, max_capacity {max_capacity}], got {capacity}")
        if shape.sliding_window is not None and max_capacity > shape.sliding_window:
            raise ValueError(f"cache capacity {max_capacity} exceeds the model's sliding window "
                             f"{shape.sliding_window}, which this implementation does not apply")
        self.max_capacity = self._rounded(max_capacity)
        self.register_buffer("kv", self._new_buffer(min(self._rounded(capacity), self.max_capacity), dtype, device),
                             persistent=False)
        self.register_buffer("lengths", self._new_lengths(batch, device), persistent=False)
        self.host_lengths: List[int] = [0] * batch

    @property
    def capacity(self) -> int:
        return self.kv.shape[-2]

    def _rounded(self, positions: int) -> int:
        """``positions`` rounded up to the quantum, within the sliding window."""
        rounded = -(-positions // self.quantum) * self.quantum
        window = self.shape.sliding_window
        return rounded if window is None or positions > window else min(rounded, window)

    def _new_buffer(self, capacity: int, dtype: torch.dtype, device, batch: Optional[int] = None) -> torch.Tensor:
        c = self.shape
        shape = (c.num_layers, 2, self.batch if batch is None else batch, c.num_kv_heads, capacity, c.head_dim)
        kept = None if self.pool is None else self.pool.take(shape, dtype, device)
        if kept is not None:
            return kept
        nbytes = math.prod(shape) * dtype.itemsize
        with memory_errors(f"allocating a KV cache of {capacity} positions ({list(shape)}, {dtype}), which needs "
                           f"{nbytes} bytes ({nbytes / 2**30:.2f} GiB)"):
            return torch.zeros(shape, dtype=dtype, device=device)

    def _new_lengths(self, batch: int, device) -> torch.Tensor:
        kept = None if self.pool is None else self.pool.take((batch,), torch.int64, device)
        return torch.zeros(batch, dtype=torch.int64, device=device) if kept is None else kept

    def _let_go(self, *buffers: torch.Tensor) -> None:
        """Buffers this cache no longer uses: to its pool, if it has one."""
        if self.pool is not None:
            for t in buffers:
                self.pool.give(t)

    def release(self) -> None:
        """Its buffers go back to its pool (the cache is not used again); nothing without a pool."""
        self._let_go(self.kv, self.lengths)

    def storage_key(self) -> tuple:
        """Its buffers' addresses and shapes: what a capture of a round reads of it, and what
        :class:`jakiro_ext.engine.graphs.Replay` keys the capture by (not by this object)."""
        return tuple((t.data_ptr(), tuple(t.shape), t.dtype, t.device) for t in (self.kv, self.lengths))

    def reserve(self, positions: int) -> None:
        """Make room for ``positions`` positions per sequence: the buffer grows to at least twice
        its size (at most ``max_capacity``), keeping the committed entries."""
        if positions <= self.capacity:
            return
        if positions > self.max_capacity:
            raise ValueError(f"{positions} cache positions needed, beyond the cache capacity {self.max_capacity}")
        kv = self._new_buffer(min(self._rounded(max(positions, 2 * self.capacity)), self.max_capacity), self.kv.dtype,
                              self.kv.device)
        used = max(self.host_lengths)
        kv[..., :used, :] = self.kv[..., :used, :]
        self._let_go(self.kv)
        self.kv = kv

    # ------------------------------------------------------------------ its verbs
    # A forward writes the keys/values of its T new tokens at [lengths[b], lengths[b] + T) of each
    # sequence without committing them; the caller keeps what it accepts with these.
    def commit(self, n, host: Optional[List[int]] = None) -> None:
        """The first n of the tokens last written become part of each sequence's prefix: n an
        int (every sequence; negative: the last -n committed are dropped), or a [B] tensor whose
        values the caller knows on the host as ``host``."""
        self.commit_on_host(host if isinstance(n, torch.Tensor) else [n] * self.batch)
        self.lengths += n

    def commit_path(self, path: torch.Tensor, path_len: torch.Tensor, host_path_len: List[int]) -> None:
        """Keep each sequence's accepted path of the tree last written: the keys/values of nodes
        path[b, :path_len[b]] move right after the prefix (``jakiro::compact_kv``, every layer
        in one call) and are committed. ``host_path_len``: path_len's values, known on the host."""
        self._compact(path, path_len)
        self.commit(path_len, host_path_len)

    def _compact(self, path: torch.Tensor, path_len: torch.Tensor) -> None:
        if path.shape[1] > 1:  # (node 0, the root, is always the path's first: already in place)
            ops.compact_kv(self.kv, self.lengths, path, path_len)

    # A captured round (jakiro_ext.engine.round) commits in two halves: the device's in its
    # capture, where a replay runs no host code, and the host's once it has read the counts.
    # Between them the two lengths differ: nothing else may read or change them.
    def commit_on_device(self, n: torch.Tensor, path: Optional[torch.Tensor] = None) -> None:
        """The device's half of :meth:`commit` of a [B] tensor ``n`` (with ``path``: of
        :meth:`commit_path`), with no read of the device and no host-side change."""
        if path is not None:
            self._compact(path, n)
        self.lengths += n

    def commit_on_host(self, host: List[int]) -> None:
        """The host's half of a commit: each sequence's length grows by ``host[b]``."""
        if host is None or len(host) != self.batch:
            raise ValueError(f"commit of a [B] tensor needs its {self.batch} values on the host, got {host!r}")
        lengths = [a + b for a, b in zip(self.host_lengths, host)]
        if min(lengths) < 0:
            raise ValueError(f"a sequence's committed length would fall below 0: {lengths}")
        self.host_lengths = lengths

    def clear(self, rows: List[int]) -> None:
        """The sequences ``rows`` become empty (length 0)."""
        for b in rows:
            self.lengths[b] = 0
            self.host_lengths[b] = 0

    def written(self, layer: int, rows: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [B, rows, Hkv, D] of ``layer`` last written after each sequence's prefix."""
        slots = self.lengths.unsqueeze(1) + torch.arange(rows, device=self.lengths.device)  # [B, rows]
        index = slots.view(self.batch, 1, rows, 1).expand(-1, self.kv.shape[3], -1, self.kv.shape[5])
        k, v = (self.kv[layer, i].gather(2, index).transpose(1, 2) for i in (0, 1))
        return k, v

    def load(self, row: int, other: "KVCache") -> None:
        """Sequence ``row`` becomes ``other``'s only sequence: its committed keys/values and length."""
        n = other.host_lengths[0]
        self.reserve(n)
        self.kv[:, :, row, :, :n] = other.kv[:, :, 0, :, :n]
        self.lengths[row] = n
        self.host_lengths[row] = n

    def select_rows(self, rows: List[int], max_capacity: Optional[int] = None) -> None:
        """The sequences become ``rows`` (indices of the current ones, in their new order; -1: a
        new empty sequence); the others are dropped. ``max_capacity`` raises the bound on
        positions (what the new sequences may need)."""
        index = ops.to_device(torch.tensor([max(r, 0) for r in rows]), self.kv.device)
        old_kv, old_lengths = self.kv, self.lengths
        if self.pool is None:
            self.kv, self.lengths = old_kv[:, :, index].contiguous(), old_lengths[index]
        else:  # (into buffers of the pool's where it keeps them)
            self.kv = self._new_buffer(self.capacity, old_kv.dtype, old_kv.device, len(rows))
            self.kv.copy_(old_kv[:, :, index])
            self.lengths = self._new_lengths(len(rows), old_lengths.device)
            self.lengths.copy_(old_lengths[index])
            self._let_go(old_kv, old_lengths)
        self.host_lengths = [self.host_lengths[r] if r >= 0 else 0 for r in rows]
        self.batch = len(rows)
        fresh = [i for i, r in enumerate(rows) if r < 0]
        if fresh:
            self.kv[:, :, fresh] = 0
            self.clear(fresh)
        if max_capacity is not None:
            self.allow(max_capacity)

    def allow(self, max_capacity: int) -> None:
        """Raise the bound on positions per sequence to ``max_capacity`` (what a new sequence may need)."""
        self.max_capacity = max(self.max_capacity, self._rounded(max_capacity))


class TreeKV:
    """Keys/values of the draft-tree layers already run in this round (per decoder layer,
    [B, M, Hkv, D]), so a new tree layer attends to its ancestors without recomputing them; see
    :meth:`DraftHead.forward`."""

    def __init__(self):
        self.keys: List[torch.Tensor] = []  # one per decoder layer; empty until a tree layer ran
        self.values: List[torch.Tensor] = []
        self.visible: Optional[torch.Tensor] = None  # [B, T, M] bool for the rows being run

    def append(self, cache: KVCache, rows: int) -> None:
        """Keep the keys/values the last forward wrote after each sequence's prefix (uncommitted)."""
        for layer in range(cache.kv.shape[0]):
            k, v = cache.written(layer, rows)  # [B, rows, Hkv, D]
            if layer < len(self.keys):
                self.keys[layer] = torch.cat([self.keys[layer], k], 1)
                self.values[layer] = torch.cat([self.values[layer], v], 1)
            else:
                self.keys.append(k.clone())
                self.values.append(v.clone())

    def merge_into(self, q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, layer: int = 0) -> torch.Tensor:
        """Attention of q [B, T, Hq, D] over the visible tree keys of ``layer``, merged with (out,
        lse) of the prefix part by log-sum-exp (``jakiro::merge_attention_states``)."""
        B, T, Hq, D = q.shape
        G = Hq // self.keys[layer].shape[2]
        k = self.keys[layer].float().repeat_interleave(G, dim=2)  # [B, M, Hq, D]
        v = self.values[layer].float().repeat_interleave(G, dim=2)
        scores = torch.einsum("bthd,bmhd->bthm", q.float(), k) / math.sqrt(D)
        scores = scores.masked_fill(~self.visible.unsqueeze(2), -math.inf)
        tree_lse = torch.logsumexp(scores, dim=-1)  # [B, T, Hq], -inf where nothing is visible
        probs = torch.exp(scores - tree_lse.nan_to_num(0.0, neginf=0.0).unsqueeze(-1))
        tree_out = torch.einsum("bthm,bmhd->bthd", probs, v)
        merged, _ = ops.merge_attention_states(torch.stack([out.float(), tree_out], dim=3),
                                               torch.stack([lse, tree_lse], dim=3), out.dtype)
        return merged
