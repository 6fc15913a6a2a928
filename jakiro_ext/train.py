"""Training a draft head on the frozen target's features (EAGLE recipe, Jakiro's two-step loss).

For a token sequence x_0..x_{n-1} the target gives its final hidden states f_0..f_{n-1}. Row i of
the head's input is (x_{i+1}, f_i) and its MoE/dense feature must predict f_{i+1}; a Jakiro head's
contrastive feature at row i must predict f_{i+2}. Loss (EAGLE-2 and Jakiro papers):

    w_feature * SmoothL1(f_moe, f_{i+1}) + w_token * CE(head(f_moe), softmax(head(f_{i+1})))
  + w_feature2 * SmoothL1(f_const, f_{i+2}) + w_token2 * CE(head(f_const), softmax(head(f_{i+2})))

over the positions of a loss mask, with uniform noise on the input features. ``head(.)`` is the
LM head over the draft vocabulary (the target's distribution is renormalised over it).

The step's products run in bf16 under autocast where the CPU multiplies bf16 natively (and on
GPUs), with fp32 master weights, optimizer, residual stream, routing and losses; in fp32
elsewhere (``TrainConfig.compute_dtype``). The soft labels are computed once per example
(:func:`jakiro_ext.trainset.attach_target_probs`) when the examples carry them. Where a step's
time goes: ``benchmarks/bench_train_step.py`` and docs/training.md.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence

import torch
import torch.nn.functional as F

from jakiro_ext import atomic
from jakiro_ext.models.draft_head import DraftHead, DraftStep
from jakiro_ext.models.llama import LlamaModel
from jakiro_ext.profiling import scope


BUDGET_PROBE_STEPS = 10  # with a budget in minutes, the steps are set from these first steps' time


@dataclass(frozen=True)
class Ranks:
    """This process's place in a data-parallel run: rank ``rank`` of ``world`` processes (one
    process: rank 0 of 1, and every collective is the identity); ``device``: where the
    collectives' tensors go (the CPU with gloo, the process's GPU with NCCL)."""
    rank: int = 0
    world: int = 1
    device: str = "cpu"

    def sum(self, values: Sequence[float]) -> List[float]:
        """Each value summed over the processes (float64)."""
        if self.world == 1:
            return [float(v) for v in values]
        import torch.distributed as dist

        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.tolist()

    def max(self, value: float) -> float:
        if self.world == 1:
            return value
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()

    def close(self) -> None:
        """Leave the process group, all processes together (one leaving while another still
        talks to it can end the process with an abort)."""
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()
            dist.destroy_process_group()


def init_distributed(device: str = "cpu") -> Ranks:
    """Join the process group when launched by ``torchrun`` with more than one process
    (``WORLD_SIZE``): gloo for training on the CPU; NCCL on ``device="cuda"``, each process on
    the GPU of its ``LOCAL_RANK``. One process: rank 0 of 1 (on ``device``)."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return Ranks(device=device)
    import torch.distributed as dist

    if device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    return Ranks(dist.get_rank(), dist.get_world_size(), device)


@dataclass
class TrainConfig:
    epochs: float = 4.0
    steps: int = 0  # > 0: this many steps instead of ``epochs``
    lr: float = 9e-5  # the released recipe's (20 epochs); short runs want more
    betas: tuple = (0.9, 0.95)
    weight_decay: float = 1e-3
    grad_clip: float = 0.5
    warmup_steps: int = 100
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
        from jakiro_ext import ops

        native = torch.device(device).type == "cuda" or ops.cpu_bf16_dot()
        return torch.bfloat16 if native else torch.float32
    return getattr(torch, name)


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
    """The target's final hidden states [n, H] of a token sequence (teacher forcing)."""
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


