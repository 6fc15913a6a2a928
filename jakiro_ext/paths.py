"""Where the package keeps what it computes once and reuses ($JAKIRO_CACHE, else
~/.cache/jakiro_ext), and where it finds the token corpora it ships."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Dict, Optional, Tuple, TypeVar

T = TypeVar("T")


def cache_root() -> Path:
    """Where dequantized models are kept: $JAKIRO_CACHE, else ~/.cache/jakiro_ext."""
    return Path(os.environ.get("JAKIRO_CACHE", Path.home() / ".cache" / "jakiro_ext"))


_PARSED: Dict[Tuple[Path, Callable], Tuple[str, object]] = {}  # (path, parse) -> (its text, what parse made of it)


def parsed_once(path: Path, parse: Callable[[str], T]) -> T:
    """``parse(text)`` of the cache file at ``path``, made again only when its text changed (a
    file every new head's first call reads: the text read, its parsing and checking skipped).
    ``parse`` raises what it raises; nothing is kept then."""
    text = path.read_text()
    known = _PARSED.get((path, parse))
    if known is None or known[0] != text:
        known = _PARSED[path, parse] = (text, parse(text))
    return known[1]


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
