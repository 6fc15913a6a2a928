"""Packed quantized weights: GGML's Q4_0, Q4_1 and Q8_0 blocks (32 weights along K with a float16
scale; Q4_1 also a float16 minimum), their rows interleaved 16 at a time, as the CPU products
read them (``csrc/include/jakiro/quant.h`` has the layout). ``jakiro::linear`` and the decoder
layer ops take such a weight, a uint8 tensor [N / 16, K / 32, 16 B], beside float32 activations;
their activations are quantized per row to 8-bit blocks of 32 as GGML does (:func:`quantize_rows`),
so the products are those of the quantized model, not of its float32 dequantization.

- :func:`pack` makes one from a GGUF file's tensor bytes (GGML's rows of blocks), :func:`unpack`
  gives them back, :func:`select_rows` packs some of its rows, :func:`from_float` quantizes a
  float weight as GGML does; :func:`dequantize` gives the float32 matrix (or some of its rows);
- :func:`quantize_rows` and :func:`linear` are the pure-PyTorch specification of the kernels'
  activations and products (``jakiro_ext.ops.reference.linear`` uses them).
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch

BLOCK = 32  # weights per block, along K
LANES = 16  # rows interleaved in a packed chunk


class Format(NamedTuple):
    block_bytes: int  # a row's block in GGML's format
    code_bits: int  # 4 or 8
    offset: int  # the unsigned codes' offset from the signed values (Q4_1: 0, it has a minimum)
    has_min: bool


FORMATS = {
    "Q4_0": Format(18, 4, 8, False),
    "Q4_1": Format(20, 4, 0, True),
    "Q8_0": Format(34, 8, 128, False),
}


def format_of(packed: torch.Tensor) -> str:
    """The format of a packed weight, from its chunks' length (its last dimension)."""
    for name, f in FORMATS.items():
        if packed.dim() == 3 and packed.dtype == torch.uint8 and packed.shape[2] == LANES * f.block_bytes:
            return name
    raise ValueError(f"a packed quantized weight is uint8 [N / 16, K / 32, 16 B] with 16 B one of "
                     f"{', '.join(f'{LANES * f.block_bytes} ({n})' for n, f in FORMATS.items())}; got "
                     f"{packed.dtype} {tuple(packed.shape)}")


def is_packed(weight: torch.Tensor) -> bool:
    return weight.dtype == torch.uint8


def matrix_shape(weight: torch.Tensor) -> Tuple[int, int]:
    """(N, K) of a weight [N, K] or of a packed one."""
    if is_packed(weight):
        format_of(weight)
        return weight.shape[0] * LANES, weight.shape[1] * BLOCK
    return tuple(weight.shape)


def _check_rows(blocks: torch.Tensor, format: str) -> Format:
    if format not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {format!r}")
    f = FORMATS[format]
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] % f.block_bytes:
        raise ValueError(f"{format} rows are uint8 [N, K / 32 * {f.block_bytes}] (GGML's blocks of a GGUF tensor), "
                         f"got {blocks.dtype} {tuple(blocks.shape)}")
    if blocks.shape[0] % LANES or not blocks.shape[1]:
        raise ValueError(f"a packed weight takes rows 16 at a time and at least one block: N must be a multiple of "
                         f"16 and K of 32, got N = {blocks.shape[0]}, K = {blocks.shape[1] // f.block_bytes * BLOCK}")
    return f