def _branch_loss(head: DraftHead, rows: "Scored", w_feature: float, w_token: float, total: int,
                 lm_head: torch.Tensor):
    """One branch's feature + token loss over the masked rows, and its top-1 hits and count
    (the head's best draft token against the sequence's token). The token loss is the cross
    entropy against the target's distribution of the wanted feature (``rows.want_probs``). The
    losses are sums over these rows divided by ``total``, the rows of the whole (global) batch:
    the per-row means of one process, and their shares when several split a batch. ``lm_head``:
    the LM head's weight in the step's compute dtype; the losses are taken in fp32."""
    mask = rows.mask
    pred, want, next_tokens = rows.pred[mask], rows.want[mask], rows.tokens[mask]
    if pred.shape[0] == 0:
        return pred.sum() * 0.0, 0, 0
    with scope("feature loss"):
        loss = w_feature * F.smooth_l1_loss(pred.float(), want, reduction="sum") / (total * pred.shape[-1])
    with scope("lm head+token loss"):
        logits = (pred.to(lm_head.dtype) @ lm_head.T).float()  # (a bf16 argmax is ~10x slower than fp32's)
        if w_token:  # soft cross entropy against the target's top tokens: -sum p_j log q_j
            probs, ids = rows.want_probs.probs[mask], rows.want_probs.ids[mask]
            ce = -(probs * torch.log_softmax(logits, -1).gather(-1, ids)).sum(-1)  # one fused pass
            loss = loss + w_token * ce.sum() / total
        hits = int((head.target_ids(logits.detach().argmax(-1)) == next_tokens).sum())
    return loss, hits, int(mask.sum())


def unroll(head: DraftHead, batch: Batch, steps: int, features: Optional[torch.Tensor] = None):
    """The head run as drafting runs it, ``steps`` steps deep from every position (the
    training-time test). Yields (s, DraftStep) for s = 0..steps-1: row i of step s has the
    sequence's token x_{i+s+1} and, for s >= 1, the feature step s - 1 predicted for it, and must
    predict f_{i+s+1} (the token x_{i+s+2}); its contrastive feature (Jakiro) f_{i+s+2}.
    ``features``: step 0's input features (default: the batch's, f_0..f_{L-2})."""
    tokens = batch.tokens
    feats = batch.features[:, :-1] if features is None else features
    unrolled: list = []
    step = None
    for s in range(steps):
        if s == 0:
            step = head.train_forward(tokens[:, 1:], feats, unrolled)
        else:  # the rows past the end get token 0; their outputs are never scored
            step = head.train_forward(F.pad(tokens[:, s + 1:], (0, s)), step.feature, unrolled)
        yield s, step


class TopProbs(NamedTuple):
    probs: torch.Tensor  # [..., k] the target's probabilities of its k most probable draft tokens, renormalised
    ids: torch.Tensor  # [..., k] their draft-vocabulary ids

    def __getitem__(self, index):  # slicing slices both
        if isinstance(index, int):
            return tuple.__getitem__(self, index)
        return TopProbs(self.probs[index], self.ids[index])


@torch.no_grad()
def target_top_probs(head: DraftHead, features: torch.Tensor, k: int) -> TopProbs:
    """The target's distribution over the draft vocabulary at each feature, kept to its k most
    probable tokens (renormalised): the token loss's soft labels without [rows, vocabulary]
    tensors in the loss (a peaked distribution loses little mass: 32 tokens keep ~all of it).
    Always in fp32 (they are the labels), also under autocast."""
    with torch.autocast(features.device.type, enabled=False):
        top, ids = (features.float() @ head.lm_head_weight.float().T).topk(k, -1)
    return TopProbs(torch.softmax(top, -1), ids)


class Scored(NamedTuple):
    pred: torch.Tensor  # [B, n, H] the branch's predicted features
    want: torch.Tensor  # [B, n, H] the target's features they should be
    want_probs: Optional[TopProbs]  # [B, n, k] the target's distributions of ``want`` (training only)
    mask: torch.Tensor  # [B, n] the rows that are learned
    tokens: torch.Tensor  # [B, n] the sequence's tokens the rows should draft


def _scored(batch: Batch, step: DraftStep, s: int, ahead: int, probs: Optional[TopProbs] = None) -> Scored:
    """The rows of step s whose target lies ``ahead`` (1: the feature, 2: the contrastive
    feature) tokens past the row's input. ``probs``: the target's distribution at every position."""
    return _rows(batch, step.feature if ahead == 1 else step.contrastive_feature(), s + ahead, probs)


