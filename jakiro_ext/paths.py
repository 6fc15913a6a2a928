"""Where the package keeps what it computes once and reuses: $JAKIRO_CACHE, else ~/.cache/jakiro_ext."""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """Where dequantized models are kept: $JAKIRO_CACHE, else ~/.cache/jakiro_ext."""
    return Path(os.environ.get("JAKIRO_CACHE", Path.home() / ".cache" / "jakiro_ext"))
