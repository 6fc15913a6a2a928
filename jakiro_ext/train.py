"""Training a draft head on the frozen target's features (EAGLE recipe, Jakiro's two-step loss).

For a token sequence x_0..x_{n-1} the target gives its final hidden states f_0..f_{n-1}. Row i of
the head's input is (x_{i+1}, f_i) and its MoE/dense feature must predict f_{i+1}; a Jakiro head's
contrastive feature at row i must predict f_{i+2}. Loss (ALGORITHM.md section 2):

    w_feature * SmoothL1(f_moe, f_{i+1}) + w_token * CE(head(f_moe), softmax(head(f_{i+1})))
  + w_feature2 * SmoothL1(f_const, f_{i+2}) + w_token2 * CE(head(f_const), softmax(head(f_{i+2})))

over the positions of a loss mask, with uniform noise on the input features.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import torch
import torch.nn.functional as F

from jakiro_ext.models.draft_head import DraftHead
from jakiro_ext.models.llama import LlamaModel


@dataclass
class TrainConfig:
    steps: int = 1000
    lr: float = 9e-5
    betas: tuple = (0.9, 0.95)
    weight_decay: float = 1e-3
    grad_clip: float = 0.5
    warmup_steps: int = 100
    sequences_per_step: int = 4
    w_feature: float = 1.0
    w_token: float = 0.1
    w_feature2: float = 0.5  # the released code's value; the paper states 1.0
    w_token2: float = 0.05
    noise: float = 0.2  # uniform noise of width noise * 512 / seq_len on the input features
    seed: int = 0


@dataclass
class Example:
    tokens: torch.Tensor  # [n] int64
    features: torch.Tensor  # [n, H] the target's final hidden states
    loss_mask: torch.Tensor  # [n] bool: the tokens that are learned (the assistant turns')


@torch.no_grad()
def target_features(target: LlamaModel, tokens: torch.Tensor) -> torch.Tensor:
    """The target's final hidden states [n, H] of a token sequence (teacher forcing)."""
    cache = target.new_cache(1, tokens.numel())
    _, hidden = target(tokens.unsqueeze(0), cache, last_logits_only=True)
    return hidden[0]


def make_example(target: LlamaModel, tokens: torch.Tensor, loss_mask: Optional[torch.Tensor] = None) -> Example:
    if loss_mask is not None and loss_mask.shape != tokens.shape:
        raise ValueError(f"loss_mask must have the tokens' shape {tuple(tokens.shape)}, got {tuple(loss_mask.shape)}")
    mask = torch.ones_like(tokens, dtype=torch.bool) if loss_mask is None else loss_mask.bool().to(tokens.device)
    return Example(tokens, target_features(target, tokens), mask)


def example_loss(head: DraftHead, ex: Example, cfg: TrainConfig, generator: torch.Generator) -> torch.Tensor:
    n = ex.tokens.numel()
    if n < 3:
        raise ValueError(f"a training sequence needs at least 3 tokens, got {n}")
    feats = ex.features[:-1].float()
    noise = (torch.rand(feats.shape, generator=generator) - 0.5) * cfg.noise * 512 / n  # CPU generator: reproducible
    step = head.train_forward(ex.tokens[1:].unsqueeze(0), (feats + noise.to(feats.device)).unsqueeze(0))
    lm_head = head.lm_head_weight.float()
    # Row i predicts f_{i+1}, learned where the token x_{i+2} it leads to is in the mask.
    mask1 = ex.loss_mask[2:].float()
    pred1, want1 = step.feature[0, : n - 2].float(), ex.features[1 : n - 1].float()
    loss = cfg.w_feature * _masked_mean(F.smooth_l1_loss(pred1, want1, reduction="none").mean(-1), mask1)
    if cfg.w_token:
        loss = loss + cfg.w_token * _masked_mean(_soft_ce(pred1 @ lm_head.T, want1 @ lm_head.T), mask1)
    if step.expert_out is not None and (cfg.w_feature2 or cfg.w_token2) and n > 3:
        mask2 = ex.loss_mask[3:].float()
        pred2, want2 = step.contrastive_feature()[0, : n - 3].float(), ex.features[2 : n - 1].float()
        loss = loss + cfg.w_feature2 * _masked_mean(F.smooth_l1_loss(pred2, want2, reduction="none").mean(-1), mask2)
        if cfg.w_token2:
            loss = loss + cfg.w_token2 * _masked_mean(_soft_ce(pred2 @ lm_head.T, want2 @ lm_head.T), mask2)
    return loss


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / mask.sum().clamp_min(1.0)


def _soft_ce(logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    return -(torch.softmax(target_logits, -1) * torch.log_softmax(logits, -1)).sum(-1)


def train_head(head: DraftHead, examples: Sequence[Example], cfg: TrainConfig,
               on_step: Optional[Callable[[int, float], None]] = None) -> List[float]:
    """Optimise the head's own weights (the target's embedding and LM head stay frozen) with
    AdamW, linear warm-up then cosine decay. Returns the loss of every step."""
    if head.lm_head_weight is None:
        raise ValueError("bind the head to its target first (head.bind(target))")
    generator = torch.Generator().manual_seed(cfg.seed)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)

    def schedule(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    losses = []
    head.train()
    for step in range(cfg.steps):
        picks = torch.randint(len(examples), (cfg.sequences_per_step,), generator=generator).tolist()
        loss = sum(example_loss(head, examples[i], cfg, generator) for i in picks) / len(picks)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        if on_step:
            on_step(step, losses[-1])
    head.eval()
    return losses
