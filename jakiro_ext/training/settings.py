"""A training run's settings (``TrainConfig``) and the dtype its products run in."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from jakiro_ext import ops


@dataclass
class TrainConfig:
    epochs: float = 4.0
    steps: int = 0  # > 0: this many steps instead of ``epochs``
    lr: float = 9e-5  # the released recipe's (20 epochs); short runs want more
    betas: tuple = (0.9, 0.95)
    weight_decay: float = 1e-3
    grad_clip: float = 0.5
    warmup_steps: int = 100  # at most a tenth of the run (never under 10 steps)
    batch_sequences: int = 8
    max_seq_len: int = 512  # longer sequences are cut
    w_feature: float = 1.0
    w_token: float = 0.1
    w_feature2: float = 0.5  # the released code's value; the paper states 1.0
    w_token2: float = 0.05
    noise: float = 0.2  # uniform noise of width noise * 512 / seq_len on the input features
    seed: int = 0
    eval_every: int = 0  # steps between evaluations (0: only at the end)
    eval_doublings: int = 0  # > 0: also evaluate when the tokens seen reach this many, twice as many, ... (a scaling curve)
    checkpoint_every: int = 0  # steps between checkpoints (0: none)
    ttt_steps: int = 0  # training-time test: extra steps unrolled on the head's own features (0: off)
    ttt_decay: float = 0.8  # step s's loss weight is ttt_decay ** s
    token_loss_top: int = 32  # the token loss's soft labels: the target's top tokens (renormalised)
    minutes: float = 0.0  # > 0: a wall-clock budget; the steps are set from the first warm-up steps' time
    max_epochs: float = 0.0  # > 0 with a budget in minutes: at most this many epochs (a fast machine's cap)
    # Gumiho's MLP heads learn from "teacher" inputs (both halves from step 0, run on the target's
    # features: the released recipe) or "drafted" ones (the leaf's half from the serial part's
    # own second step, as drafting computes it: the training-time test's idea).
    mlp_input: str = "teacher"
    # "bfloat16": the products in bf16 under autocast (fp32 master weights, optimizer, residual
    # stream, routing and losses); "auto": bf16 on a GPU and on a CPU with native bf16 dot products
    # (AVX512-BF16, AMX), where they run ~2x fp32's rate; fp32 elsewhere, where bf16 only converts.
    compute_dtype: str = "auto"

    def total_steps(self, num_examples: int) -> int:
        if self.minutes:
            return 0  # known after the warm-up steps (train_head)
        return self.steps or max(1, math.ceil(self.epochs * num_examples / self.batch_sequences))


COMPUTE_DTYPES = ("auto", "float32", "bfloat16")


def compute_dtype(name: str, device) -> torch.dtype:
    """The dtype of a training step's products (``TrainConfig.compute_dtype``) on ``device``."""
    if name not in COMPUTE_DTYPES:
        raise ValueError(f"compute_dtype must be one of {COMPUTE_DTYPES}, got {name!r}")
    if name == "auto":
        native = torch.device(device).type == "cuda" or ops.cpu_bf16_dot()
        return torch.bfloat16 if native else torch.float32
    return getattr(torch, name)
