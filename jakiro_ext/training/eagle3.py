"""Training an EAGLE-3 head (:class:`~jakiro_ext.models.heads.eagle3.Eagle3Head`), as EAGLE-3 trains
one: step 0 reads the target's low, middle and high layers fused (``fc: 3H -> H``), every later
step its own output (the training-time test: each step's input is what drafting would feed it),
and the loss is the token loss alone (no feature regression: the head's hidden state is its own,
not the target's), step s weighted by ``ttt_decay ** s``. Its LM head is its own, over the draft
vocabulary, started from the target's rows; the soft labels are the target's distribution over
that vocabulary (from the target's final hidden states, through the target's own rows).

An example's ``features`` are the three layers' residual streams [n, 3H]
(:func:`jakiro_ext.training.run.use_layer_features`); its ``top_probs`` the labels, computed from
the final hidden states before they are replaced. The loss, the unrolling and the evaluation are
the other heads' (:mod:`jakiro_ext.training.loss`): this module is the head's differentiable forward.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from jakiro_ext import ops
from jakiro_ext.models.heads.eagle3 import Eagle3Head
from jakiro_ext.models.heads.step import DraftStep
from jakiro_ext.models.rope import rope_cos_sin, rotary
from jakiro_ext.profiling import scope
from jakiro_ext.training.head_forward import unrolled_attention


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
    x = torch.cat([head.input_layernorm(ops.embedding(head.embed_weight, tokens).to(h.dtype)),
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

