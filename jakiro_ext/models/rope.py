"""Rotary position embeddings (RoPE) as the Llama-family checkpoints apply them: the inverse
frequencies (with Llama 3's scaling), cos and sin at positions, a table of them kept per model
(:class:`RopeTable`), and the rotate-half rotation."""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

# Llama 3's RoPE frequency scaling: the numbers its config gives.
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def rope_inv_freq(head_dim: int, theta: float, scaling: Optional[dict], device) -> torch.Tensor:
    """The rotary frequencies [D/2] (float32), with Llama 3's scaling when given: wavelengths
    beyond original_max_position_embeddings / low_freq_factor are stretched by ``factor``, those
    below original_max_position_embeddings / high_freq_factor kept, those between interpolated
    (transformers' ``_compute_llama3_parameters``, the same float32 arithmetic)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    factor, low, high, old = (scaling[k] for k in LLAMA3_ROPE_KEYS)
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old / low, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) * ~(wavelen > old / low)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype,
                 scaling: Optional[dict] = None):
    """cos and sin [B, T, 1, D] of the rotary angles at integer positions [B, T], computed in
    float32 as the checkpoints' reference code does, then cast to the model's dtype."""
    inv_freq = rope_inv_freq(head_dim, theta, scaling, positions.device)
    angles = positions.float().unsqueeze(-1) * inv_freq  # [B, T, D/2]
    cos, sin = angles.cos(), angles.sin()
    return torch.cat([cos, cos], -1).to(dtype).unsqueeze(2), torch.cat([sin, sin], -1).to(dtype).unsqueeze(2)


class RopeTable:
    """cos and sin at integer positions, gathered from tables of :func:`rope_cos_sin` over
    [0, capacity) made once (and again for a larger capacity, another dtype or device): two row
    selections per forward instead of ten ops, the same values, each contiguous as the kernels
    read them (in a decoding step, after the weights' stream, 36 us against 55 for one indexing
    of a [capacity, 2, D] table and its halves' strided views, on the 2-core Xeon)."""

    def __init__(self, head_dim: int, theta: float, scaling: Optional[dict] = None):
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling
        self.cos: Optional[torch.Tensor] = None  # [capacity, D]
        self.sin: Optional[torch.Tensor] = None

    def __call__(self, positions: torch.Tensor, capacity: int, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, T, D] at positions [B, T] (each < capacity)."""
        kept = self.cos
        if kept is None or kept.shape[0] < capacity or kept.dtype != dtype or kept.device != positions.device:
            cos, sin = rope_cos_sin(torch.arange(capacity, device=positions.device).unsqueeze(0), self.head_dim,
                                    self.theta, dtype, self.scaling)  # [1, capacity, 1, D]
            self.cos, self.sin = cos[0, :, 0].contiguous(), sin[0, :, 0].contiguous()
        flat = positions.reshape(-1)
        return (self.cos.index_select(0, flat).view(*positions.shape, self.head_dim),
                self.sin.index_select(0, flat).view(*positions.shape, self.head_dim))


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in the rotate-half layout of the Hugging Face checkpoints. x [B, T, H, D]; cos, sin [B, T, 1, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
