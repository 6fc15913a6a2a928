"""Pure-PyTorch specifications of every ``torch.ops.jakiro`` op, under the same names and
signatures. They are the executable spec and the test oracle: clear before fast. Floating
point work is done in float32 (float64 for sampling) whatever the input dtype, except the
MoE experts, which run in the input dtype like an eager model would (the kernel keeps their
intermediates in float32: in bf16 the two agree to bf16 precision, not bit for bit).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from jakiro_ext.ops import quantized


# ----------------------------------------------------------------------------- attention
def unpack_tree_mask(tree_mask: torch.Tensor, tree_len: int) -> torch.Tensor:
    """[B, T, W] int64 bit-packed rows -> [B, T, T] bool (entry [b, i, j]: node i sees node j)."""
    j = torch.arange(tree_len, device=tree_mask.device)
    words = tree_mask[..., j // 64]
    return ((words >> (j % 64)) & 1).bool()


def tree_attention_partial(q, k_cache, v_cache, prefix_lens, tree_mask, num_splits: int,
                           scale: Optional[float] = None):
    B, T, Hq, D = q.shape
    G = Hq // k_cache.shape[1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    out = q.new_zeros((B, T, Hq, num_splits, D), dtype=torch.float32)
    lse = q.new_full((B, T, Hq, num_splits), -math.inf, dtype=torch.float32)
    sees = unpack_tree_mask(tree_mask, T)
    for b in range(B):
        prefix = int(prefix_lens[b])
        length = prefix + T
        k = k_cache[b, :, :length].float().repeat_interleave(G, dim=0)  # [Hq, L, D]
        v = v_cache[b, :, :length].float().repeat_interleave(G, dim=0)
        scores = torch.einsum("thd,hld->htl", q[b].float(), k) * scale  # [Hq, T, L]
        allowed = torch.cat([sees.new_ones(T, prefix), sees[b]], dim=1)  # [T, L]
        scores = scores.masked_fill(~allowed, -math.inf)
        chunk = -(-length // num_splits)
        for s in range(num_splits):
            lo, hi = min(length, s * chunk), min(length, (s + 1) * chunk)
            if lo >= hi:
                continue
            part = scores[..., lo:hi]
            poisoned = (part.isnan() | part.isposinf()).any(-1)  # [Hq, T]: a NaN or +inf score
            part = part.masked_fill(poisoned.unsqueeze(-1), -math.inf)
            part_lse = torch.logsumexp(part, dim=-1)
            probs = torch.exp(part - part_lse.unsqueeze(-1)).nan_to_num(0.0)  # fully masked rows -> 0
            # Values a row attends to only: a NaN value of a key it does not see never reaches it.
            vs, nan_v = v[:, lo:hi], v[:, lo:hi].isnan()
            reads_nan = allowed[:, lo:hi].float() @ nan_v.float() > 0  # [Hq, T, D]
            o = (probs @ vs.masked_fill(nan_v, 0.0)).masked_fill(reads_nan, math.nan)
            out[b, :, :, s] = o.masked_fill(poisoned.unsqueeze(-1), math.nan).transpose(0, 1)
            lse[b, :, :, s] = part_lse.masked_fill(poisoned, math.nan).transpose(0, 1)
    return out, lse


def merge_attention_states(out_partial, lse_partial, out_dtype: Optional[torch.dtype] = None):
    poisoned = (lse_partial.isnan() | lse_partial.isposinf()).any(-1)  # a split saw a NaN or +inf score
    empty = lse_partial == -math.inf  # an empty split: its output is not read
    lse_ok = lse_partial.masked_fill(empty | poisoned.unsqueeze(-1), -math.inf)
    max_lse = lse_ok.amax(dim=-1, keepdim=True)
    weights = torch.exp(lse_ok - max_lse.nan_to_num(0.0, neginf=0.0))  # exp(-inf) = 0 for empty splits
    total = weights.sum(dim=-1)
    terms = (weights.unsqueeze(-1) * out_partial).masked_fill(empty.unsqueeze(-1), 0.0)
    out = terms.sum(dim=-2) / total.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)
    lse = torch.where(total > 0, max_lse.squeeze(-1) + torch.log(total), -math.inf)
    out = out.masked_fill(poisoned.unsqueeze(-1), math.nan)
    return out.to(out_dtype or torch.float32), lse.masked_fill(poisoned, math.nan)


def tree_attention(q, k_cache, v_cache, prefix_lens, tree_mask, scale: Optional[float] = None,
                   num_splits: Optional[int] = None):
    out, lse = tree_attention_partial(q, k_cache, v_cache, prefix_lens, tree_mask, num_splits or 1, scale)
    return merge_attention_states(out, lse, q.dtype)


# ----------------------------------------------------------------------------- MoE block
def route_top2(router_logits, num_experts: int, renormalize: bool = False):
    """Jakiro's routing from the router's float32 logits [..., N + 2]: (score [..., 2], idx
    [..., 2], contrast [..., 2]). The two most probable of the N experts under a softmax over the
    first N logits (ties: the lower expert first), their probabilities (renormalized to sum to 1
    with ``renormalize``), and the contrastive weights, a softmax over the last two logits sorted
    descending. Differentiable; the one definition the reference, training and the serving
    classes route by (moe_top2's kernels are tested against it)."""
    N = num_experts
    score, idx = torch.sort(torch.softmax(router_logits[..., :N], dim=-1), dim=-1, descending=True, stable=True)
    score, idx = score[..., :2], idx[..., :2]
    if renormalize:
        score = score / score.sum(dim=-1, keepdim=True)
    contrast = torch.softmax(router_logits[..., N:], dim=-1).sort(dim=-1, descending=True).values
    return score, idx, contrast


def moe_top2(x, router_weight, w_gate, w_up, w_down, renormalize: bool = False):
    """Loop over the experts (the Mixtral / Hugging Face formulation)."""
    H = x.shape[-1]
    N = w_gate.shape[0]
    x2 = x.reshape(-1, H)
    logits = x2.float() @ router_weight.float().T  # [M, N + 2]
    routed = logits.isfinite().all(-1)  # a token with a non-finite router logit has no routing
    logits = logits.masked_fill(~routed.unsqueeze(-1), 0.0)
    score, idx, contrast = route_top2(logits, N, renormalize)
    idx = idx.masked_fill(~routed.unsqueeze(-1), -1)
    score = score.masked_fill(~routed.unsqueeze(-1), math.nan)
    contrast = contrast.masked_fill(~routed.unsqueeze(-1), math.nan)
    expert_out = x2.new_full((x2.shape[0], 2, H), math.nan)
    for e in range(N):
        token, slot = torch.where(idx == e)
        if token.numel() == 0:
            continue
        xs = x2[token]
        g, u, d = (w[e].to(x.dtype) for w in (w_gate, w_up, w_down))  # (bf16 experts beside float32 x: widened)
        expert_out[token, slot] = F.linear(F.silu(F.linear(xs, g)) * F.linear(xs, u), d)
    out = (x2.float() + (score.unsqueeze(-1) * expert_out.float()).sum(dim=1)).to(x.dtype)
    lead = x.shape[:-1]
    return (out.view(x.shape), expert_out.view(*lead, 2, H), idx.view(*lead, 2), score.view(*lead, 2),
            contrast.view(*lead, 2))


# ----------------------------------------------------------------------------- LM head
def contrastive_topk(h_a, h_b, contrast_weight, lm_head, k: int):
    f = h_a.float()
    if h_b is not None:
        w = contrast_weight.float()
        f = w[..., 0:1] * f - w[..., 1:2] * h_b.float()
    logits = quantized.linear(f, lm_head) if quantized.is_packed(lm_head) else f @ lm_head.float().T
    # No distribution (a NaN or +inf logit, or every logit -inf): NaN log-probabilities, token -1.
    none = (logits.isnan() | logits.isposinf()).any(-1) | logits.isneginf().all(-1)
    logprobs = torch.log_softmax(logits.masked_fill(none.unsqueeze(-1), 0.0), dim=-1)
    values, ids = torch.topk(logprobs, k, dim=-1)
    return values.masked_fill(none.unsqueeze(-1), math.nan), ids.masked_fill(none.unsqueeze(-1), -1)


# ----------------------------------------------------------------------------- projections
def rms_norm(x, weight, eps: float, residual=None):
    s = x if residual is None else x + residual
    s32 = s.float()
    out = (s32 * torch.rsqrt(s32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight
    return out, s.clone()


def rope_kv_write(qkv, cos, sin, kv_cache, lengths):
    B, T, _, D = qkv.shape
    Hkv = kv_cache.shape[2]
    Hq = qkv.shape[2] - 2 * Hkv
    x = qkv[:, :, : Hq + Hkv]
    rotated = torch.cat([-x[..., D // 2:], x[..., : D // 2]], -1)
    qk = x * cos.unsqueeze(2) + rotated * sin.unsqueeze(2)
    rows = torch.arange(B, device=qkv.device).unsqueeze(1).expand(B, T)
    slots = lengths.unsqueeze(1) + torch.arange(T, device=qkv.device)
    kv_cache[0][rows, :, slots] = qk[:, :, Hq:].to(kv_cache.dtype)  # (a bf16 cache beside float32 rows: rounded)
    kv_cache[1][rows, :, slots] = qkv[:, :, Hq + Hkv:].to(kv_cache.dtype)
    return qk[:, :, :Hq].contiguous()


def linear(x, weight, bias=None):
    if quantized.is_packed(weight):
        return quantized.linear(x, weight, bias)
    y = x.float() @ weight.float().T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def dequantize_rows(packed, rows):
    return quantized.dequantize(packed, rows)


def silu_mul(gate_up):
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype)


def decoder_layer(delta, residual, input_norm, qkv_weight, qkv_bias, o_weight, post_norm, gate_up_weight,
                  down_weight, cos, sin, kv_cache, lengths, tree_mask, eps: float):
    B, T, _ = delta.shape
    Hkv, D = kv_cache.shape[2], kv_cache.shape[4]
    Hq = quantized.matrix_shape(o_weight)[1] // D
    h, stream = rms_norm(delta, input_norm, eps, residual)
    qkv = linear(h, qkv_weight, qkv_bias).view(B, T, Hq + 2 * Hkv, D)
    q = rope_kv_write(qkv, cos, sin, kv_cache, lengths)
    attention, _ = tree_attention(q, kv_cache[0], kv_cache[1], lengths, tree_mask)
    h, stream = rms_norm(linear(attention.reshape(B, T, Hq * D), o_weight), post_norm, eps, stream)
    return stream, linear(silu_mul(linear(h, gate_up_weight)), down_weight)


def decoder_layers(delta, residual, input_norms, qkv_weights, qkv_biases, o_weights, post_norms, gate_up_weights,
                   down_weights, cos, sin, kv_cache, lengths, tree_mask, eps: float):
    for layer in range(len(input_norms)):
        residual, delta = decoder_layer(delta, residual, input_norms[layer], qkv_weights[layer],
                                        qkv_biases[layer] if qkv_biases else None, o_weights[layer],
                                        post_norms[layer], gate_up_weights[layer], down_weights[layer], cos, sin,
                                        kv_cache[layer], lengths, tree_mask, eps)
    return residual, delta


def mlp_heads(x, w_in, b_in, w_blocks, b_blocks):
    silu = torch.nn.functional.silu
    J, H, K = w_in.shape
    rows = x.reshape(math.prod(x.shape[:-1]), K).float()
    h = silu(torch.einsum("mk,jhk->jmh", rows, w_in.float()) + b_in.float().unsqueeze(1))  # [J, M, H]
    for b in range(w_blocks.shape[1]):
        h = h + silu(torch.einsum("jmh,jgh->jmg", h, w_blocks[:, b].float()) + b_blocks[:, b].float().unsqueeze(1))
    return h.transpose(0, 1).reshape(*x.shape[:-1], J, H).to(x.dtype)


# ----------------------------------------------------------------------------- verification
def has_distribution(logits_row) -> bool:
    """Logits give a distribution unless one is NaN or +inf, or all are -inf."""
    x = logits_row.float()
    return not bool((x.isnan() | x.isposinf()).any() or x.isneginf().all())


def _no_distribution(b: int, node: int):
    return RuntimeError(f"jakiro::verify_tree: target_logits[{b}, {node}] give no distribution (a NaN or +inf logit, "
                        "or every logit -inf): the target's logits must be finite; no token is accepted from them")


def filtered_distribution(logits_row, temperature: float, top_p: float, top_k: int) -> torch.Tensor:
    """Target distribution at one node (float64): softmax(logits / temperature), then top-k
    (tokens reaching the k-th largest logit, ties kept), then top-p (most probable first, ties
    by lower id, while the mass before the token is < top_p). Scaled as (logit - max) /
    temperature, which never overflows: a tiny temperature gives the argmax distribution."""
    x = logits_row.float().double()
    z = (x - x.max()) / temperature
    V = z.shape[0]
    if 0 < top_k < V:
        z = z.masked_fill(z < torch.topk(z, top_k).values[-1], -math.inf)
    p = torch.softmax(z, dim=-1)
    if top_p < 1.0:
        sorted_p, order = torch.sort(p, descending=True, stable=True)
        mass_before = torch.cat([sorted_p.new_zeros(1), torch.cumsum(sorted_p, 0)[:-1]])
        p[order[mass_before >= top_p]] = 0.0
    return p


def _sample_from(w: torch.Tensor, total: float, u: float) -> int:
    """Inverse CDF in token order; -1 if no token has mass left."""
    if not bool((w > 0).any()):
        return -1
    cum = torch.cumsum(w, 0)
    i = int(torch.searchsorted(cum, torch.tensor([u * total], dtype=cum.dtype), right=True))
    if i >= w.shape[0]:
        i = int(torch.nonzero(w > 0).max())
    return i


def verify_tree(parents, draft_tokens, target_logits, uniforms=None, temperature: float = 0.0,
                top_p: float = 1.0, top_k: int = 0):
    B, T = parents.shape
    path = parents.new_full((B, T), -1)
    accept_len = parents.new_zeros(B)
    bonus = parents.new_zeros(B)
    for b in range(B):
        par, tok = parents[b].tolist(), draft_tokens[b].tolist()
        node, walk = 0, [0]
        while True:
            children = [c for c in range(T) if par[c] == node]
            if not has_distribution(target_logits[b, node]):
                raise _no_distribution(b, node)
            if temperature == 0.0:
                want = int(torch.argmax(target_logits[b, node].float()))
                nxt = next((c for c in children if tok[c] == want), None)
                if nxt is None:
                    bonus[b] = want
                    break
            else:
                w = filtered_distribution(target_logits[b, node], temperature, top_p, top_k)
                total = float(w.sum())
                nxt, tried = None, {}
                for c in children:
                    x = tok[c]
                    if x in tried.values():  # a sibling already tested this token
                        continue
                    tried[c] = x
                    if float(uniforms[b, c]) * total < float(w[x]):
                        nxt = c
                        break
                    total -= float(w[x])
                    w[x] = 0.0
                if nxt is None:
                    token = _sample_from(w, total, float(uniforms[b, T]))
                    if token >= 0 or not tried:
                        bonus[b] = token
                        break
                    nxt = list(tried)[-1]  # no mass left: only rounding rejected the last child
            walk.append(nxt)
            node = nxt
        path[b, : len(walk)] = torch.tensor(walk)
        accept_len[b] = len(walk) - 1
    return path, accept_len, bonus


# ----------------------------------------------------------------------------- KV compaction
def compact_kv(cache, prefix_lens, path, path_len) -> None:
    B = cache.shape[-4]
    for b in range(B):
        prefix = int(prefix_lens[b])
        for j in range(int(path_len[b])):
            cache[..., b, :, prefix + j, :] = cache[..., b, :, prefix + int(path[b, j]), :]


def device_errors(like: torch.Tensor) -> torch.Tensor:
    """The bad index values met on ``like``'s device since the last call (bits, int32 [1]):
    always 0 here, where every op checks its inputs before using them."""
    return torch.zeros(1, dtype=torch.int32, device=like.device)
