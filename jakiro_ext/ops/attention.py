"""Attention over a KV cache with a tree mask: ``tree_attention``, and its split halves
``tree_attention_partial`` and ``merge_attention_states`` (FlashDecoding)."""
from __future__ import annotations

from typing import Optional

import torch

from jakiro_ext.ops.backends import kernel, same_device
from jakiro_ext.ops.library import compiled_available


def tree_attention(q, k_cache, v_cache, prefix_lens, tree_mask, scale: Optional[float] = None,
                   num_splits: Optional[int] = None):
    """Attention of the T tree tokens of each sequence over its cached prefix and the tree.

    Parameters
    ----------
    q : [B, T, Hq, D] float32 or bfloat16
    k_cache, v_cache : [B, Hkv, S, D], q's dtype; Hq a multiple of Hkv (GQA). Sequence b's
        prefix is at positions [0, prefix_lens[b]), its tree tokens' keys/values at
        [prefix_lens[b], prefix_lens[b] + T).
    prefix_lens : [B] int64
    tree_mask : [B, T, ceil(T / 64)] int64, bit j of row i set when tree node i sees node j
        (itself and its ancestors); see :func:`build_tree_mask`.
    scale : softmax scale, default 1 / sqrt(D).
    num_splits : number of KV splits (FlashDecoding); default chosen from the shape and threads.

    Returns
    -------
    out : [B, T, Hq, D] in q's dtype; lse : [B, T, Hq] float32 (log-sum-exp of the scores).
    """
    return kernel("tree_attention")(q, k_cache, v_cache, prefix_lens, tree_mask, scale, num_splits)


def tree_attention_partial(q, k_cache, v_cache, prefix_lens, tree_mask, num_splits: int,
                           scale: Optional[float] = None):
    """The split half of :func:`tree_attention`. Sequence b's KV (length prefix_lens[b] + T) is cut
    into ``num_splits`` chunks of ceil(len / num_splits) keys; returns per chunk the normalised
    output ``out_partial`` [B, T, Hq, splits, D] and its log-sum-exp ``lse_partial`` [B, T, Hq, splits]
    (float32; an empty chunk gives 0 and -inf)."""
    return kernel("tree_attention_partial")(q, k_cache, v_cache, prefix_lens, tree_mask, num_splits, scale)


def merge_attention_states(out_partial, lse_partial, out_dtype: Optional[torch.dtype] = None):
    """Merge partial attention states [B, T, H, S, D] / [B, T, H, S] over S by their log-sum-exp.
    Returns out [B, T, H, D] (``out_dtype``, default float32) and lse [B, T, H] float32."""
    return kernel("merge_attention_states")(out_partial, lse_partial, out_dtype)


if compiled_available():  # the fakes (meta implementations), beside their ops
    @torch.library.register_fake("jakiro::tree_attention")
    def _tree_attention_fake(q, k_cache, v_cache, prefix_lens, tree_mask, scale=None, num_splits=None):
        same_device("tree_attention", q=q, k_cache=k_cache, v_cache=v_cache, prefix_lens=prefix_lens, tree_mask=tree_mask)
        B, T, H, _ = q.shape
        return q.new_empty(q.shape), q.new_empty((B, T, H), dtype=torch.float32)

    @torch.library.register_fake("jakiro::tree_attention_partial")
    def _tree_attention_partial_fake(q, k_cache, v_cache, prefix_lens, tree_mask, num_splits, scale=None):
        same_device("tree_attention_partial", q=q, k_cache=k_cache, v_cache=v_cache, prefix_lens=prefix_lens, tree_mask=tree_mask)
        B, T, H, D = q.shape
        return (q.new_empty((B, T, H, num_splits, D), dtype=torch.float32),
                q.new_empty((B, T, H, num_splits), dtype=torch.float32))

    @torch.library.register_fake("jakiro::merge_attention_states")
    def _merge_attention_states_fake(out_partial, lse_partial, out_dtype=None):
        same_device("merge_attention_states", out_partial=out_partial, lse_partial=lse_partial)
        B, T, H, _, D = out_partial.shape
        return (out_partial.new_empty((B, T, H, D), dtype=out_dtype or torch.float32),
                out_partial.new_empty((B, T, H), dtype=torch.float32))
