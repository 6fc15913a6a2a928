"""``tree_attention`` as a transformers (5.x) attention implementation, ``"jakiro_tree"``, and the
KV commit of a transformers cache after ``verify_tree``::

    from jakiro_ext.integrations import transformers as jt
    jt.register()                                         # once; then any Llama-family model:
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="jakiro_tree")
    out = model(tree_tokens, attention_mask=mask4d, position_ids=prefix + depths, cache=cache)
    jt.commit(cache, prefix, path, accepted, tree_tokens.shape[1])   # the accepted path's K/V kept

A tree step passes its mask as transformers passes a custom one: 4D ``[B, 1, T, P + T]``, bool
(True: attends) or additive float (0: attends, very negative: masked), which reaches the attention
function as given; or packed (``jakiro_tree_mask=[B, T, ceil(T / 64)]`` int64, bit j of row i: node
i sees node j, as :func:`jakiro_ext.ops.build_tree_mask` makes it) as an extra keyword argument
(the model's own mask, if any, must then leave the prefix wholly visible). Without a mask (a
prompt, one token) the rows are causal. The new tokens are the cache's last (a ``DynamicCache``).

Where our op cannot compute what the model asks (fp16, training dropout, a prefix not wholly
visible such as left padding, an additive bias other than 0 / masked such as ALiBi, new tokens
that are not the cache's last such as a static cache's, a cache not laid out as rows of keys), the call runs
transformers' own SDPA instead and warns once per reason: never silently. A model whose attention
soft-caps its logits or has sinks (which SDPA has not either) is an error.
"""
from __future__ import annotations

import warnings

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from jakiro_ext import ops
from jakiro_ext.ops.masks import causal_tree_mask, pack_bits

NAME = "jakiro_tree"
_WARNED: set = set()


def packed_from_4d(mask: torch.Tensor, tree_tokens: int):
    """(a 4D mask [B, 1, T, S] over the last T keys, packed [B, T, ceil(T / 64)] int64, None) or
    (None, why it cannot be): the prefix's columns must all be visible, a float mask only 0 or masked."""
    if mask.dim() != 4 or mask.shape[1] != 1:
        return None, f"a mask of shape {list(mask.shape)} (one [B, 1, T, S] mask for every head is expected)"
    if mask.dtype == torch.bool:
        sees = mask[:, 0]
    else:
        sees = mask[:, 0] == 0
        if not bool((sees | (mask[:, 0] <= torch.finfo(mask.dtype).min / 2)).all()):
            return None, "an additive bias other than 0 / masked (ALiBi, a soft mask)"
    prefix = sees.shape[-1] - tree_tokens
    if not bool(sees[..., :prefix].all()):
        return None, "a prefix not wholly visible to every row (padding, or a hole in the cache)"
    if not bool(sees[..., prefix:].diagonal(dim1=-2, dim2=-1).all()):
        return None, "new tokens that are not the cache's last (a static cache's slots)"
    return pack_bits(sees[..., prefix:]), None


def _fallback(why: str, module, query, key, value, attention_mask, dropout, scaling, **kwargs):
    if why not in _WARNED:
        _WARNED.add(why)
        warnings.warn(f"attn_implementation '{NAME}': {why}; this call ran transformers' sdpa instead", stacklevel=3)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def jakiro_tree_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention call: query [B, Hq, T, D], key and value [B, Hkv, S, D] (the whole
    cache, these T tokens last), returns ([B, T, Hq, D], None)."""
    B, _, T, _ = query.shape
    packed = kwargs.pop("jakiro_tree_mask", None)
    args = (module, query, key, value, attention_mask, dropout, scaling)
    for name in ("softcap", "s_aux"):  # (sdpa has neither: no fallback)
        if kwargs.get(name) is not None:
            raise ValueError(f"attn_implementation '{NAME}': this model's attention uses {name}, which tree_attention "
                             "does not compute: load it with attn_implementation='eager'")
    if query.dtype not in (torch.float32, torch.bfloat16):
        return _fallback(f"{query.dtype} (tree_attention takes float32 and bfloat16)", *args, **kwargs)
    if dropout and module.training:
        return _fallback("attention dropout while training", *args, **kwargs)
    if key.stride(-1) != 1 or key.stride(-2) != key.shape[-1] or value.stride(-2) != value.shape[-1]:
        return _fallback("a cache whose keys are not contiguous rows", *args, **kwargs)
    if attention_mask is not None:
        from_model, why = packed_from_4d(attention_mask, T)
        if from_model is None:
            return _fallback(why, *args, **kwargs)
        packed = from_model if packed is None else packed  # (the keyword, where given, decides the tree's part)
    if packed is None:
        packed = causal_tree_mask(B, T, query.device)
    prefix_lens = torch.full((B,), key.shape[2] - T, dtype=torch.int64, device=query.device)
    out, _ = ops.tree_attention(query.transpose(1, 2), key, value, prefix_lens, packed, scaling)
    return out, None


def register() -> None:
    """Register ``"jakiro_tree"`` with transformers (idempotent), with SDPA's mask function under the
    same name: without one, transformers hands a custom attention no mask at all for a 2D padding
    mask, and left padding would be lost silently."""
    AttentionInterface.register(NAME, jakiro_tree_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)


def commit(cache, prefix: int, path: torch.Tensor, accepted: int, tree_tokens: int) -> None:
    """After ``verify_tree`` on a tree step of ``tree_tokens`` tokens after ``prefix`` cached ones:
    keep the accepted path's keys and values (``path`` [1, >= accepted + 1] int64 node indices, as
    ``verify_tree`` returns them) right after the prefix in every layer of a transformers
    ``DynamicCache``, and drop the rest (the cache then holds prefix + accepted + 1 tokens)."""
    if path.dim() != 2 or path.shape[0] != 1 or path.shape[1] < accepted + 1:
        raise ValueError(f"path must be [1, >= accepted + 1 = {accepted + 1}] (one sequence), got {list(path.shape)}")
    for layer in cache.layers:
        for tensor in (layer.keys, layer.values):  # [1, Hkv, prefix + tree_tokens, D], contiguous (torch.cat)
            if tensor.shape[-2] != prefix + tree_tokens:
                raise ValueError(f"the cache holds {tensor.shape[-2]} tokens, not prefix + tree = {prefix + tree_tokens}")
            ops.compact_kv(tensor, torch.tensor([prefix], device=tensor.device), path[:, : accepted + 1].to(tensor.device),
                           torch.tensor([accepted + 1], device=tensor.device))
    cache.crop(-(tree_tokens - accepted - 1))  # (transformers 5: minus the tokens to drop; 0 drops none)
