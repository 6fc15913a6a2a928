"""Which kernels the ops run (:func:`use_backend`): the compiled library's for the tensors' device,
or the GPU kernels under the CPU SIMT emulator; the reference ops when asked for
(``JAKIRO_USE_REFERENCE=1``) without a library. Helpers the op families share: the kernel of an op
here (:func:`kernel`), the fakes' device check, a host tensor's copy to a device."""
from __future__ import annotations

import contextlib
import contextvars

import torch

from jakiro_ext.ops import emulator, reference
from jakiro_ext.ops.library import LOAD_ERROR, USE_REFERENCE

BACKENDS = ("native", "simt32", "simt64")
_emulated = contextvars.ContextVar("jakiro_emulated_backend", default=None)  # (name, op namespace)


@contextlib.contextmanager
def use_backend(name: str):
    """Within the block, every op of the package (and so the models and ``speculative_generate``)
    runs on the given backend: ``"native"`` the compiled library's kernels for the tensors' device
    (the default), ``"simt32"`` / ``"simt64"`` the GPU kernels of ``csrc/cuda`` run on the CPU by
    the SIMT emulator with warps of 32 / 64 lanes (CPU tensors; slow, for checking and debugging GPU
    kernels without a GPU). The emulated library is built the first time (a few minutes, cached:
    :mod:`jakiro_ext.ops.emulator`). Blocks nest; the setting is per thread and per asyncio task."""
    if name not in BACKENDS:
        raise ValueError(f"use_backend: the backend must be one of {BACKENDS}, got {name!r}")
    if name == "native":
        token = _emulated.set(None)
    else:
        token = _emulated.set((name, emulator.emulated_ops(int(name.removeprefix("simt")))))
    try:
        yield
    finally:
        _emulated.reset(token)


def backend() -> str:
    """The backend the ops run on here (see :func:`use_backend`)."""
    chosen = _emulated.get()
    return "native" if chosen is None else chosen[0]


def kernel(name: str):
    """The function that runs op ``name`` on this backend (:func:`use_backend`)."""
    chosen = _emulated.get()
    if chosen is not None:
        return getattr(chosen[1], name)
    if LOAD_ERROR is None:
        return getattr(torch.ops.jakiro, name)
    if USE_REFERENCE:
        return getattr(reference, name)
    raise RuntimeError(f"{LOAD_ERROR}. Set JAKIRO_USE_REFERENCE=1 to run the pure-PyTorch reference ops instead.")


def same_device(op: str, **tensors) -> None:
    """The kernels' device check, for the fakes: a meta tensor among CPU ones dispatches here
    (Meta outranks CPU), and must be an error, not an uninitialised CPU result."""
    given = {name: t.device for name, t in tensors.items() if isinstance(t, torch.Tensor)}
    if len(set(given.values())) > 1:
        listed = ", ".join(f"{name} on {device}" for name, device in given.items())
        raise RuntimeError(f"jakiro::{op}: every tensor must be on one device, got {listed}")



def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on ``device`` without stalling the host: on a GPU through pinned memory,
    asynchronously (a plain copy from pageable memory waits for the device's queue to drain)."""
    device = torch.device(device)
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)