def _rows(batch: Batch, pred: torch.Tensor, shift: int, probs: Optional[TopProbs] = None) -> Scored:
    """Predicted features ``pred`` [B, >= n, H] whose row r must be the target's f_{r+shift}
    (drafting the token x_{r+shift+1}), for the n = L - shift - 1 rows that have one."""
    L = batch.tokens.shape[1]
    n = max(L - shift - 1, 0)
    return Scored(pred[:, :n], batch.features[:, shift: L - 1], None if probs is None else probs[:, shift: L - 1],
                  batch.loss_mask[:, shift + 1:], batch.tokens[:, shift + 1:])


# Gumiho's MLP heads are trained after one serial step: head j's feature lies 3 + j tokens past
# the row's input, and it drafts depth 3 + j of a tree (as drafting with one serial expansion).
MLP_FIRST_DEPTH = 3


def mlp_features(head: DraftHead, batch: Batch, steps: Sequence[DraftStep], mode: str) -> torch.Tensor:
    """The MLP heads' features [B, n, J, H] from the unrolled serial steps (``steps[0]``, and
    ``steps[1]`` for ``mode="drafted"``). Row r's input is ``cat(x_parent, x_leaf)``: x_parent the
    ``fc`` output of the serial step at x_{r+2} (fed step 0's prediction at row r), x_leaf the
    ``fc`` of x_{r+3} with a prediction of f_{r+2}: step 0's at row r + 1, from the target's f_{r+1}
    ("teacher", the released recipe), or step 1's at row r, from the head's own features
    ("drafted", as drafting runs). Head j's feature must be f_{r+3+j}."""
    tokens = batch.tokens
    if mode == "teacher":
        parent = head.project_input(F.pad(tokens[:, 2:], (0, 1)), steps[0].feature, train=True)  # [B, L - 1, H]
        return head.mlp_heads(torch.cat([parent[:, :-1], parent[:, 1:]], -1), train=True)
    if mode == "drafted":
        leaf = head.project_input(F.pad(tokens[:, 3:], (0, 2)), steps[1].feature, train=True)
        return head.mlp_heads(torch.cat([steps[1].projected, leaf], -1), train=True)
    raise ValueError(f"mlp_input must be 'teacher' or 'drafted', got {mode!r}")


def scored_rows(batch: Batch, cfg: TrainConfig, moe: bool, mlp_heads: int = 0) -> Dict[str, int]:
    """How many rows each loss term of ``batch_loss`` scores (``acc{s}``; for a MoE head
    ``acc{s}_contrastive``; for a Gumiho head ``acc{s}_mlp``), known from the batch alone: what
    the terms are divided by."""
    L, rows = batch.tokens.shape[1], {}

    def count(shift: int) -> int:
        return int(batch.loss_mask[:, shift + 1:][:, :max(L - shift - 1, 0)].sum())
    for s in range(1 + cfg.ttt_steps):
        for ahead in ((1, 2) if moe and (cfg.w_feature2 or cfg.w_token2) else (1,)):
            rows[f"acc{s + ahead}" + ("_contrastive" if ahead == 2 else "")] = count(s + ahead)
    for j in range(mlp_heads):
        rows[f"acc{MLP_FIRST_DEPTH + j}_mlp"] = count(MLP_FIRST_DEPTH + j)
    return rows


