"""What a model's forwards read of its weights: :class:`TargetWeights` (prepared once for a call's
forwards), on the CPU the bf16 copies of a bf16 checkpoint's weights read in their place
(:func:`bf16_weights_enabled`, :func:`exactly_bf16`), and the dtype of a model's KV cache
(:func:`cache_dtype`)."""
from __future__ import annotations

import os
from typing import NamedTuple, Optional

import torch

from jakiro_ext import ops
from jakiro_ext.ops import quantized

class TargetWeights(NamedTuple):
    """What a forward reads of a model's weights (:meth:`LlamaModel.prepare`): ``jakiro::
    decoder_layers``' lists over the parameters (``lists``), and where the model streams bf16
    copies (:meth:`LlamaModel.streamed_weights`) those copies (``streamed``: per layer, then the
    LM head) and the lists over them (``streamed_lists``; both None otherwise). Prepared once by
    a caller that runs many forwards (the engine: once per call; walking the modules each forward
    cost 0.35 ms of a 9 ms decoding step, their objects out of the caches after the forward's
    weight stream); the lists hold the parameters themselves, so a change in place is read, a
    parameter replaced after it is not."""
    lists: tuple
    streamed: Optional[list]
    streamed_lists: Optional[tuple]

# Rows up to which jakiro::linear and jakiro::decoder_layer stream the weights (csrc/ops.h,
# kLinearStreamRows); more go to BLAS, which reads the float32 parameters.
STREAM_ROWS = 64


def bf16_weights_enabled() -> bool:
    """Whether a float32 model on the CPU reads a bf16 checkpoint's weights as bf16 copies
    (:meth:`LlamaModel.streamed_weights`): the CPU kernels run the ops (not the GPU kernels'
    emulation, :func:`jakiro_ext.ops.use_backend`, which reads one dtype) and
    ``JAKIRO_CPU_BF16_WEIGHTS`` is not ``0``."""
    return os.environ.get("JAKIRO_CPU_BF16_WEIGHTS") != "0" and ops.backend() == "native"


def exactly_bf16(t: torch.Tensor) -> bool:
    """Whether ``t`` is a contiguous float32 CPU tensor whose every value is a bf16 value (its low
    16 bits zero): what a bf16 copy holds bit for bit."""
    return t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() and \
        not bool((t.detach().view(torch.int32) & 0xFFFF).any())


def weight_format(model) -> str:
    """What a model's forwards read of its weights: their dtype's name (float32, bfloat16), or a
    GGUF file's block formats, the layers' then the LM head's (``Q4_1-Q8_0``)."""
    qkv = model.layers[0].self_attn.qkv_proj.weight
    if not quantized.is_packed(qkv):
        return str(qkv.dtype).replace("torch.", "")
    head = model.lm_head.weight
    return "-".join((quantized.format_of(qkv), quantized.format_of(head) if quantized.is_packed(head)
                     else str(head.dtype).replace("torch.", "")))


def cache_dtype(activations: torch.dtype, weight: torch.Tensor) -> torch.dtype:
    """The KV cache's dtype for a model of these activations and a projection ``weight`` of it: the
    activations', but beside a GGUF file's packed quantized weights on the CPU bf16 (the CPU
    kernels take it beside float32 rows: every row's attention reads half the bytes, which is most
    of what a row costs beside 4-bit products after a few hundred tokens; llama.cpp's cache is
    f16). Keys and values are rounded to bf16 as they are written: the quantized target as this
    engine runs it, its plain decoding and its speculation alike. ``JAKIRO_CPU_BF16_CACHE=0`` keeps
    float32 (the GPU kernels' emulation, :func:`jakiro_ext.ops.use_backend`, takes one dtype)."""
    if (quantized.is_packed(weight) and weight.device.type == "cpu" and activations == torch.float32
            and ops.backend() == "native" and os.environ.get("JAKIRO_CPU_BF16_CACHE") != "0"):
        return torch.bfloat16
    return activations
