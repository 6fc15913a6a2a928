"""Training examples (a token sequence, its loss mask and the target's features) and their
padding into batches."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence

import torch

from jakiro_ext.models.llama import LlamaModel, as_target


@dataclass
class Example:
    tokens: torch.Tensor  # [n] int64
    features: torch.Tensor  # [n, H] the target's final hidden states (the last row is never used)
    loss_mask: torch.Tensor  # [n] bool: the tokens that are learned (the assistant turns')
    conversation: int = -1  # the source conversation (its turns share prefixes: held out together)
    shard: str = ""  # the corpus shard it came from (where its cached target probabilities go)
    top_probs: Optional["TopProbs"] = None  # [n, k] the target's distributions at its features (cached)


@torch.no_grad()
def target_features(target: LlamaModel, tokens: torch.Tensor) -> torch.Tensor:
    """The target's final hidden states [n, H] of a token sequence (teacher forcing); ``target``: a
    LlamaModel or a transformers model (:func:`~jakiro_ext.models.llama.as_target`)."""
    target = as_target(target)
    cache = target.new_cache(1, tokens.numel())
    _, hidden = target(tokens.unsqueeze(0), cache, last_logits_only=True)
    return hidden[0]


def make_example(target: LlamaModel, tokens: torch.Tensor, loss_mask: Optional[torch.Tensor] = None) -> Example:
    if loss_mask is not None and loss_mask.shape != tokens.shape:
        raise ValueError(f"loss_mask must have the tokens' shape {tuple(tokens.shape)}, got {tuple(loss_mask.shape)}")
    mask = torch.ones_like(tokens, dtype=torch.bool) if loss_mask is None else loss_mask.bool().to(tokens.device)
    return Example(tokens, target_features(target, tokens), mask)


def batch_length(examples: Sequence[Example], max_len: int) -> int:
    return min(max_len, max(ex.tokens.numel() for ex in examples))


@dataclass
class Batch:
    tokens: torch.Tensor  # [B, L], padded with 0
    features: torch.Tensor  # [B, L, H], padded with 0
    loss_mask: torch.Tensor  # [B, L], False on padding
    probs: Optional["TopProbs"] = None  # [B, L, k] the examples' cached target distributions, if all have them

    def to(self, device) -> "Batch":
        probs = None if self.probs is None else TopProbs(self.probs.probs.to(device), self.probs.ids.to(device))
        return Batch(self.tokens.to(device), self.features.to(device), self.loss_mask.to(device), probs)


def collate(examples: Sequence[Example], max_len: int, length: Optional[int] = None) -> Batch:
    """Right-padded batch (causal attention: padding never reaches the real rows), ``length``
    positions long (default: the longest example's, at most ``max_len``)."""
    L = length or batch_length(examples, max_len)
    if L < 4:
        raise ValueError(f"training sequences need at least 4 tokens, the longest here has {L}")
    B, H = len(examples), examples[0].features.shape[-1]
    tokens = torch.zeros(B, L, dtype=torch.int64)
    features = torch.zeros(B, L, H)
    mask = torch.zeros(B, L, dtype=torch.bool)
    cached = all(ex.top_probs is not None for ex in examples)
    if cached:  # (padding: probability 0 on token 0; padded rows are never scored)
        k = examples[0].top_probs.probs.shape[-1]
        probs = TopProbs(torch.zeros(B, L, k), torch.zeros(B, L, k, dtype=torch.int64))
    for b, ex in enumerate(examples):
        n = min(L, ex.tokens.numel())
        tokens[b, :n] = ex.tokens[:n]
        features[b, :n] = ex.features[:n].float()
        mask[b, :n] = ex.loss_mask[:n]
        if cached:
            probs.probs[b, :n] = ex.top_probs.probs[:n].float()
            probs.ids[b, :n] = ex.top_probs.ids[:n]
    return Batch(tokens, features, mask, probs if cached else None)


class TopProbs(NamedTuple):
    probs: torch.Tensor  # [..., k] the target's probabilities of its k most probable draft tokens, renormalised
    ids: torch.Tensor  # [..., k] their draft-vocabulary ids

    def __getitem__(self, index):  # slicing slices both
        if isinstance(index, int):
            return tuple.__getitem__(self, index)
        return TopProbs(self.probs[index], self.ids[index])