def batch_loss(head: DraftHead, batch: Batch, cfg: TrainConfig, noise: Optional[torch.Tensor] = None,
               totals: Optional[Dict[str, int]] = None):
    """The training loss of a batch and its metrics: each term's top-1 hits and scored rows
    (``hits_acc1``, ...; with :func:`scored_rows`, the accuracy of each branch at each step). With
    ``cfg.ttt_steps`` the head is unrolled on its own features for that many extra steps, step
    s's loss weighted by ``cfg.ttt_decay ** s`` (EAGLE-3's 0.8). ``noise`` [B, L - 1, H] is added
    to the input features; ``totals``: each term's rows in the whole batch when several processes
    split it (default: this batch's, :func:`scored_rows`)."""
    feats = batch.features[:, :-1]
    if noise is not None:
        feats = feats + noise
    mlp_heads = head.config.num_mlp_heads
    totals = totals or scored_rows(batch, cfg, head.config.num_experts > 0, mlp_heads)
    loss = batch.features.new_zeros(())
    metrics = {}
    probs = batch.probs
    if probs is not None and probs.probs.shape[-1] != cfg.token_loss_top:
        raise ValueError(f"the batch's cached target probabilities keep {probs.probs.shape[-1]} tokens, the recipe "
                         f"{cfg.token_loss_top} (token_loss_top)")
    if probs is None and (cfg.w_token or cfg.w_token2):  # the target's distributions, once for every step and branch
        with scope("target probs"):
            probs = target_top_probs(head, batch.features, cfg.token_loss_top)
    device = batch.features.device.type
    lm_head = head.lm_head_weight  # cast once for every branch and step
    if torch.is_autocast_enabled(device):
        lm_head = lm_head.to(torch.get_autocast_dtype(device))

    def add(name: str, rows: Scored, weight: float, w_feature: float, w_token: float) -> None:
        nonlocal loss
        part, hits, _ = _branch_loss(head, rows, w_feature, w_token, max(totals[name], 1), lm_head)
        loss = loss + weight * part
        metrics[f"hits_{name}"] = hits
    serial = 1 + cfg.ttt_steps
    steps = []
    for s, step in unroll(head, batch, max(serial, 2 if mlp_heads and cfg.mlp_input == "drafted" else 1), feats):
        steps.append(step)
        if s < serial:
            weight = cfg.ttt_decay ** s
            add(f"acc{s + 1}", _scored(batch, step, s, 1, probs), weight, cfg.w_feature, cfg.w_token)
            if step.expert_out is not None and (cfg.w_feature2 or cfg.w_token2):
                add(f"acc{s + 2}_contrastive", _scored(batch, step, s, 2, probs), weight, cfg.w_feature2, cfg.w_token2)
    if mlp_heads:
        with scope("mlp heads"):
            features = mlp_features(head, batch, steps, cfg.mlp_input)
        for j in range(mlp_heads):
            add(f"acc{MLP_FIRST_DEPTH + j}_mlp", _rows(batch, features[:, :, j], MLP_FIRST_DEPTH + j, probs), 1.0,
                cfg.w_feature, cfg.w_token)
    return loss, metrics


def batch_noise(cfg: TrainConfig, step: int, rows: int, length: int, hidden: int) -> Optional[torch.Tensor]:
    """Step ``step``'s uniform noise on the input features of a batch of ``rows`` sequences
    ``length`` long: width cfg.noise * 512 / length, a function of (seed, step) alone."""
    if not cfg.noise:
        return None
    g = torch.Generator().manual_seed(cfg.seed * 7_919 + step)
    return (torch.rand((rows, length - 1, hidden), generator=g) - 0.5) * (cfg.noise * 512 / length)


