"""Training a draft head on the frozen target's features: the loss (EAGLE recipe, Jakiro's two-step loss).

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
(:func:`jakiro_ext.training.features.attach_target_probs`) when the examples carry them. Where a step's
time goes: ``benchmarks/bench_train_step.py`` and docs/training.md.
"""
from __future__ import annotations

from typing import Dict, NamedTuple, Optional, Sequence

import torch
import torch.nn.functional as F

from jakiro_ext.models.heads.draft_head import DraftHead
from jakiro_ext.models.heads.eagle3 import Eagle3Head
from jakiro_ext.models.heads.step import DraftStep
from jakiro_ext.profiling import scope
from jakiro_ext.training import eagle3
from jakiro_ext.training.distributed import Ranks
from jakiro_ext.training.head_forward import train_forward
from jakiro_ext.training.examples import Batch, Example, TopProbs, collate
from jakiro_ext.training.settings import TrainConfig


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
    with scope("feature loss"):  # (none for a head whose features are its own: EAGLE-3's)
        loss = (w_feature * F.smooth_l1_loss(pred.float(), want, reduction="sum") / (total * pred.shape[-1])
                if w_feature else pred.new_zeros((), dtype=torch.float32))
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
    layered = reads_layers(head)
    want = (3 if layered else 1) * head.config.hidden_size
    if feats.shape[-1] != want:  # (a head on the target's layers given final hidden states would skip its fuse)
        reads = f"target layers {list(head.feature_layers)}" if layered else "the target's final hidden states"
        raise ValueError(f"the head reads {reads}: step 0's features must be [..., {want}], got [..., {feats.shape[-1]}]")
    unrolled: list = []
    step = None
    forward = eagle3.train_forward if isinstance(head, Eagle3Head) else train_forward
    for s in range(steps):
        if s == 0:
            step = forward(head, tokens[:, 1:], feats, unrolled)
        else:  # the rows past the end get token 0; their outputs are never scored
            step = forward(head, F.pad(tokens[:, s + 1:], (0, s)), step.feature, unrolled)
        yield s, step


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


def scored_step(batch: Batch, step: DraftStep, s: int, ahead: int, probs: Optional[TopProbs] = None) -> Scored:
    """The rows of step s whose target lies ``ahead`` (1: the feature, 2: the contrastive
    feature) tokens past the row's input. ``probs``: the target's distribution at every position."""
    return shifted_rows(batch, step.for_lm_head if ahead == 1 else step.contrastive_feature(), s + ahead, probs)


def shifted_rows(batch: Batch, pred: torch.Tensor, shift: int, probs: Optional[TopProbs] = None) -> Scored:
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
    if reads_layers(head):
        return _token_only_batch_loss(head, batch, cfg, totals)
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
            add(f"acc{s + 1}", scored_step(batch, step, s, 1, probs), weight, cfg.w_feature, cfg.w_token)
            if step.expert_out is not None and (cfg.w_feature2 or cfg.w_token2):
                add(f"acc{s + 2}_contrastive", scored_step(batch, step, s, 2, probs), weight, cfg.w_feature2, cfg.w_token2)
    if mlp_heads:
        with scope("mlp heads"):
            features = mlp_features(head, batch, steps, cfg.mlp_input)
        for j in range(mlp_heads):
            add(f"acc{MLP_FIRST_DEPTH + j}_mlp", shifted_rows(batch, features[:, :, j], MLP_FIRST_DEPTH + j, probs), 1.0,
                cfg.w_feature, cfg.w_token)
    return loss, metrics


def reads_layers(head) -> bool:
    """Whether the head reads the target's layers fused (an EAGLE-3 head, or a fused EAGLE-2 /
    Jakiro head): it trains as EAGLE-3 trains (:func:`_token_only_batch_loss`), its examples'
    features are those layers, not the final hidden states its loss would regress to."""
    return isinstance(head, Eagle3Head) or bool(head.feature_layers)