def pack(blocks: torch.Tensor, format: str) -> torch.Tensor:
    """GGML's rows of ``format`` blocks (a GGUF tensor's bytes, uint8 [N, K / 32 * B]) as the
    packed weight [N / 16, K / 32, 16 B] the kernels read: the same bytes, moved (nothing is
    requantized); Q8_0's int8 codes stored plus 128."""
    f = _check_rows(blocks, format)
    N, nb = blocks.shape[0], blocks.shape[1] // f.block_bytes
    rows = blocks.reshape(N // LANES, LANES, nb, f.block_bytes).transpose(1, 2)  # [G, nb, 16, B]
    scales = rows[..., : 4 if f.has_min else 2]
    codes = rows[..., 4 if f.has_min else 2:]
    if f.code_bits == 8:
        codes = codes ^ 0x80  # int8 q as q + 128
    parts = codes.reshape(*codes.shape[:3], -1, 4).transpose(2, 3)  # [G, nb, P, 16, 4]: vector p, lane, byte
    head = [scales[..., 0:2].reshape(*rows.shape[:2], -1)]
    if f.has_min:
        head.append(scales[..., 2:4].reshape(*rows.shape[:2], -1))
    return torch.cat(head + [parts.reshape(*rows.shape[:2], -1)], -1).contiguous()


def from_float(weight: torch.Tensor, format: str) -> torch.Tensor:
    """A float weight [N, K] quantized to ``format`` blocks as GGML quantizes them, packed: how a
    model of one's own runs on the quantized products. Q8_0 here (what drafting quantizes a float
    target's LM-head rows to, at a head's bind), the others with gguf's reference code; the same
    bytes as gguf's (tested)."""
    if format not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {format!r}")
    if weight.dim() != 2 or weight.shape[1] % BLOCK:
        raise ValueError(f"weight must be [N, K] with K a multiple of {BLOCK}, got {tuple(weight.shape)}")
    weight = weight.detach().float().cpu()
    if not torch.isfinite(weight).all():
        raise ValueError(f"a weight to quantize to {format} must be finite; this one has NaN or infinite values")
    if format == "Q8_0":
        return pack(_q8_0_rows(weight), format)
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize
    blocks = quantize(weight.numpy(), GGMLQuantizationType[format])
    return pack(torch.from_numpy(blocks.copy()), format)


def _q8_0_rows(weight: torch.Tensor) -> torch.Tensor:
    """GGML's Q8_0 rows (uint8 [N, K / 32 * 34]) of a finite float32 weight [N, K], as
    ggml-quants.c's reference quantizes: per block d = max |w| / 127 (kept as float16), codes
    w * (1 / d) rounded half away from zero (0 where d is 0)."""
    N, K = weight.shape
    blocks = weight.reshape(N, K // BLOCK, BLOCK)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(d == 0, torch.zeros_like(d), 1 / torch.where(d == 0, torch.ones_like(d), d))
    scaled = blocks * inverse
    magnitude = scaled.abs()
    whole = magnitude.floor()  # (the reference's roundf, exact in float32: whole + floor(2 * fraction))
    codes = (torch.sign(scaled) * (whole + (2 * (magnitude - whole)).floor())).to(torch.int8)
    scales = d.half().view(torch.uint8)  # [N, K / 32, 2]
    return torch.cat([scales, codes.view(torch.uint8)], -1).reshape(N, -1)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """The GGML rows a packed weight was made of (:func:`pack`'s inverse)."""
    f = FORMATS[format_of(packed)]
    G, nb, _ = packed.shape
    scale_bytes = (2 if f.has_min else 1) * 2 * LANES
    scales = packed[..., :scale_bytes].reshape(G, nb, -1, LANES, 2).permute(0, 1, 3, 2, 4).reshape(G, nb, LANES, -1)
    codes = packed[..., scale_bytes:].reshape(G, nb, -1, LANES, 4).transpose(2, 3).reshape(G, nb, LANES, -1)
    if f.code_bits == 8:
        codes = codes ^ 0x80
    rows = torch.cat([scales, codes], -1)  # [G, nb, 16, B]
    return rows.transpose(1, 2).reshape(G * LANES, nb * f.block_bytes).contiguous()


def select_rows(packed: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The packed weight of ``rows`` (int64 indices, a multiple of 16 of them) of a packed weight,
    in their order: the same blocks, moved."""
    if rows.numel() % LANES:
        raise ValueError(f"a packed weight takes rows 16 at a time: got {rows.numel()} rows")
    return pack(unpack(packed)[rows.reshape(-1)], format_of(packed))


def dequantize(packed: torch.Tensor, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The float32 weights [N, K] of a packed weight (GGML's: d (c - offset), or d c + m for Q4_1),
    or only ``rows`` (integer indices of any shape: [*rows.shape, K]; an IndexError outside [0, N)):
    the specification of ``jakiro::dequantize_rows``, which an embedding's lookup runs
    (:func:`jakiro_ext.ops.embedding`)."""
    f = FORMATS[format_of(packed)]
    if rows is not None:
        N, K = matrix_shape(packed)
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= N):
            raise IndexError(f"jakiro::dequantize_rows: rows must be in [0, {N}), got values in "
                             f"[{int(rows.min())}, {int(rows.max())}]")
        flat = rows.reshape(-1).long()
        # The 16-row groups holding the rows (each once), dequantized as a packed weight of their own;
        # each row its group's lane.
        needed, group = torch.unique(flat // LANES, return_inverse=True)
        groups = dequantize(packed[needed]).view(-1, LANES, K)
        return groups[group, flat % LANES].reshape(*rows.shape, K)
    G, nb, C = packed.shape
    d = packed[..., :2 * LANES].contiguous().view(torch.float16).float()  # [G, nb, 16]
    scale_bytes = (2 if f.has_min else 1) * 2 * LANES
    P = (C - scale_bytes) // (4 * LANES)  # the codes' 64-byte vectors
    parts = packed[..., scale_bytes:].reshape(G, nb, P, LANES, 4).transpose(2, 3)  # [G, nb, 16, P, 4]
    if f.code_bits == 8:
        codes = parts.reshape(G, nb, LANES, BLOCK).float()
    else:
        low, high = (parts & 0x0F).reshape(G, nb, LANES, 16), (parts >> 4).reshape(G, nb, LANES, 16)
        codes = torch.cat([low, high], -1).float()
    if f.has_min:
        m = packed[..., 2 * LANES: 4 * LANES].contiguous().view(torch.float16).float()
        w = codes * d.unsqueeze(-1) + m.unsqueeze(-1)
    else:
        w = (codes - f.offset) * d.unsqueeze(-1)
    return w.transpose(1, 2).reshape(G * LANES, nb * BLOCK)  # [G, 16, nb, 32]


def quantize_rows(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernels' quantization of float32 activation rows x [M, K] (K a multiple of 32), as
    GGML's quantize_row_q8_0: per block of 32, d = max |x| / 127, codes round(x / d) (to nearest,
    ties to even), d kept as float16. Returns (codes int8 [M, K], scale float32 [M, K / 32], code
    sums int32 [M, K / 32]); a block with a non-finite value has codes 0 and scale NaN."""
    M, K = x.shape
    blocks = x.float().reshape(M, K // BLOCK, BLOCK)
    finite = torch.isfinite(blocks).all(-1)
    amax = blocks.abs().amax(-1)
    d = amax / 127
    inverse = torch.where(d != 0, 1 / torch.where(d != 0, d, 1), torch.zeros_like(d))
    codes = torch.round(blocks * inverse.unsqueeze(-1))
    codes = torch.where(finite.unsqueeze(-1), codes, torch.zeros_like(codes)).to(torch.int8)
    scale = torch.where(finite, d.half().float(), torch.full_like(d, float("nan")))
    return codes.reshape(M, K), scale, codes.int().sum(-1, dtype=torch.int32)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """y = x @ W.T (+ bias) as the kernels define it: x's rows quantized (:func:`quantize_rows`),
    both dequantized, multiplied in float64, rounded to float32 (the kernels sum the same terms in
    float32, block by block)."""
    K = x.shape[-1]
    codes, scale, _ = quantize_rows(x.reshape(-1, K))
    rows = (codes.double().reshape(-1, K // BLOCK, BLOCK) * scale.double().unsqueeze(-1)).reshape(-1, K)
    y = rows @ dequantize(packed).double().T
    if bias is not None:
        y = y + bias.double()
    return y.float().reshape(*x.shape[:-1], -1)
