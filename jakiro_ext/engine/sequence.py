"""One prompt in flight (``DecodeSequence``): its settings, draws, emitted tokens and statistics, and
what a finished generation returns (``GenerationOutput``, ``GenerationStats``)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import torch


@dataclass
class GenerationStats:
    new_tokens: int = 0
    target_forwards: int = 0  # every target forward, the prompt's included
    draft_forwards: int = 0
    accept_lengths: List[int] = field(default_factory=list)  # drafted tokens accepted, per round
    # Rounds that drafted nothing (plain decoding): every round of "ar"; with a head, the rounds
    # where the tree chosen live was none (speculation did not pay on this machine, then).
    plain_rounds: int = 0
    prefill_s: float = 0.0
    wall_time_s: float = 0.0
    # "eos", "max_new_tokens", "context_limit" (the target's max_position_embeddings came before
    # max_new_tokens) or "cache_full" (a user-given max_cache_len ran out)
    stop_reason: str = ""

    @property
    def tau(self) -> float:
        """Tokens per target forward, counting every forward."""
        return self.new_tokens / max(self.target_forwards, 1)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_time_s if self.wall_time_s > 0 else 0.0

    @property
    def accept_histogram(self) -> List[int]:
        """Rounds that accepted 0, 1, 2, ... drafted tokens."""
        hist = [0] * (max(self.accept_lengths, default=0) + 1)
        for n in self.accept_lengths:
            hist[n] += 1
        return hist

    def as_dict(self) -> dict:
        return dict(new_tokens=self.new_tokens, target_forwards=self.target_forwards,
                    draft_forwards=self.draft_forwards, tau=self.tau, tokens_per_s=self.tokens_per_s,
                    wall_time_s=self.wall_time_s, prefill_s=self.prefill_s,
                    accept_histogram=self.accept_histogram, plain_rounds=self.plain_rounds,
                    stop_reason=self.stop_reason)


@dataclass
class GenerationOutput:
    token_ids: List[int]  # the generated tokens (EOS included when it ended the generation)
    stats: GenerationStats
    # generate_many(keep_features=True): the target's final hidden states of the prompt and the
    # generated tokens but the last, [n + len(token_ids) - 1, H] (a training set's features)
    features: Optional[torch.Tensor] = None


# ----------------------------------------------------------------------------- the loop
@dataclass
class DecodeSettings:
    """What every sequence of a call shares."""
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    eos: set
    seed: int
    max_cache_len: Optional[int]
    keep_features: bool = False
    graphs: str = "eager"


class DecodeSequence:
    """One prompt in flight: what it emitted, its statistics and its own random draws (seeded
    with the call's seed plus its index, so it samples the same alone or in any batch)."""

    def __init__(self, index: int, ids: torch.Tensor, s: DecodeSettings, limit: Optional[int], tree_nodes: int,
                 on_tokens: Optional[Callable[[List[int]], None]]):
        n = ids.numel()
        name = "the prompt" if index == 0 else f"prompt {index}"
        check_room(name, n, limit)
        self.budget = s.max_new_tokens if limit is None else min(s.max_new_tokens, limit - n)  # new tokens at positions < limit
        self.bound = n + self.budget + tree_nodes  # the most its KV cache rows can hold: committed tokens + one tree
        if s.max_cache_len is not None:
            if n + tree_nodes > s.max_cache_len:
                raise ValueError(f"{name} has {n} tokens; with a {tree_nodes}-node tree it needs a KV cache of at "
                                 f"least {n + tree_nodes} positions, but the cache holds {s.max_cache_len} (max_cache_len)")
            self.bound = min(self.bound, s.max_cache_len)
        self.index, self.ids, self.settings, self.on_tokens = index, ids, s, on_tokens
        self.generator = torch.Generator(device="cpu").manual_seed((s.seed + index) % 2**63)
        self.out: List[int] = []
        self.features: List[torch.Tensor] = []
        self.stats = GenerationStats()
        self.root = -1
        self.t0 = 0.0

    @property
    def done(self) -> bool:
        return bool(self.stats.stop_reason)

    def draws(self, count: int) -> torch.Tensor:
        return torch.rand(1, count, dtype=torch.float64, generator=self.generator)

    def emit(self, tokens: List[int]) -> None:
        """Append tokens up to EOS / the budget (then the sequence is done)."""
        s = self.settings
        for i, t in enumerate(tokens):
            if t in s.eos or len(self.out) + i + 1 == self.budget:
                tokens = tokens[: i + 1]
                self.stats.stop_reason = ("eos" if t in s.eos else "max_new_tokens" if self.budget == s.max_new_tokens
                                          else "context_limit")
                break
        self.out.extend(tokens)
        if self.on_tokens:
            self.on_tokens(tokens)

    def output(self) -> GenerationOutput:
        self.stats.wall_time_s = time.perf_counter() - self.t0
        self.stats.new_tokens = len(self.out)
        features = None
        if self.settings.keep_features:
            features = torch.cat(self.features)[: self.ids.numel() + len(self.out) - 1]
        return GenerationOutput(self.out, self.stats, features)


def check_room(name: str, n: int, limit: Optional[int]) -> None:
    """A prompt of ``n`` tokens leaves room for a new one in a context of ``limit`` positions (None: no limit)."""
    if limit is not None and n >= limit:
        raise ValueError(f"{name} has {n} tokens, but the target's context holds {limit} positions "
                         f"(max_position_embeddings): no room for a new token")


def no_distribution_error() -> RuntimeError:
    return RuntimeError("the target's logits are not finite (NaN or inf): verification cannot choose a token "
                        "(check the model's weights and dtype)")