def _token_only_batch_loss(head, batch: Batch, cfg: TrainConfig, totals: Optional[Dict[str, int]] = None):
    """The loss of a head on EAGLE-3's features (:func:`reads_layers`): the token loss alone at
    every unrolled step (weight ``cfg.ttt_decay ** s``), against the examples' cached labels; a
    Jakiro head's contrastive branch beside it at ``cfg.w_token2 / cfg.w_token`` of that (its
    labels two tokens ahead; ``train`` sets ``w_token`` 1 for these heads); no input noise (the unrolled steps feed it its own errors). An
    EAGLE-3 head's LM head is its own (trained), the others' the target's rows (frozen)."""
    if batch.probs is None:
        raise ValueError("a head on the target's layers learns from the target's distributions: attach them to the "
                         "examples first (jakiro_ext.training.features.attach_target_probs, from the final hidden "
                         "states, with an EAGLE-3 head's LM head still the target's rows)")
    moe = bool(getattr(head.config, "num_experts", 0)) and bool(cfg.w_feature2 or cfg.w_token2)  # (as scored_rows)
    totals = totals or scored_rows(batch, cfg, moe)
    lm_head = head.lm_head.weight if isinstance(head, Eagle3Head) else head.lm_head_weight
    device = batch.features.device.type
    if torch.is_autocast_enabled(device):
        lm_head = lm_head.to(torch.get_autocast_dtype(device))
    loss, metrics = batch.features.new_zeros(()), {}
    branches = ((1, "", 1.0),) + (((2, "_contrastive", cfg.w_token2 / cfg.w_token),) if moe else ())
    for s, step in unroll(head, batch, 1 + cfg.ttt_steps):
        for ahead, suffix, weight in branches:
            name = f"acc{s + ahead}{suffix}"
            part, metrics[f"hits_{name}"], _ = _branch_loss(head, scored_step(batch, step, s, ahead, batch.probs), 0.0,
                                                            1.0, max(totals[name], 1), lm_head)
            loss = loss + cfg.ttt_decay ** s * weight * part
    return loss, metrics


def batch_noise(cfg: TrainConfig, step: int, rows: int, length: int, hidden: int,
                device="cpu") -> Optional[torch.Tensor]:
    """Step ``step``'s uniform noise on the input features of a batch of ``rows`` sequences
    ``length`` long: width cfg.noise * 512 / length, a function of (seed, step, the device's
    kind) alone. Drawn where the batch is: on a GPU, drawing it on the host took a quarter of a
    step (13 ms of a 57 ms EAGLE-2 step of 16 sequences, H200)."""
    if not cfg.noise:
        return None
    g = torch.Generator(device).manual_seed(cfg.seed * 7_919 + step)
    return (torch.rand((rows, length - 1, hidden), generator=g, device=device) - 0.5) * (cfg.noise * 512 / length)


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
    mlp_heads = getattr(head.config, "num_mlp_heads", 0)  # (an EAGLE-3 head's config has none)
    for i in range(0, len(mine), batch_sequences):
        b = collate(mine[i: i + batch_sequences], cfg.max_seq_len).to(device)
        unrolled = []
        for s, step in unroll(head, b, steps):
            unrolled.append(step)
            add(f"acc{s + 1}", scored_step(b, step, s, 1))
            if step.expert_out is not None:
                add(f"acc{s + 2}_contrastive", scored_step(b, step, s, 2))
        if mlp_heads:  # as drafting runs them: after a serial step on the head's own features
            features = mlp_features(head, b, unrolled, "drafted")
            for j in range(mlp_heads):
                add(f"acc{MLP_FIRST_DEPTH + j}_mlp", shifted_rows(b, features[:, :, j], MLP_FIRST_DEPTH + j))
    head.train(was_training)
    names = [f"acc{s + 1}" for s in range(steps)]
    if head.config.num_experts:
        names += [f"acc{s + 2}_contrastive" for s in range(steps)]
    names += [f"acc{MLP_FIRST_DEPTH + j}_mlp" for j in range(mlp_heads)]
    summed = ranks.sum([hits.get(k, 0) for k in names] + [counts.get(k, 0) for k in names])
    return {k: summed[i] / max(summed[len(names) + i], 1) for i, k in enumerate(names)}
