"""A draft head's training forward: the differentiable counterpart of its drafting forward, in
plain PyTorch (the fused ops have no backward), sharing the head's layers
(:meth:`DraftHead.run_layers`); with the training-time test's unrolled steps."""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from jakiro_ext.models.heads.draft_head import DraftHead
from jakiro_ext.models.heads.step import DraftStep
from jakiro_ext.models.rope import rope_cos_sin, rotary
from jakiro_ext.ops.reference import route_top2
from jakiro_ext.profiling import scope


def train_forward(head: DraftHead, tokens: torch.Tensor, features: torch.Tensor,
                  unrolled: Optional[list] = None) -> DraftStep:
    """The differentiable counterpart of :meth:`DraftHead.forward` for training: whole sequences, in plain
    PyTorch (the fused ops have no backward). tokens [B, T] (token t+1 of each row), features
    [B, T, H] (f_t). The same layers (:meth:`DraftHead.run_layers`); only the attention, the products and
    the experts run differently.

    ``unrolled`` (the training-time test): a list that collects each call's keys/values (a
    list of (k, v) per layer). The call made with it empty is step 0: row i at position i,
    causal (the committed prefix, as the draft's cache holds it). The call made with s entries
    is step s: row i is the draft row s steps after row i's anchor, at position i + s; it sees
    step 0's rows 0..i and its own row of steps 1..s (its draft ancestors), exactly what
    drafting at depth s sees."""
    c = head.config
    B, T = tokens.shape
    step = len(unrolled) if unrolled is not None else 0
    with scope("embed+fc"):  # (the residual stream stays in the weights' dtype under autocast)
        x = head.project_input(tokens, features, train=True).to(head.fc.weight.dtype)
    positions = torch.arange(step, T + step, device=tokens.device).unsqueeze(0)
    cos, sin = rope_cos_sin(positions, c.head_dim, c.rope_theta, x.dtype)
    kv: list = []
    if unrolled is not None:
        unrolled.append(kv)

    def attention(w: nn.Module, x: torch.Tensor, layer: int) -> torch.Tensor:
        with scope("attention"):
            q = rotary(w.q_proj(x).view(B, T, c.num_heads, c.head_dim), cos, sin).transpose(1, 2)
            k = rotary(w.k_proj(x).view(B, T, c.num_kv_heads, c.head_dim), cos, sin).transpose(1, 2)
            v = w.v_proj(x).view(B, T, c.num_kv_heads, c.head_dim).transpose(1, 2)
            kv.append((k, v))
            if step == 0:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            else:
                out = unrolled_attention(q, [keys[layer] for keys in unrolled])
            return w.o_proj(out.transpose(1, 2).reshape(B, T, -1))

    def mlp(w: nn.Module, x: torch.Tensor) -> torch.Tensor:
        with scope("mlp"):
            return w.down_proj(F.silu(w.gate_proj(x)) * w.up_proj(x))

    def moe(normed: torch.Tensor):
        with scope("moe"):
            N = c.num_experts
            with torch.autocast(normed.device.type, enabled=False):  # routing in fp32, as drafting routes
                logits = normed.float() @ head.router.float().T  # [B, T, N + 2]
            score, idx, contrast = route_top2(logits, N, c.renormalize)
            expert_out = routed_experts(head, normed.reshape(B * T, -1), idx.reshape(B * T, 2)).view(B, T, 2, -1)
            return expert_out, score, contrast

    return head.run_layers(x, attention, mlp, moe)


def routed_experts(head: DraftHead, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The two routed experts' outputs [R, 2, H] for rows x [R, H] and their experts idx
    [R, 2], differentiable: the (row, slot) pairs sorted by expert once, each expert one
    product chain over its contiguous rows, the outputs put back by the inverse permutation."""
    pairs = idx.reshape(-1)  # pair 2r + s: row r's slot s
    order = torch.argsort(pairs, stable=True)
    counts = torch.bincount(pairs, minlength=head.config.num_experts).tolist()  # (one host read)
    outs = [F.linear(F.silu(F.linear(rows, head.w_gate[j])) * F.linear(rows, head.w_up[j]), head.w_down[j])
            for j, rows in enumerate(x[order // 2].split(counts))]
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return torch.cat(outs)[inverse].view(x.shape[0], 2, -1)


def unrolled_attention(q: torch.Tensor, unrolled: list) -> torch.Tensor:
    """Attention of step s = len(unrolled) - 1 of the training-time test: q [B, Hq, T, D]; row i
    sees step 0's keys 0..i (causal) and row i of every step 1..s (diagonal)."""
    B, Hq, T, D = q.shape
    group = Hq // unrolled[0][0].shape[1]
    keys = [k.repeat_interleave(group, dim=1) for k, _ in unrolled]  # [B, Hq, T, D] each
    values = [v.repeat_interleave(group, dim=1) for _, v in unrolled]
    scale = 1.0 / math.sqrt(D)
    prefix = (q @ keys[0].transpose(-1, -2)) * scale  # [B, Hq, T, T]
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    prefix = prefix.masked_fill(~causal, -math.inf)
    own = torch.stack([(q * k).sum(-1) for k in keys[1:]], -1) * scale  # [B, Hq, T, s]
    probs = torch.softmax(torch.cat([prefix, own], -1), -1)
    out = probs[..., :T] @ values[0]
    return out + (probs[..., T:].unsqueeze(-1) * torch.stack(values[1:], -2)).sum(-2)
