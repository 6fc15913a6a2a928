"""A decoder layer's ops: ``linear``, ``dequantize_rows`` (a quantized embedding's lookup: ``embedding``),
``silu_mul``, ``rms_norm``, ``rope_kv_write``, and the layer
(``decoder_layer``) and a model's layers (``decoder_layers``) in one call."""
from __future__ import annotations

import torch

from jakiro_ext.ops import quantized
from jakiro_ext.ops.backends import kernel, same_device
from jakiro_ext.ops.library import compiled_available


def linear(x, weight, bias=None):
    """y = x @ weight.T (+ bias), like ``torch.nn.functional.linear``. x [..., K]; weight [N, K];
    bias [N] or None; one dtype (float32 or bfloat16), or on the CPU a bfloat16 weight beside a
    float32 x (widened exactly: the bits of the same weight in float32) or a packed quantized weight
    (:mod:`jakiro_ext.ops.quantized`: x's rows quantized as GGML's, integer products). At decoding and tree-verification sizes
    (up to 64 rows) the weight is streamed once and each row is computed in the same order
    whatever the number of rows; more rows go to BLAS. Accumulates in float32."""
    return kernel("linear")(x, weight, bias)


def dequantize_rows(packed, rows):
    """Rows ``rows`` (int64, any shape) of a packed quantized weight [N / 16, K / 32, 16 B]
    (:mod:`jakiro_ext.ops.quantized`), dequantized as GGML does (d (c - offset), or d c + m for
    Q4_1): float32 [*rows.shape, K]. A quantized embedding table's lookup: only the rows' bytes read."""
    return kernel("dequantize_rows")(packed, rows)


def embedding(table, tokens):
    """Rows ``tokens`` of an embedding table [V, H]: dense (``torch.nn.functional.embedding``) or
    packed quantized (:func:`dequantize_rows`: only the rows' bytes read and dequantized)."""
    if quantized.is_packed(table):
        return dequantize_rows(table, tokens.long())  # (int32 tokens too, as torch's embedding takes them)
    return torch.nn.functional.embedding(tokens, table)


def silu_mul(gate_up):
    """SwiGLU's activation of a fused projection gate_up [..., 2 I] ([gate | up] halves):
    ``SiLU(gate) * up`` in float32, rounded once to gate_up's dtype (float32 or bfloat16); [..., I]."""
    return kernel("silu_mul")(gate_up)


def rms_norm(x, weight, eps: float, residual=None):
    """RMSNorm with the residual add fused: s = x + residual (or x), out = RMSNorm(s) * weight
    computed as the Llama checkpoints' code does (the add in x's dtype, the norm in float32,
    rounded to x's dtype, then times weight). x, residual [..., H]; weight [H]; one dtype
    (float32 or bfloat16). Returns (out, s): the layer input and the new residual stream."""
    return kernel("rms_norm")(x, weight, eps, residual)


def rope_kv_write(qkv, cos, sin, kv_cache, lengths):
    """The attention block's glue in one call: RoPE (rotate-half layout, rounded as the eager
    ``x * cos + rotate_half(x) * sin``) of the q and k heads of a fused projection qkv
    [B, T, Hq + 2 Hkv, D]; the rotated k and the v heads written into kv_cache [2, B, Hkv, S, D]
    at slots lengths[b] + t (in place); returns the rotated q [B, T, Hq, D]. cos, sin [B, T, D]."""
    return kernel("rope_kv_write")(qkv, cos, sin, kv_cache, lengths)


def decoder_layer(delta, residual, input_norm, qkv_weight, qkv_bias, o_weight, post_norm, gate_up_weight,
                  down_weight, cos, sin, kv_cache, lengths, tree_mask, eps: float):
    """One Llama decoder layer (RMSNorm, GQA attention over a KV cache with a tree mask, RMSNorm,
    SwiGLU MLP) over T new tokens per sequence, in one call: the composition of this module's
    ``rms_norm``, ``linear``, ``rope_kv_write``, ``tree_attention`` and ``silu_mul``, with no Python
    or dispatch between them.

    The residual stream entering the layer is ``residual + delta`` (``residual`` None before the
    first layer, where the stream is ``delta``); returns the pair ``(residual, delta)`` leaving it,
    the add fused into the next layer's norm. delta [B, T, H]; input_norm, post_norm [H];
    qkv_weight [(Hq + 2 Hkv) D, H] ([q | k | v] rows) and qkv_bias [(Hq + 2 Hkv) D] or None;
    o_weight [H, Hq D]; gate_up_weight [2 I, H] ([gate | up] rows); down_weight [H, I]; cos, sin
    [B, T, D] (the rotary table at each token's position); kv_cache [2, B, Hkv, S, D], written at
    slots lengths[b] + t (in place); lengths [B] int64; tree_mask [B, T, ceil(T / 64)] (see
    ``tree_attention``). One dtype (float32 or bfloat16), or on the CPU the four projection weights
    in bfloat16 beside float32 rows (as ``linear`` takes them)."""
    return kernel("decoder_layer")(delta, residual, input_norm, qkv_weight, qkv_bias, o_weight, post_norm,
                                    gate_up_weight, down_weight, cos, sin, kv_cache, lengths, tree_mask, eps)


