"""The draft head in plain PyTorch, as a serving engine runs it: no fused op, no engine, static
shapes (every expert computed for every row and weighted, zero for the experts not routed to), so
that torch.compile and CUDA graphs take it whole.

- :class:`JakiroMoE`: the MoE feed-forward block, returning the block's output only (the engine's
  decoder layer adds the residual): router of N + 2 outputs, top-2 over the first N, the two
  scores from the softmax over the N (renormalised to sum to 1 when the head says so), the sum of
  the two experts' SwiGLU outputs weighted by them. Routing in fp32, as the head drafts.
- :func:`draft_forward`: the whole draft forward over a causal sequence from the tensors of the
  ``serving`` format (:mod:`jakiro_ext.serving.format`): ``fc(cat(embed(token), feature))``, one
  decoder layer with no norm before its attention, the MoE (or dense) block, no final norm; the
  logits over the target's vocabulary with the tokens outside the head's draft vocabulary at -inf.
  What the engine plugins compute, for the tests that hold them to the head (an engine's draft
  prefill is this forward; its draft steps are rows of it).
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from jakiro_ext.models.rope import rope_cos_sin, rotary
from jakiro_ext.ops.reference import rms_norm, route_top2
from jakiro_ext.serving.format import blocked_tokens


class JakiroMoE(nn.Module):
    """``forward(x [..., H]) -> [..., H]``: the MoE block's output (the residual not added)."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, renormalize: bool = False,
                 dtype: Optional[torch.dtype] = None):
        super().__init__()
        if num_experts < 2:
            raise ValueError(f"a Jakiro MoE block needs num_experts >= 2 (top-2 routing), got {num_experts}")
        N, H, inner = num_experts, hidden_size, intermediate_size
        self.num_experts, self.renormalize = N, renormalize
        # (Names without ".gate_proj"/".up_proj": the engines' loaders rewrite those into stacked weights.)
        self.router = nn.Parameter(torch.empty(N + 2, H, dtype=dtype))
        self.w_gate = nn.Parameter(torch.empty(N, inner, H, dtype=dtype))
        self.w_up = nn.Parameter(torch.empty(N, inner, H, dtype=dtype))
        self.w_down = nn.Parameter(torch.empty(N, H, inner, dtype=dtype))

    def routing(self, x: torch.Tensor) -> torch.Tensor:
        """[..., N]: each row's weight of every expert (the two routed ones' scores, else 0)."""
        logits = x.float() @ self.router.float().T
        score, idx, _ = route_top2(logits, self.num_experts, self.renormalize)
        return torch.zeros_like(logits[..., :self.num_experts]).scatter(-1, idx, score)

    def forward(self, x: torch.Tensor, *_, **__) -> torch.Tensor:
        # (Extra arguments, e.g. SGLang's forward_batch, are not needed.)
        N, inner, H = self.w_gate.shape
        weights = self.routing(x).to(x.dtype)
        rows = x.reshape(-1, H)
        gate = F.linear(rows, self.w_gate.reshape(N * inner, H))
        up = F.linear(rows, self.w_up.reshape(N * inner, H))
        h = (F.silu(gate) * up).view(-1, N, inner) * weights.reshape(-1, N, 1)
        down = self.w_down.permute(0, 2, 1).reshape(N * inner, H)  # sum_j s_j W_j h_j = [W_0 .. W_N-1] (s * h)
        return (h.reshape(-1, N * inner) @ down).view(x.shape)


def dense_mlp(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


def draft_forward(config: dict, state: Dict[str, torch.Tensor], embed: torch.Tensor, lm_head: torch.Tensor,
                  tokens: torch.Tensor, features: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(features [B, T, H] the head predicts, logits [B, T, V]) for ``tokens`` [B, T] (token t+1 of
    each row) and the target's ``features`` [B, T, H] (f_t), causal over the T rows at positions
    0..T-1, from a ``serving`` config and its tensors; ``embed`` and ``lm_head`` are the target's."""
    c, moe = config, config.get("jakiro", {})
    B, T = tokens.shape
    heads, kv_heads, D = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    x = F.linear(torch.cat([F.embedding(tokens, embed), features], -1), state["fc.weight"], state["fc.bias"])
    cos, sin = rope_cos_sin(torch.arange(T, device=tokens.device).expand(B, T), D, c["rope_theta"], x.dtype)
    q = rotary(F.linear(x, state["layers.0.self_attn.q_proj.weight"]).view(B, T, heads, D), cos, sin)
    k = rotary(F.linear(x, state["layers.0.self_attn.k_proj.weight"]).view(B, T, kv_heads, D), cos, sin)
    v = F.linear(x, state["layers.0.self_attn.v_proj.weight"]).view(B, T, kv_heads, D)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                         enable_gqa=True)
    u = x + F.linear(out.transpose(1, 2).reshape(B, T, heads * D), state["layers.0.self_attn.o_proj.weight"])
    normed = rms_norm(u, state["layers.0.post_attention_layernorm.weight"], c["rms_norm_eps"])[0]
    if moe.get("num_experts"):
        block = JakiroMoE(c["hidden_size"], moe["expert_intermediate_size"], moe["num_experts"],
                          moe.get("renormalize", False), dtype=u.dtype)
        block.load_state_dict({k: state[f"layers.0.mlp.{k}"] for k in ("router", "w_gate", "w_up", "w_down")})
        feature = u + block(normed)
    else:
        feature = u + dense_mlp(normed, *(state[f"layers.0.mlp.{n}.weight"] for n in ("gate_proj", "up_proj", "down_proj")))
    return feature, masked_logits(feature @ lm_head.T, state.get("draft_to_target"))


def masked_logits(logits: torch.Tensor, draft_to_target: Optional[torch.Tensor]) -> torch.Tensor:
    """Logits over the target's vocabulary with the tokens outside the draft vocabulary at -inf
    (the head drafts only those; None: the whole vocabulary)."""
    if draft_to_target is None:
        return logits
    return logits.masked_fill(blocked_tokens(draft_to_target, logits.shape[-1]).to(logits.device), float("-inf"))
