"""The draft heads' ops: Jakiro's MoE block (``moe_top2``), the top-k of a (contrastive) feature
under an LM head (``contrastive_topk``) and Gumiho's parallel MLP heads (``mlp_heads``)."""
from __future__ import annotations

import torch

from jakiro_ext.ops.backends import kernel, same_device
from jakiro_ext.ops.library import compiled_available


def moe_top2(x, router_weight, w_gate, w_up, w_down, renormalize: bool = False):
    """Jakiro's MoE block. x [..., H]; router_weight [N + 2, H]; w_gate, w_up [N, I, H];
    w_down [N, H, I]; all one dtype, or on the CPU the experts' weights (w_gate, w_up, w_down) in
    bfloat16 beside a float32 x and router (widened exactly as they are read). Routing: softmax
    over the first N router logits, top-2 (scores renormalised to sum 1 if ``renormalize``); the
    last 2 logits give the contrastive weights (their softmax, larger first).

    Returns out [..., H] = x + s_0 * h_0 + s_1 * h_1, expert_out [..., 2, H] = (h_0, h_1) the
    selected experts' SwiGLU outputs (higher score first), expert_idx [..., 2] int64,
    expert_score [..., 2] float32 and contrast_weight [..., 2] float32 = (w_hi, w_lo)."""
    return kernel("moe_top2")(x, router_weight, w_gate, w_up, w_down, renormalize)


def contrastive_topk(h_a, h_b, contrast_weight, lm_head, k: int):
    """Top-k tokens of log_softmax(f @ lm_head.T) with f = w_hi * h_a - w_lo * h_b when ``h_b``
    and ``contrast_weight`` [..., 2] = (w_hi, w_lo) are given, or f = h_a when both are None
    (the MoE branch). h_a, h_b [..., H]; lm_head [V, H] (on the CPU also bfloat16 beside float32
    features, or packed quantized: :mod:`jakiro_ext.ops.quantized`, the logits then those of
    ``linear``, the features quantized per row). Returns logprobs [..., k] float32 (descending)
    and token_ids [..., k] int64. The [..., V] logits are never materialised."""
    return kernel("contrastive_topk")(h_a, h_b, contrast_weight, lm_head, k)


def mlp_heads(x, w_in, b_in, w_blocks, b_blocks):
    """Gumiho's J parallel MLP heads on one input x [..., K]: head j is
    ``h = SiLU(x @ w_in[j].T + b_in[j])``, then for each of the NB blocks
    ``h = h + SiLU(h @ w_blocks[j, b].T + b_blocks[j, b])``; returns [..., J, H]. w_in [J, H, K],
    b_in [J, H], w_blocks [J, NB, H, H], b_blocks [J, NB, H]; one dtype (float32 or bfloat16).
    Activations in float32, the output rounded once; each row computed alike whatever the
    number of rows. One call for every layer of every head (weights streamed once)."""
    return kernel("mlp_heads")(x, w_in, b_in, w_blocks, b_blocks)


if compiled_available():  # the fakes (meta implementations), beside their ops
    @torch.library.register_fake("jakiro::moe_top2")
    def _moe_top2_fake(x, router_weight, w_gate, w_up, w_down, renormalize=False):
        same_device("moe_top2", x=x, router_weight=router_weight, w_gate=w_gate, w_up=w_up, w_down=w_down)
        lead = x.shape[:-1]
        return (x.new_empty(x.shape), x.new_empty((*lead, 2, x.shape[-1])),
                x.new_empty((*lead, 2), dtype=torch.int64), x.new_empty((*lead, 2), dtype=torch.float32),
                x.new_empty((*lead, 2), dtype=torch.float32))

    @torch.library.register_fake("jakiro::contrastive_topk")
    def _contrastive_topk_fake(h_a, h_b, contrast_weight, lm_head, k):
        same_device("contrastive_topk", h_a=h_a, h_b=h_b, contrast_weight=contrast_weight, lm_head=lm_head)
        lead = h_a.shape[:-1]
        return h_a.new_empty((*lead, k), dtype=torch.float32), h_a.new_empty((*lead, k), dtype=torch.int64)

    @torch.library.register_fake("jakiro::mlp_heads")
    def _mlp_heads_fake(x, w_in, b_in, w_blocks, b_blocks):
        same_device("mlp_heads", x=x, w_in=w_in, b_in=b_in, w_blocks=w_blocks, b_blocks=b_blocks)
        return x.new_empty((*x.shape[:-1], w_in.shape[0], w_in.shape[1]))