def decoder_layers(delta, residual, input_norms, qkv_weights, qkv_biases, o_weights, post_norms, gate_up_weights,
                   down_weights, cos, sin, kv_cache, lengths, tree_mask, eps: float):
    """:func:`decoder_layer` applied to L layers in turn, the residual stream passed from each to
    the next: layer l takes the l-th tensor of each list (``qkv_biases``: one per layer, or empty
    for none) and ``kv_cache[l]`` (kv_cache [L, 2, B, Hkv, S, D]). Returns the last layer's
    ``(residual, delta)``. One call for a model's layers: on the CPU, where a layer runs as one
    parallel region, all of them run in one (nothing returns to Python, and no thread waits for
    another region, between two layers); the same bits as the layers called one by one."""
    return kernel("decoder_layers")(delta, residual, input_norms, qkv_weights, qkv_biases, o_weights, post_norms,
                                     gate_up_weights, down_weights, cos, sin, kv_cache, lengths, tree_mask, eps)


if compiled_available():  # the fakes (meta implementations), beside their ops
    @torch.library.register_fake("jakiro::linear")
    def _linear_fake(x, weight, bias=None):
        same_device("linear", x=x, weight=weight, bias=bias)
        return x.new_empty((*x.shape[:-1], weight.shape[0] * (quantized.LANES if quantized.is_packed(weight) else 1)))

    @torch.library.register_fake("jakiro::dequantize_rows")
    def _dequantize_rows_fake(packed, rows):
        same_device("dequantize_rows", packed=packed, rows=rows)
        return packed.new_empty((*rows.shape, quantized.matrix_shape(packed)[1]), dtype=torch.float32)

    @torch.library.register_fake("jakiro::silu_mul")
    def _silu_mul_fake(gate_up):
        return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))

    @torch.library.register_fake("jakiro::rms_norm")
    def _rms_norm_fake(x, weight, eps, residual=None):
        same_device("rms_norm", x=x, weight=weight, residual=residual)
        return x.new_empty(x.shape), x.new_empty(x.shape)

    @torch.library.register_fake("jakiro::rope_kv_write")
    def _rope_kv_write_fake(qkv, cos, sin, kv_cache, lengths):
        same_device("rope_kv_write", qkv=qkv, cos=cos, sin=sin, kv_cache=kv_cache, lengths=lengths)
        B, T, H, D = qkv.shape
        return qkv.new_empty((B, T, H - 2 * kv_cache.shape[2], D))

    @torch.library.register_fake("jakiro::decoder_layer")
    def _decoder_layer_fake(delta, residual, input_norm, qkv_weight, qkv_bias, o_weight, post_norm, gate_up_weight,
                            down_weight, cos, sin, kv_cache, lengths, tree_mask, eps):
        same_device("decoder_layer", delta=delta, residual=residual, input_norm=input_norm, qkv_weight=qkv_weight,
                     qkv_bias=qkv_bias, o_weight=o_weight, post_norm=post_norm, gate_up_weight=gate_up_weight,
                     down_weight=down_weight, cos=cos, sin=sin, kv_cache=kv_cache, lengths=lengths, tree_mask=tree_mask)
        return delta.new_empty(delta.shape), delta.new_empty(delta.shape)

    @torch.library.register_fake("jakiro::decoder_layers")
    def _decoder_layers_fake(delta, residual, input_norms, qkv_weights, qkv_biases, o_weights, post_norms,
                             gate_up_weights, down_weights, cos, sin, kv_cache, lengths, tree_mask, eps):
        lists = dict(input_norms=input_norms, qkv_weights=qkv_weights, qkv_biases=qkv_biases, o_weights=o_weights,
                     post_norms=post_norms, gate_up_weights=gate_up_weights, down_weights=down_weights)
        same_device("decoder_layers", delta=delta, residual=residual, cos=cos, sin=sin, kv_cache=kv_cache,
                     lengths=lengths, tree_mask=tree_mask,
                     **{f"{name}[{i}]": t for name, ts in lists.items() for i, t in enumerate(ts)})
        return delta.new_empty(delta.shape), delta.new_empty(delta.shape)
