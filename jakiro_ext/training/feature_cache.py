"""The files of the feature cache: a corpus shard's target features (and the target's top-k
distributions over a head's draft vocabulary) stored with the tokens they belong to, so that a
stale or damaged file is detected and recomputed."""
from __future__ import annotations

import hashlib
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch

from jakiro_ext import atomic
from jakiro_ext.paths import cache_root


def feature_cache_dir(corpus_dir, dtype: torch.dtype = torch.float32, layers: Sequence[int] = ()) -> Path:
    """Where the features of a token corpus are cached: $JAKIRO_CACHE/features/<corpus name>-<hash of
    its absolute path> (a cached shard also records its tokens, so a stale one is detected), with
    a ``-bf16`` suffix for features the target computed in bf16 (kept apart from fp32's) and, for
    the residual streams entering some of its layers instead of its final hidden states (an
    EAGLE-3 head's input), ``-l`` and their indices."""
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"features are computed in float32 or bfloat16, got {dtype}")
    corpus_dir = Path(corpus_dir).resolve()
    tag = hashlib.sha256(str(corpus_dir).encode()).hexdigest()[:10]
    suffix = ("-bf16" if dtype == torch.bfloat16 else "") + ("-l" + "-".join(map(str, layers)) if layers else "")
    return cache_root() / "features" / f"{corpus_dir.name}-{tag}{suffix}"


def save_feature_shard(path, sequences, features: Sequence[torch.Tensor]) -> None:
    """The features of a corpus shard's sequences, one row per token (a missing last row is
    stored as zeros: the last token's feature is never used), with the tokens they belong to so
    that a stale cache is detected."""
    from safetensors.torch import save_file

    rows = []
    for q, f in zip(sequences, features):
        n = q.tokens.numel()
        if f.shape[0] == n - 1:
            f = torch.cat([f, f.new_zeros(1, f.shape[1])])
        if f.shape[0] != n:
            raise ValueError(f"a sequence of {n} tokens has {f.shape[0]} feature rows")
        rows.append(f.to("cpu", torch.bfloat16))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {"features": torch.cat(rows), "tokens": torch.cat([q.tokens for q in sequences]).to(torch.int32)}
    atomic.write_file(path, lambda tmp: save_file(tensors, str(tmp)))


def read_token_cache(path: Path, tokens: torch.Tensor, names: Sequence[str], what: str) -> Optional[dict]:
    """The tensors ``names`` of a cache file computed for ``tokens`` (stored with them as
    ``tokens``; each has a row per token); None when the file is missing, holds other tokens' rows,
    or is damaged (said on stderr: a cache is recomputable, and is recomputed)."""
    from safetensors.torch import load_file

    if not path.exists():
        return None
    try:
        stored = load_file(str(path))
        cached_tokens = stored["tokens"].long()
        for name in names:
            if stored[name].dim() != 2 or stored[name].shape[0] != cached_tokens.numel():
                raise ValueError(f"{name}: {stored[name].shape[0]} rows for {cached_tokens.numel()} tokens")
    except Exception as exc:  # noqa: BLE001 - any unreadable cache file is recomputed
        print(f"warning: the {what} file {path} is damaged ({type(exc).__name__}: {exc}); recomputing it",
              file=sys.stderr)
        return None
    return {name: stored[name] for name in names} if torch.equal(cached_tokens, tokens.long()) else None


def read_feature_shard(path: Path, tokens: torch.Tensor) -> Optional[torch.Tensor]:
    """The cached features of a shard's ``tokens`` (:func:`read_token_cache`)."""
    stored = read_token_cache(path, tokens, ["features"], "feature cache")
    return None if stored is None else stored["features"]


def target_probs_file(feature_dir: Path, shard: str, head, k: int) -> Path:
    """Where the target's top-``k`` distributions over ``head``'s draft vocabulary at a shard's
    features are cached: beside its features, named by k and a digest of the draft vocabulary."""
    vocab = head.draft_to_target if head.config.draft_vocab_size else torch.arange(head.config.vocab_size)
    tag = hashlib.sha256(vocab.cpu().to(torch.int64).numpy().tobytes()).hexdigest()[:10]
    return feature_dir / f"{Path(shard).stem}.top{k}-{tag}.safetensors"
