"""The frozen target's features of a token corpus, computed once per shard by batched prefill and
cached (bf16, :mod:`.feature_cache`), and the target's top-k distributions the loss reads."""
from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from jakiro_ext import atomic
from jakiro_ext.models.llama import LlamaModel
from jakiro_ext.training.corpus import read_corpus_meta, read_shard, target_fingerprint
from jakiro_ext.training.examples import Example, TopProbs
from jakiro_ext.training.feature_cache import (feature_cache_dir, read_feature_shard, read_token_cache,
                                               save_feature_shard, target_probs_file)
from jakiro_ext.training.loss import target_top_probs


@torch.no_grad()
def prefill_features(target: LlamaModel, sequences, batch_tokens: int = 8192,
                     on_tokens: Optional[Callable[[int], None]] = None,
                     feature_layers: Optional[Sequence[int]] = None) -> List[torch.Tensor]:
    """The target's final hidden states [n, H] of each token sequence (teacher forcing), by
    batched prefill: sequences sorted by length, padded on the right (the causal mask keeps the
    padding out of the real rows) in batches of at most ``batch_tokens`` padded tokens;
    ``on_tokens(n)`` after each batch, n its sequences' tokens (a progress bar's step).
    ``feature_layers``: instead, the residual streams entering those layers, concatenated [n, 3H]
    for three (an EAGLE-3 head's input)."""
    device = target.lm_head.weight.device
    order = sorted(range(len(sequences)), key=lambda i: sequences[i].numel())
    out: List[Optional[torch.Tensor]] = [None] * len(sequences)
    start = 0
    while start < len(order):
        end = start + 1
        while end < len(order) and (end + 1 - start) * sequences[order[end]].numel() <= batch_tokens:
            end += 1
        group = order[start:end]
        longest = sequences[group[-1]].numel()
        tokens = torch.zeros(len(group), longest, dtype=torch.int64)
        for row, i in enumerate(group):
            tokens[row, : sequences[i].numel()] = sequences[i]
        _, hidden = target(tokens.to(device), target.new_cache(len(group), longest), last_logits_only=True,
                           feature_layers=feature_layers)
        for row, i in enumerate(group):
            out[i] = hidden[row, : sequences[i].numel()].cpu()
        if on_tokens is not None:
            on_tokens(sum(sequences[i].numel() for i in group))
        start = end
    return out


def uncached_feature_tokens(corpus_dir, feature_dir=None, shards: Optional[int] = None,
                            dtype: torch.dtype = torch.float32) -> int:
    """How many of a corpus's tokens (of its first ``shards`` shards) have no feature-cache file
    yet (what computing them writes)."""
    feature_dir = Path(feature_dir) if feature_dir is not None else feature_cache_dir(corpus_dir, dtype)
    return sum(s.get("tokens", 0) for s in read_corpus_meta(corpus_dir)["shards"][:shards]
               if not (feature_dir / s["name"].replace(".npz", ".safetensors")).exists())