@torch.no_grad()
def evaluate(head: DraftHead, examples: Sequence[Example], cfg: TrainConfig, batch_sequences: int = 16,
             steps: int = 4, ranks: Ranks = Ranks()) -> Dict[str, float]:
    """Top-1 accuracy of the head's draft token against the sequence's own tokens, on the learned
    positions, drafting from the head's own features as the engine does: ``acc{s}`` for the token
    s steps ahead (s = 1..steps; the tokens fed are the sequence's, so ``acc{s}`` is the accuracy
    at depth s given the path so far was drafted right); ``acc{s+1}_contrastive`` (Jakiro) for
    the contrastive feature of step s, which drafting uses for its parallel last step. With
    several processes each evaluates its share of the examples and the counts are summed."""
    was_training = head.training
    head.eval()
    hits: Dict[str, int] = {}
    counts: Dict[str, int] = {}

    def add(name, rows: Scored):
        pred, tokens = rows.pred[rows.mask], rows.tokens[rows.mask]
        best = head.target_ids((pred @ head.lm_head_weight.T).argmax(-1))
        hits[name] = hits.get(name, 0) + int((best == tokens).sum())
        counts[name] = counts.get(name, 0) + int(tokens.numel())

    mine = list(examples)[ranks.rank::ranks.world]
    device = head.fc.weight.device
    mlp_heads = head.config.num_mlp_heads
    for i in range(0, len(mine), batch_sequences):
        b = collate(mine[i: i + batch_sequences], cfg.max_seq_len).to(device)
        unrolled = []
        for s, step in unroll(head, b, steps):
            unrolled.append(step)
            add(f"acc{s + 1}", _scored(b, step, s, 1))
            if step.expert_out is not None:
                add(f"acc{s + 2}_contrastive", _scored(b, step, s, 2))
        if mlp_heads:  # as drafting runs them: after a serial step on the head's own features
            features = mlp_features(head, b, unrolled, "drafted")
            for j in range(mlp_heads):
                add(f"acc{MLP_FIRST_DEPTH + j}_mlp", _rows(b, features[:, :, j], MLP_FIRST_DEPTH + j))
    head.train(was_training)
    names = [f"acc{s + 1}" for s in range(steps)]
    if head.config.num_experts:
        names += [f"acc{s + 2}_contrastive" for s in range(steps)]
    names += [f"acc{MLP_FIRST_DEPTH + j}_mlp" for j in range(mlp_heads)]
    summed = ranks.sum([hits.get(k, 0) for k in names] + [counts.get(k, 0) for k in names])
    return {k: summed[i] / max(summed[len(names) + i], 1) for i, k in enumerate(names)}


def _batches(examples: Sequence[Example], cfg: TrainConfig, epoch: int) -> List[List[int]]:
    """One epoch's batches, reproducible from (seed, epoch): shuffled, then grouped by length
    within windows of 16 batches to cut padding, then the batches shuffled."""
    g = torch.Generator().manual_seed(cfg.seed * 100_003 + epoch)
    order = torch.randperm(len(examples), generator=g).tolist()
    window = cfg.batch_sequences * 16
    batches = []
    for w in range(0, len(order), window):
        chunk = sorted(order[w : w + window], key=lambda i: examples[i].tokens.numel())
        batches += [chunk[j : j + cfg.batch_sequences] for j in range(0, len(chunk), cfg.batch_sequences)]
    perm = torch.randperm(len(batches), generator=g).tolist()
    return [batches[i] for i in perm]


class _HeadLoss(torch.nn.Module):
    """The head's batch loss as a module's forward, for DistributedDataParallel to wrap."""

    def __init__(self, head: DraftHead):
        super().__init__()
        self.head = head

    def forward(self, batch: Batch, cfg: TrainConfig, noise: Optional[torch.Tensor], totals: Dict[str, int]):
        return batch_loss(self.head, batch, cfg, noise, totals)


def doubling(first: int, tokens: int) -> int:
    """How many times ``first`` has doubled by ``tokens`` (-1 before ``first``; -1 with ``first`` 0)."""
    return int(math.log2(tokens / first)) if first and tokens >= first else -1


def previous_checkpoint(path: Path) -> Path:
    """Where the checkpoint before the last one is kept (``checkpoint.prev.pt``)."""
    return path.with_name(path.stem + ".prev" + path.suffix)


def write_checkpoint(path: Path, state: dict) -> None:
    """Write a training checkpoint atomically, keeping the one it replaces as
    :func:`previous_checkpoint` (a fallback should the newer be damaged later)."""
    if path.exists():  # the previous one, by a hard link: the checkpoint itself stays in place
        atomic.write_file(previous_checkpoint(path), lambda tmp: atomic.link_or_copy(path, tmp))
    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:  # (a file object: a failed write's OSError reaches the error message)
            torch.save(state, f)

    atomic.write_file(path, write)


