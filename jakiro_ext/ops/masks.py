"""Bit-packed tree masks, what ``jakiro::tree_attention`` reads, and every builder of them: bit j of
row i set when node i sees node j (itself, its ancestors). A tree's mask grows with the tree, a
child's row its parent's with its own bit (:func:`child_rows`: the engine's trees,
:class:`jakiro_ext.engine.tree.DraftTree`), or is built from a tree's parents at once
(:func:`build_tree_mask`); a chain's (:func:`causal_tree_mask`) and a layer's rows seeing themselves
only (:func:`diagonal_mask`) are built packed from bit ranges."""
from __future__ import annotations

import functools

import torch

def build_tree_mask(parents: torch.Tensor, check: bool = True) -> torch.Tensor:
    """Bit-packed ancestor mask [B, T, ceil(T / 64)] int64 of trees given by parents [B, T]:
    bit j of row i is set when node j is node i itself or one of its ancestors. ``check=False``
    skips :func:`check_parents` (which reads the values on the host) for trees valid by
    construction. Built as :func:`child_rows` grows a tree's mask, a node's row taking its
    ancestors' rows, by pointer jumping: ceil(log2 T) steps, no host read."""
    if check:
        check_parents(parents)
    B, T = parents.shape
    nodes = torch.arange(T, device=parents.device)
    rows = packed_bit_ranges(nodes, nodes, T).expand(B, -1, -1)
    ancestor = parents.clamp(min=0)  # (the root's: itself)
    for _ in range(max(T - 1, 0).bit_length()):
        rows = rows | rows.gather(1, ancestor.unsqueeze(-1).expand_as(rows))
        ancestor = ancestor.gather(1, ancestor)
    return rows.contiguous()


def child_rows(parent_rows: torch.Tensor, first: int) -> torch.Tensor:
    """The mask rows of new nodes ``first``, ``first + 1``, ... (their indices in the tree) whose
    parents' rows are ``parent_rows`` [B, N, W]: a child sees what its parent sees, and itself."""
    return parent_rows | own_bits(first, parent_rows.shape[1], parent_rows.shape[-1], parent_rows.device)


@functools.lru_cache(maxsize=256)
def own_bits(first: int, count: int, words: int, device) -> torch.Tensor:
    """Rows [count, words] with bit ``first + i`` set in row i, alone: a constant of a tree's
    shape, made once (a round grows its tree with the same shapes every time)."""
    nodes = torch.arange(first, first + count, device=device)
    return packed_bit_ranges(nodes, nodes, words * 64)


def widened(mask: torch.Tensor, num_bits: int) -> torch.Tensor:
    """``mask`` [..., W] with zero words appended up to ceil(num_bits / 64) words."""
    extra = (num_bits + 63) // 64 - mask.shape[-1]
    return mask if extra <= 0 else torch.cat([mask, mask.new_zeros((*mask.shape[:-1], extra))], -1)


def unpack_bits(words: torch.Tensor, num_bits: int) -> torch.Tensor:
    """:func:`pack_bits` undone: int64 words [..., W] to bools [..., num_bits]."""
    bits = (words.unsqueeze(-1) >> _shifts(words.device)) & 1
    return bits.flatten(-2)[..., :num_bits].bool()


@functools.lru_cache(maxsize=8)
def _shifts(device) -> torch.Tensor:
    return torch.arange(64, device=device, dtype=torch.int64)


def packed_bit_ranges(first: torch.Tensor, last: torch.Tensor, num_bits: int) -> torch.Tensor:
    """Rows with bits first[i]..last[i] set (inclusive; first > last: none), packed as
    :func:`pack_bits` packs them: [T, ceil(num_bits / 64)] int64, built without a [T, num_bits]
    tensor."""
    starts = torch.arange((num_bits + 63) // 64, device=first.device) * 64  # first bit of each word

    def low_bits(n: torch.Tensor) -> torch.Tensor:
        """Words with bits 0..n-1 set, n in [0, 64]: ~(-1 << n), and -1 for n = 64 (no shift by 64,
        no signed overflow: -1 << 63 is the int64 minimum, whose complement is 2**63 - 1)."""
        return torch.where(n >= 64, -1, ~(-1 << n.clamp(max=63)))

    return (low_bits((last.unsqueeze(1) + 1 - starts).clamp(0, 64))
            & ~low_bits((first.unsqueeze(1) - starts).clamp(0, 64)))


def causal_tree_mask(batch: int, num_tokens: int, device=None) -> torch.Tensor:
    """Bit-packed mask [batch, T, ceil(T/64)] of a chain of tokens (each sees itself and every
    earlier one), built packed: 8 MB, not a dense [T, T], for an 8,000-token prompt."""
    rows = torch.arange(num_tokens, device=device)
    return packed_bit_ranges(torch.zeros_like(rows), rows, num_tokens).unsqueeze(0).expand(batch, -1, -1).contiguous()


def diagonal_mask(batch: int, num_tokens: int, device=None) -> torch.Tensor:
    """Bit-packed mask [batch, T, ceil(T/64)] of T rows each seeing itself only (one draft tree
    layer, its ancestors seen apart)."""
    rows = torch.arange(num_tokens, device=device)
    return packed_bit_ranges(rows, rows, num_tokens).unsqueeze(0).expand(batch, -1, -1)


def check_parents(parents) -> None:
    """What verify_tree checks of a tree: parents [B, T] int64, T >= 1, parents[b, 0] = -1 and
    0 <= parents[b, i] < i (parents precede children). Raises ValueError naming the entry."""
    if not isinstance(parents, torch.Tensor) or parents.dim() != 2 or parents.dtype != torch.int64:
        got = f"{tuple(parents.shape)} {parents.dtype}" if isinstance(parents, torch.Tensor) else type(parents).__name__
        raise ValueError(f"build_tree_mask: parents must be a [B, T] int64 tensor, got {got}")
    B, T = parents.shape
    if T < 1:
        raise ValueError(f"build_tree_mask: a tree has at least its root (parents.shape[1] >= 1), got {tuple(parents.shape)}")
    if parents.device.type == "meta":
        return
    index = torch.arange(T, device=parents.device)
    bad = (parents >= index) | (parents < 0)
    bad[:, 0] = parents[:, 0] != -1
    if bool(bad.any()):
        b, i = (int(x) for x in bad.nonzero()[0])
        want = "-1 (node 0 is the root)" if i == 0 else f"in [0, {i}) (nodes in topological order)"
        raise ValueError(f"build_tree_mask: parents[{b}, {i}] must be {want}, got {int(parents[b, i])}")


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """Pack a bool tensor [..., N] into int64 words [..., ceil(N / 64)] (bit j of word w = bits[64 w + j])."""
    *lead, n = bits.shape
    words = (n + 63) // 64
    padded = torch.nn.functional.pad(bits.to(torch.int64), (0, words * 64 - n))
    # Summing distinct powers of two is an OR; 1 << 63 wraps to int64's minimum, as intended.
    return (padded.view(*lead, words, 64) << _shifts(bits.device)).sum(-1)
