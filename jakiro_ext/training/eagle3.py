"""Training an EAGLE-3 head (:class:`~jakiro_ext.models.heads.eagle3.Eagle3Head`), as EAGLE-3 trains
one: step 0 reads the target's low, middle and high layers fused (``fc: 3H -> H``), every later
step its own output (the training-time test: each step's input is what drafting would feed it),
and the loss is the token loss alone (no feature regression: the head's hidden state is its own,
not the target's), step s weighted by ``ttt_decay ** s``. Its LM head is its own, over the draft
vocabulary, started from the target's rows; the soft labels are the target's distribution over
that vocabulary (from the target's final hidden states, through the target's own rows).

An example's ``features`` are the three layers' residual streams [n, 3H] (``layer_features``);
its ``top_probs`` the labels, computed from the final hidden states before they are replaced.
"""
from __future__ import annotations

from typing import Dict, Sequence

import torch
import torch.nn.functional as F

from jakiro_ext.models.heads.eagle3 import Eagle3Head
from jakiro_ext.models.heads.step import DraftStep
from jakiro_ext.models.rope import rope_cos_sin, rotary
from jakiro_ext.ops import quantized
from jakiro_ext.profiling import scope
from jakiro_ext.training.distributed import Ranks
from jakiro_ext.training.examples import Batch, Example, TopProbs, collate
from jakiro_ext.training.head_forward import unrolled_attention
from jakiro_ext.training.settings import TrainConfig


def train_forward(head: Eagle3Head, tokens: torch.Tensor, features: torch.Tensor, unrolled: list) -> DraftStep:
    """The differentiable counterpart of :meth:`Eagle3Head.forward`: tokens [B, T] (token t + 1 of
    each row), features [B, T, 3H] (the target's three layers at t; step 0) or [B, T, H] (the
    previous step's outputs). ``unrolled`` collects each step's keys and values: the call made
    with it empty is step 0 (causal over the sequence), the call made with s entries step s
    (row i at position i + s, seeing step 0's rows 0..i and its own row of steps 1..s), as in
    :func:`jakiro_ext.training.head_forward.train_forward`."""
    c = head.config
    B, T = tokens.shape
    step = len(unrolled)
    h = features.to(head.fc.weight.dtype)
    if h.shape[-1] == 3 * c.hidden_size:
        h = head.fc(h)
    x = torch.cat([head.input_layernorm(quantized.embedding(head.embed_weight, tokens).to(h.dtype)),
                   head.hidden_norm(h)], -1)
    positions = torch.arange(step, T + step, device=tokens.device).unsqueeze(0)
    cos, sin = rope_cos_sin(positions, c.head_dim, c.rope_theta, x.dtype)
    with scope("attention"):
        q = rotary(head.q_proj(x).view(B, T, c.num_heads, c.head_dim), cos, sin).transpose(1, 2)
        k = rotary(head.k_proj(x).view(B, T, c.num_kv_heads, c.head_dim), cos, sin).transpose(1, 2)
        v = head.v_proj(x).view(B, T, c.num_kv_heads, c.head_dim).transpose(1, 2)
        unrolled.append([(k, v)])
        if step == 0:
            attended = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            attended = unrolled_attention(q, [kv[0] for kv in unrolled])
        u = h + head.o_proj(attended.transpose(1, 2).reshape(B, T, -1))
    with scope("mlp"):
        normed = head.post_attention_layernorm(u)
        out = u + head.down_proj(F.silu(head.gate_proj(normed)) * head.up_proj(normed))
    return DraftStep(out, u, lm_input=head.norm(out))


def unroll(head: Eagle3Head, batch: Batch, steps: int):
    """(s, DraftStep) for s = 0..steps-1: row i of step s has the sequence's token x_{i+s+1} and
    predicts x_{i+s+2} (see :func:`jakiro_ext.training.loss.unroll`)."""
    unrolled: list = []
    step = None
    for s in range(steps):
        tokens = batch.tokens[:, 1:] if s == 0 else F.pad(batch.tokens[:, s + 1:], (0, s))
        step = train_forward(head, tokens, batch.features[:, :-1] if s == 0 else step.feature, unrolled)
        yield s, step


def scored_rows(batch: Batch, steps: int) -> Dict[str, int]:
    """How many rows each step's token loss scores (``acc{s}``), known from the batch alone."""
    L = batch.tokens.shape[1]
    return {f"acc{s + 1}": int(batch.loss_mask[:, s + 2:][:, :max(L - s - 2, 0)].sum()) for s in range(steps)}


def _rows(batch: Batch, step: DraftStep, s: int):
    """Step s's rows that have a next token: (LM-head input, the labels' rows, mask, tokens)."""
    L = batch.tokens.shape[1]
    n = max(L - s - 2, 0)
    probs = None if batch.probs is None else batch.probs[:, s + 1: L - 1]
    return step.for_lm_head[:, :n], probs, batch.loss_mask[:, s + 2:], batch.tokens[:, s + 2:]


