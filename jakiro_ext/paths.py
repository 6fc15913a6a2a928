"""Where the package keeps what it computes once and reuses ($JAKIRO_CACHE, else
~/.cache/jakiro_ext), and where it finds the token corpora it ships."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional


def cache_root() -> Path:
    """Where dequantized models are kept: $JAKIRO_CACHE, else ~/.cache/jakiro_ext."""
    return Path(os.environ.get("JAKIRO_CACHE", Path.home() / ".cache" / "jakiro_ext"))


def packaged_corpus(name: str) -> Optional[Path]:
    """The committed token corpus called ``name`` (the default model's: ``SmolLM2-135M-Instruct``):
    installed with the package (``jakiro_ext/corpus/``), or in the clone beside the source tree
    (``corpus/``); None if there is none."""
    package = Path(__file__).resolve().parent
    if not name or "/" in name or name in (".", ".."):
        return None
    for root in (package / "corpus", package.parent / "corpus"):
        if (root / name / "corpus.json").is_file():
            return root / name
    return None
