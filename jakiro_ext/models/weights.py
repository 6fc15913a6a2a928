"""What a model's forwards read of its weights: :class:`TargetWeights` (prepared once for a call's
forwards), and on the CPU the bf16 copies of a bf16 checkpoint's weights read in their place
(:func:`bf16_weights_enabled`, :func:`exactly_bf16`)."""
from __future__ import annotations

import os
from typing import NamedTuple, Optional

import torch

from jakiro_ext import ops

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