def read_checkpoint(path: Path) -> dict:
    """A training checkpoint; a damaged one is a ValueError naming it and the way on."""
    try:
        state = torch.load(path, weights_only=False)
        if not isinstance(state, dict) or not {"head", "optimizer", "schedule", "step", "config"} <= set(state):
            raise ValueError("not a training checkpoint of this package")
    except Exception as exc:  # noqa: BLE001 - truncated, flipped or foreign files all end here
        previous = previous_checkpoint(path)
        way = (f"resume from the previous checkpoint (mv {previous} {path}) or delete it to start over"
               if previous.exists() else "delete it to start over")
        reason = (str(exc).splitlines() or [""])[0]
        raise ValueError(f"checkpoint {path} is damaged ({type(exc).__name__}: {reason}): {way}") from None
    return state


def train_head(head: DraftHead, examples: Sequence[Example], cfg: TrainConfig,
               eval_examples: Sequence[Example] = (), checkpoint: Optional[os.PathLike] = None,
               on_step: Optional[Callable[[int, dict], None]] = None, ranks: Ranks = Ranks()) -> List[dict]:
    """Optimise the head's own weights (the target's embedding and LM head stay frozen) with
    AdamW, linear warm-up then cosine decay. Returns the history: one dict per step (loss,
    accuracies, lr, and the evaluation's when one ran).

    ``checkpoint``: a file written every ``cfg.checkpoint_every`` steps (head, optimiser, schedule,
    step, history); when it exists the run resumes from it, bit-exactly (the batch order and the
    noise are functions of the seed and the step).

    ``ranks``: with several processes (:func:`init_distributed`, under torchrun) each takes its
    share of every batch (sequences rank, rank + world, ...), padded to the whole batch's length,
    with its rows of the batch's noise; the loss terms are divided by the whole batch's rows and
    DistributedDataParallel sums the gradients, so the steps are those of one process running the
    same batches (to float rounding), on any number of processes, resumed on any other number.
    Rank 0 writes the checkpoint and calls ``on_step``; every process returns the same history."""
    device = head.fc.weight.device
    dtype = compute_dtype(cfg.compute_dtype, device)
    if cfg.batch_sequences < ranks.world:
        raise ValueError(f"a batch of {cfg.batch_sequences} sequences cannot be shared by {ranks.world} processes "
                         "(batch_sequences >= processes)")
    if head.lm_head_weight is None:
        raise ValueError("bind the head to its target first (head.bind(target))")
    if not examples:
        raise ValueError("no training examples")
    if cfg.mlp_input not in ("teacher", "drafted"):
        raise ValueError(f"mlp_input must be 'teacher' or 'drafted', got {cfg.mlp_input!r}")
    if cfg.ttt_steps < 0 or not cfg.ttt_decay > 0:
        raise ValueError(f"ttt_steps must be >= 0 and ttt_decay > 0, got {cfg.ttt_steps} and {cfg.ttt_decay}")
    if cfg.minutes and cfg.warmup_steps < BUDGET_PROBE_STEPS:
        raise ValueError(f"a budget in minutes needs warmup_steps >= {BUDGET_PROBE_STEPS} (the steps are set from "
                         f"their time, before the schedule depends on them), got {cfg.warmup_steps}")
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    model: torch.nn.Module = _HeadLoss(head)
    if ranks.world > 1:  # (experts no token was routed to get no gradient on some processes)
        model = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    UNSET = 10**9
    total = cfg.total_steps(len(examples)) or UNSET  # a budget in minutes: set after the probe steps

    def schedule(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    history: List[dict] = []
    start = 0
    if checkpoint is not None:
        atomic.remove_stale_temporaries(Path(checkpoint).parent)
    if checkpoint is not None and Path(checkpoint).exists():
        state = read_checkpoint(Path(checkpoint))
        if cfg.minutes:
            total = state["total"]
        if state["config"] != asdict(cfg) or state["total"] != total or state["examples"] != len(examples):
            raise ValueError(f"{checkpoint} was written by a run with other settings or data:\n  there: {state['config']}, "
                             f"{state['examples']} examples\n  asked: {asdict(cfg)}, {len(examples)} examples\n"
                             "resume with the same settings and data, or delete it")
        saved_vocab = state["head"].get("draft_to_target")
        if saved_vocab is not None and not torch.equal(saved_vocab.cpu(), head.draft_to_target.cpu()):
            raise ValueError(f"{checkpoint} was trained with another draft vocabulary than this head's "
                             "(its LM-head rows would not match the ids): resume with the same data, or delete it")
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["schedule"])
        history, start = state["history"], state["step"]
    per_epoch = math.ceil(len(examples) / cfg.batch_sequences)
    epoch_batches, epoch_of = None, -1
    head.train()
    step, t_start = start, time.perf_counter()
    saved = [start]

    def save(at: int) -> None:
        if checkpoint is not None and ranks.rank == 0 and saved[0] != at:
            write_checkpoint(Path(checkpoint), {
                "head": head.state_dict(), "optimizer": opt.state_dict(), "schedule": sched.state_dict(),
                "step": at, "history": history, "config": asdict(cfg), "total": total, "examples": len(examples)})
            saved[0] = at

    try:
        while step < total:
            if cfg.minutes and total == UNSET and step >= BUDGET_PROBE_STEPS and step > start:
                per_step = ranks.max((time.perf_counter() - t_start) / (step - start))  # (one total for all)
                total = step + max(1, int((cfg.minutes * 60 - per_step * step) / per_step))
            epoch = step // per_epoch
            if epoch != epoch_of:
                epoch_batches, epoch_of = _batches(examples, cfg, epoch), epoch
            chosen = [examples[i] for i in epoch_batches[(step % per_epoch) % len(epoch_batches)]]
            length = batch_length(chosen, cfg.max_seq_len)
            seen_before = history[-1].get("tokens_seen", 0) if history else 0
            seen = seen_before + sum(min(ex.tokens.numel(), cfg.max_seq_len) for ex in chosen)  # the whole batch's
            # An epoch's last batch may leave a process without a sequence: it runs the first one
            # with a zero weight, as every process must take part in the gradients' reduction.
            share = list(range(len(chosen)))[ranks.rank::ranks.world]
            idle = not share
            share = share or [0]
            with scope("data"):
                batch = collate([chosen[i] for i in share], cfg.max_seq_len, length).to(device)
                noise = batch_noise(cfg, step, len(chosen), length, batch.features.shape[-1])
            rows = {k: 0 if idle else n for k, n in scored_rows(batch, cfg, head.config.num_experts > 0,
                                                                head.config.num_mlp_heads).items()}
            names = sorted(rows)
            totals = dict(zip(names, (int(n) for n in ranks.sum([rows[k] for k in names]))))
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                loss, metrics = model(batch, cfg, None if noise is None else noise[share].to(batch.features.device),
                                      totals)
            if idle:
                loss, metrics = loss * 0.0, {k: 0 for k in metrics}
            with atomic.signals_held():  # a step is taken whole: an interrupt comes before or after it
                opt.zero_grad()
                with scope("backward"):
                    (loss * ranks.world).backward()  # DDP averages the processes' gradients; the batch's are their sum
                with scope("optimizer"):
                    torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
                    opt.step()
                    sched.step()
                summed = ranks.sum([float(loss.detach())] + [metrics[f"hits_{k}"] for k in names])
                record = {"step": step + 1, "tokens_seen": seen, "loss": summed[0], "lr": opt.param_groups[0]["lr"],
                          **{k: summed[1 + i] / max(totals[k], 1) for i, k in enumerate(names)}}
                history.append(record)
                step += 1
            last = step == total
            if eval_examples and ((cfg.eval_every and step % cfg.eval_every == 0) or last
                                  or doubling(cfg.eval_doublings, seen) > doubling(cfg.eval_doublings, seen_before)):
                record.update({"eval_" + k: v for k, v in evaluate(head, eval_examples, cfg, ranks=ranks).items()})
            if on_step and ranks.rank == 0:
                on_step(step - 1, record)
            if cfg.checkpoint_every and step % cfg.checkpoint_every == 0 or last:
                save(step)
    except KeyboardInterrupt:  # SIGINT, or SIGTERM as the CLI raises it: the steps taken so far are kept
        save(step)
        raise
    head.eval()
    return history