def batch_loss(head: Eagle3Head, batch: Batch, cfg: TrainConfig, totals: Dict[str, int] = None):
    """The token loss of a batch over 1 + ``cfg.ttt_steps`` unrolled steps, and each step's top-1
    hits (``hits_acc{s}``): the cross entropy of the head's draft distribution against the
    target's (``batch.probs``: the examples' cached labels), summed over the learned rows and
    divided by ``totals`` (each step's rows in the whole batch; default this batch's)."""
    if batch.probs is None:
        raise ValueError("an EAGLE-3 head learns from the target's distributions: attach them to the examples first "
                         "(attach_labels)")
    steps = 1 + cfg.ttt_steps
    totals = totals or scored_rows(batch, steps)
    lm_head = head.lm_head.weight
    device = batch.features.device.type
    if torch.is_autocast_enabled(device):
        lm_head = lm_head.to(torch.get_autocast_dtype(device))
    loss, metrics = batch.features.new_zeros(()), {}
    for s, step in unroll(head, batch, steps):
        pred, probs, mask, tokens = _rows(batch, step, s)
        mask = mask[:, :pred.shape[1]]
        with scope("lm head+token loss"):
            logits = (pred[mask].to(lm_head.dtype) @ lm_head.T).float()
            labels = TopProbs(probs.probs[mask], probs.ids[mask])
            ce = -(labels.probs * torch.log_softmax(logits, -1).gather(-1, labels.ids)).sum(-1)
            loss = loss + cfg.ttt_decay ** s * ce.sum() / max(totals[f"acc{s + 1}"], 1)
            metrics[f"hits_acc{s + 1}"] = int((head.target_ids(logits.detach().argmax(-1)) == tokens[:, :pred.shape[1]][mask]).sum())
    return loss, metrics


@torch.no_grad()
def evaluate(head: Eagle3Head, examples: Sequence[Example], cfg: TrainConfig, batch_sequences: int = 16,
             steps: int = 4, ranks: Ranks = Ranks()) -> Dict[str, float]:
    """Top-1 accuracy of the head's draft token against the sequence's own tokens at depth
    1..``steps`` (``acc{s}``), drafting from its own outputs as the engine does (with several
    processes, each its share of the examples, the counts summed)."""
    was_training = head.training
    head.eval()
    hits, counts = [0] * steps, [0] * steps
    mine = list(examples)[ranks.rank::ranks.world]
    for i in range(0, len(mine), batch_sequences):
        b = collate(mine[i: i + batch_sequences], cfg.max_seq_len).to(head.fc.weight.device)
        for s, step in unroll(head, b, steps):
            pred, _, mask, tokens = _rows(b, step, s)
            mask = mask[:, :pred.shape[1]]
            best = head.target_ids((pred[mask] @ head.lm_head.weight.T).argmax(-1))
            hits[s] += int((best == tokens[:, :pred.shape[1]][mask]).sum())
            counts[s] += int(mask.sum())
    head.train(was_training)
    summed = ranks.sum(hits + counts)
    return {f"acc{s + 1}": summed[s] / max(summed[steps + s], 1) for s in range(steps)}


@torch.no_grad()
def attach_labels(examples: Sequence[Example], target_rows: torch.Tensor, k: int, rows: int = 8192) -> None:
    """Each example's soft labels (``top_probs``): the target's distribution over the draft
    vocabulary at its final hidden states (``features`` [n, H], before :func:`use_layer_features`
    replaces them), through ``target_rows`` (the target's LM head rows of the draft vocabulary,
    [V_draft, H]), kept to its ``k`` most probable tokens and renormalised; fp32 products."""
    w = target_rows.float()
    for ex in examples:
        if ex.features.shape[-1] != w.shape[-1]:
            raise ValueError(f"labels come from the final hidden states [n, {w.shape[-1]}], got features "
                             f"{list(ex.features.shape)}")
        parts = [(ex.features[i: i + rows].float() @ w.T).topk(k, -1) for i in range(0, ex.features.shape[0], rows)]
        top = torch.cat([p.values for p in parts])
        ex.top_probs = TopProbs(torch.softmax(top, -1).to(torch.float16), torch.cat([p.indices for p in parts]))


def init_lm_head(head: Eagle3Head, target_rows: torch.Tensor) -> None:
    """Start the head's LM head from the target's rows of its draft vocabulary (EAGLE-3's start)."""
    if tuple(target_rows.shape) != tuple(head.lm_head.weight.shape):
        raise ValueError(f"the target's rows of the draft vocabulary must be {list(head.lm_head.weight.shape)}, got "
                         f"{list(target_rows.shape)}")
    with torch.no_grad():
        head.lm_head.weight.copy_(target_rows)


def init_weights(head: Eagle3Head, seed: int = 0, std: float = 0.02) -> Eagle3Head:
    """Random weights (normal, ``std``; the norms at 1), reproducible from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return head

