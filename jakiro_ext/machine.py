"""The machine a measurement ran on, by name (results and cached costs are keyed by it)."""
from __future__ import annotations

import functools
import platform
from pathlib import Path


@functools.lru_cache(maxsize=None)
def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what platform knows (read once: every call
    that chooses a tree names its cost file by it)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
