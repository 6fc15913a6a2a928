"""Allocation failures, recognised and reported as a MemoryError that says what was being allocated."""
from __future__ import annotations

import contextlib
import errno
import re

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