def corpus_examples(corpus_dir, target: LlamaModel, feature_dir=None, batch_tokens: int = 8192,
                    progress: bool = True, ranks=None, shards: Optional[int] = None,
                    dtype: torch.dtype = torch.float32,
                    feature_layers: Sequence[int] = ()) -> Tuple[List[Example], dict]:
    """Training examples of a token corpus (loss on the answers): the features of each shard from
    the feature cache (``feature_dir``, default :func:`feature_cache_dir`), else recomputed by
    batched prefill and cached. A target other than the corpus's is an error (its features would
    not be those of the answers' model). Returns the examples and the corpus's meta data.
    ``ranks`` (:class:`jakiro_ext.training.distributed.Ranks`, several processes sharing the cache): each process
    first computes the missing features of its share of the shards (every world-th), then all
    read them all. ``shards``: only the corpus's first this many shards (default: all; the meta
    data returned lists those). ``dtype``: what the target computes the features in (bf16: about
    2.3x faster where the CPU multiplies bf16 natively; the fp32 target given is the one checked
    against the corpus, then cast), cached apart from the other dtype's. ``feature_layers``: the
    residual streams entering those layers instead of the final hidden states (cached apart)."""
    from tqdm import tqdm

    meta = read_corpus_meta(corpus_dir)
    if shards is not None:
        if not 1 <= shards <= len(meta["shards"]):
            raise ValueError(f"shards must be in [1, {len(meta['shards'])}] (the corpus's shards), got {shards}")
        meta = dict(meta, shards=meta["shards"][:shards])
    want = meta["settings"]["target_sha256"]
    if target_fingerprint(target) != want:
        raise ValueError(f"{corpus_dir} was generated by another target (weights sha256 {want[:12]}...) than the one "
                         "given: its features would not match the answers")
    feature_dir = Path(feature_dir) if feature_dir is not None else feature_cache_dir(corpus_dir, dtype, feature_layers)
    if dtype != torch.float32 and target.lm_head.weight.dtype != dtype:
        target = copy.deepcopy(target).to(dtype)

    missing = [s for s in meta["shards"] if not (feature_dir / s["name"].replace(".npz", ".safetensors")).exists()]
    if ranks is not None and ranks.world > 1:
        missing = missing[ranks.rank::ranks.world]
    todo = sum(s.get("tokens", 0) for s in missing)
    if progress and todo:
        print(f"the target's features of {len(missing)} corpus shard{'s' if len(missing) > 1 else ''} "
              f"({todo:,} tokens, {todo * target.config.hidden_size * 2 * max(1, len(feature_layers)) / 1e9:.1f} GB "
              f"in {feature_dir}): computed "
              f"once, then read from there (the bar's rate gives the time left)", file=sys.stderr)
    bar = tqdm(total=todo, desc="target features", unit="tok", unit_scale=True, disable=not progress or not todo,
               file=sys.stderr)

    def shard_features(shard):
        sequences = read_shard(Path(corpus_dir) / shard["name"], shard.get("sha256"))
        tokens = torch.cat([q.tokens for q in sequences])
        cached = feature_dir / shard["name"].replace(".npz", ".safetensors")
        features = read_feature_shard(cached, tokens)
        if features is not None:
            return sequences, features
        per_sequence = prefill_features(target, [q.tokens for q in sequences], batch_tokens, bar.update,
                                        tuple(feature_layers) or None)
        save_feature_shard(cached, sequences, per_sequence)
        return sequences, torch.cat(per_sequence).to(torch.bfloat16)

    computed = {shard["name"]: shard_features(shard) for shard in missing}  # (this process's share, with several)
    bar.close()
    if ranks is not None and ranks.world > 1:
        ranks.barrier()
    examples: List[Example] = []
    for shard in meta["shards"]:
        sequences, features = computed.pop(shard["name"], None) or shard_features(shard)
        at = 0
        for q in sequences:
            n = q.tokens.numel()
            examples.append(Example(q.tokens, features[at: at + n], torch.arange(n) >= q.prompt_length, q.conversation,
                                    shard["name"]))
            at += n
    return examples, meta


def attach_target_probs(examples: Sequence[Example], head, k: int, feature_dir=None, progress: bool = True,
                        ranks=None, rows: int = 8192) -> None:
    """Give every example the target's top-``k`` distributions at its features
    (``Example.top_probs``, the token loss's soft labels; :func:`jakiro_ext.training.loss.target_top_probs`),
    computed once instead of at every step: for the examples of a corpus shard, read from the
    cache in ``feature_dir`` (:func:`target_probs_file`) or computed (fp32, ``rows`` at a time)
    and cached; for examples without a shard (or without ``feature_dir``), computed in memory.
    Probabilities are kept in fp16, ids in int16 when the draft vocabulary fits. ``ranks``:
    several processes first compute their share of the shards, then all read them all."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    groups: dict = {}
    for ex in examples:
        groups.setdefault(ex.shard if feature_dir is not None else "", []).append(ex)
    device = head.lm_head_weight.device
    id_dtype = torch.int16 if (head.config.draft_vocab_size or head.config.vocab_size) <= 2**15 else torch.int32

    def compute(group: List[Example]) -> TopProbs:
        features = torch.cat([ex.features for ex in group])
        parts = [target_top_probs(head, features[i: i + rows].to(device).float(), k) for i in range(0, len(features), rows)]
        return TopProbs(torch.cat([p.probs for p in parts]).to("cpu", torch.float16),
                        torch.cat([p.ids for p in parts]).to("cpu", id_dtype))

    def shard_probs(shard: str, group: List[Example]) -> TopProbs:
        tokens = torch.cat([ex.tokens for ex in group]).to(torch.int32)
        if not shard:
            return compute(group)
        path = target_probs_file(Path(feature_dir), shard, head, k)
        stored = read_token_cache(path, tokens, ["probs", "ids"], "target-distribution cache")
        if stored is not None and stored["probs"].shape[1] == k:
            return TopProbs(stored["probs"], stored["ids"])
        probs = compute(group)
        tensors = {"probs": probs.probs, "ids": probs.ids, "tokens": tokens}
        atomic.write_file(path, lambda tmp: save_file(tensors, str(tmp)))
        return probs

    names = sorted(groups)
    if ranks is not None and ranks.world > 1:
        for name in names[ranks.rank::ranks.world]:
            if name:
                shard_probs(name, groups[name])
        ranks.barrier()
    for name in tqdm(names, desc="target probabilities", unit="shard", disable=not progress):
        probs, at = shard_probs(name, groups[name]), 0
        for ex in groups[name]:
            n = ex.tokens.numel()
            ex.top_probs = probs[at: at + n]
            at += n
