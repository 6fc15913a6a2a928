"""Memory: allocation failures, recognised and reported as a MemoryError that says what was being
allocated; weights placed in huge pages."""
from __future__ import annotations

import contextlib
import errno
import mmap
import os
import re
from pathlib import Path

import torch

_TRIED = re.compile(r"tried to allocate (\d+(?:\.\d+)?) ?(bytes|[KMGT]i?B)")


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is a failed allocation: Python's or numpy's MemoryError, torch's (a
    RuntimeError, torch.OutOfMemoryError on a GPU) or a mapping's ENOMEM."""
    if isinstance(exc, MemoryError):
        return True
    if isinstance(exc, OSError):
        return exc.errno == errno.ENOMEM
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("out of memory" in text.lower() or "can't allocate memory" in text
                                              or "not enough memory" in text)


@contextlib.contextmanager
def memory_errors(what: str):
    """Allocation failures inside as one MemoryError naming ``what`` (and the size the allocator
    asked for, when it said)."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - only allocation failures are translated
        if not is_out_of_memory(exc) or str(exc).startswith("out of memory while "):
            raise
        m = _TRIED.search(str(exc))
        asked = ""
        if m:
            size = float(m[1]) if m[2] == "bytes" else float(m[1]) * 1024 ** (" KMGT".index(m[2][0]))
            asked = f" (an allocation of {size / 2**20:.1f} MiB failed)"
        raise MemoryError(f"out of memory while {what}{asked}") from exc


# ----------------------------------------------------------------------------- huge pages
HUGE_PAGE = 2 << 20


def huge_pages_enabled() -> bool:
    """Whether weights are placed in 2 MiB pages (:func:`move_to_huge_pages`): the kernel offers
    transparent huge pages (``always`` or ``madvise``) and ``JAKIRO_HUGE_PAGES`` is not ``0``."""
    if os.environ.get("JAKIRO_HUGE_PAGES") == "0" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        setting = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False
    return "[never]" not in setting


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """``nbytes`` of zeroed anonymous memory as a uint8 CPU tensor that starts on a 2 MiB boundary,
    the kernel asked (madvise) to back it with transparent huge pages; the mapping lives as long
    as any view of the tensor. Raises OSError where the kernel refuses the advice."""
    with memory_errors(f"mapping {nbytes / 2**20:.1f} MiB for weights in huge pages"):
        m = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(m, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start: start + nbytes]


def _aligned(t: torch.Tensor) -> int:
    """The bytes ``t`` takes in a huge-page buffer: its own, rounded up to 64 (a cache line)."""
    return -(-t.numel() * t.element_size() // 64) * 64


def copy_to_huge_pages(tensors) -> list:
    """Copies of the CPU ``tensors`` in one buffer in huge pages (:func:`huge_page_buffer`, each
    copy 64-byte aligned), in order; None where huge pages are off (:func:`huge_pages_enabled`),
    the kernel refuses the advice or a tensor is not on the CPU."""
    tensors = list(tensors)
    if not huge_pages_enabled() or not tensors or any(t.device.type != "cpu" for t in tensors):
        return None
    sizes = [_aligned(t) for t in tensors]
    try:
        buffer = huge_page_buffer(sum(sizes))
    except OSError:
        return None
    copies, offset = [], 0
    with torch.no_grad():
        for t, size in zip(tensors, sizes):
            view = buffer[offset: offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            view.copy_(t)
            copies.append(view)
            offset += size
    return copies


def in_huge_pages(tensors: list) -> list:
    """The CPU ``tensors`` copied into one huge-page buffer (:func:`copy_to_huge_pages`), or the
    tensors themselves where that is not done."""
    return copy_to_huge_pages(tensors) or tensors


def move_to_huge_pages(module: torch.nn.Module) -> int:
    """Copy the CPU parameters of ``module`` into one buffer in huge pages
    (:func:`copy_to_huge_pages`; each parameter's ``data`` becomes a view of it, tied parameters
    stay tied) and return the bytes moved; 0 where huge pages are off (:func:`huge_pages_enabled`) or
    nothing is on the CPU. Why: decoding streams every weight once a token, and with 4 KiB pages
    that stream misses the TLB every 4 KiB; a 2-core Xeon summed 425 MB at 26-28 GB/s from 4 KiB
    pages and at 32-33 GB/s from 2 MiB pages (docs/benchmarks.md)."""
    groups: dict = {}  # one copy per distinct tensor (a tied LM head and embedding share one)
    for p in module.parameters():
        if p.device.type == "cpu" and p.numel() > 0:
            groups.setdefault((p.data_ptr(), p.dtype, tuple(p.shape), tuple(p.stride())), []).append(p)
    copies = copy_to_huge_pages(ps[0].data for ps in groups.values())
    if copies is None:
        return 0
    for ps, view in zip(groups.values(), copies):
        for p in ps:
            p.data = view
    return sum(_aligned(v) for v in copies)
