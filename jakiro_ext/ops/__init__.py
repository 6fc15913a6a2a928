"""The fused ops of ``torch.ops.jakiro``: loading, fake (meta) implementations, and thin
Python entry points with their shapes documented.

Every op's pure-PyTorch specification is in :mod:`jakiro_ext.ops.reference` under the same name.
If the compiled library cannot be loaded, importing still works (so ``python -m jakiro_ext
show-config`` can say why), but calling an op raises, unless ``JAKIRO_USE_REFERENCE=1``
explicitly selects the (slower) reference implementations.
"""
from __future__ import annotations

import contextlib
import contextvars
import os
import warnings
from typing import Optional

import torch

from jakiro_ext.ops import emulator, reference

LOAD_ERROR: Optional[str] = None
try:
    from jakiro_ext import _C  # noqa: F401  (registers torch.ops.jakiro.*)

    if _C.torch_version.split("+")[0] != torch.__version__.split("+")[0]:
        LOAD_ERROR = (f"jakiro_ext was built against torch {_C.torch_version} but torch {torch.__version__} "
                      "is running; reinstall it: pip install --no-build-isolation .")
except ImportError as exc:  # pragma: no cover - exercised only on broken installs
    _C = None
    LOAD_ERROR = f"the compiled library jakiro_ext._C could not be loaded: {exc}"

if LOAD_ERROR is None:
    _C.cpu_weight_stream()  # a bad JAKIRO_CPU_WEIGHT_STREAM is a ValueError here, not in a product's worker

USE_REFERENCE = os.environ.get("JAKIRO_USE_REFERENCE", "") == "1"
if LOAD_ERROR and USE_REFERENCE:
    warnings.warn(f"{LOAD_ERROR}. JAKIRO_USE_REFERENCE=1: using the pure-PyTorch reference ops (slow).")

OP_NAMES = (
    "tree_attention",
    "tree_attention_partial",
    "merge_attention_states",
    "moe_top2",
    "contrastive_topk",
    "linear",
    "silu_mul",
    "decoder_layer",
    "decoder_layers",
    "mlp_heads",
    "rms_norm",
    "rope_kv_write",
    "verify_tree",
    "compact_kv",
    "device_errors",
)


def compiled_available() -> bool:
    return LOAD_ERROR is None


def cpu_avx512() -> bool:
    """Whether float32 products on the CPU (``linear``) run on 512-bit vectors (AVX-512, detected at
    run time; ``JAKIRO_CPU_AVX512=0`` turns them off, and with them native bf16) rather than 256-bit."""
    return bool(_C.cpu_avx512()) if LOAD_ERROR is None else False


def cpu_bf16_dot() -> bool:
    """Whether bf16 products on the CPU use the CPU's native bf16 dot instructions (AVX512-BF16,
    detected at run time; ``JAKIRO_CPU_BF16_DOT=0`` or ``JAKIRO_CPU_AVX512=0`` turns them off) rather
    than widening to fp32."""
    return bool(_C.cpu_bf16_dot()) if LOAD_ERROR is None else False


def cpu_onednn() -> bool:
    """Whether a prompt's float32 products on the CPU (``linear`` beyond 64 rows of one sequence)
    go to torch's oneDNN (``mkldnn::_linear_pointwise``, where torch has it; ``JAKIRO_CPU_ONEDNN=0``
    turns it off) rather than ATen's linear (MKL)."""
    return bool(_C.cpu_onednn()) if LOAD_ERROR is None else False


def cpu_weight_stream() -> str:
    """How the CPU's 512-bit products read a weight, as measured best on each kind of CPU and
    chosen for this one at run time: ``"zen5"`` (AMD Zen 5 and later: up to 5 token rows a weight
    row at a time, one stream, 4 KB ahead), ``"zen4"`` (earlier AMD CPUs: one row so, 2 x 8 float32
    tiles beyond) or ``"intel"`` (4 x 6 tiles, the next tile asked for over the passes of many
    rows); ``JAKIRO_CPU_WEIGHT_STREAM`` names one instead. Every one gives the same bits."""
    return str(_C.cpu_weight_stream()) if LOAD_ERROR is None else "none"


BACKENDS = ("native", "simt32", "simt64")
_emulated = contextvars.ContextVar("jakiro_emulated_backend", default=None)  # (name, op namespace)


@contextlib.contextmanager
def use_backend(name: str):
    """Within the block, every op of the package (and so the models and ``speculative_generate``)
    runs on the given backend: ``"native"`` the compiled library's kernels for the tensors' device
    (the default), ``"simt32"`` / ``"simt64"`` the GPU kernels of ``csrc/cuda`` run on the CPU by
    the SIMT emulator with warps of 32 / 64 lanes (CPU tensors; slow, for checking and debugging GPU
    kernels without a GPU). The emulated library is built the first time (a few minutes, cached:
    :mod:`jakiro_ext.ops.emulator`). Blocks nest; the setting is per thread and per asyncio task."""
    if name not in BACKENDS:
        raise ValueError(f"use_backend: the backend must be one of {BACKENDS}, got {name!r}")
    if name == "native":
        token = _emulated.set(None)
    else:
        token = _emulated.set((name, emulator.emulated_ops(int(name.removeprefix("simt")))))
    try:
        yield
    finally:
        _emulated.reset(token)


def backend() -> str:
    """The backend the ops run on here (see :func:`use_backend`)."""
    chosen = _emulated.get()
    return "native" if chosen is None else chosen[0]


def _kernel(name: str):
    chosen = _emulated.get()
    if chosen is not None:
        return getattr(chosen[1], name)
    if LOAD_ERROR is None:
        return getattr(torch.ops.jakiro, name)
    if USE_REFERENCE:
        return getattr(reference, name)
    raise RuntimeError(f"{LOAD_ERROR}. Set JAKIRO_USE_REFERENCE=1 to run the pure-PyTorch reference ops instead.")


# ----------------------------------------------------------------------------- fakes
def _same_device(op: str, **tensors) -> None:
    """The kernels' device check, for the fakes: a meta tensor among CPU ones dispatches here
    (Meta outranks CPU), and must be an error, not an uninitialised CPU result."""
    given = {name: t.device for name, t in tensors.items() if isinstance(t, torch.Tensor)}
    if len(set(given.values())) > 1:
        listed = ", ".join(f"{name} on {device}" for name, device in given.items())
        raise RuntimeError(f"jakiro::{op}: every tensor must be on one device, got {listed}")


if LOAD_ERROR is None:

    @torch.library.register_fake("jakiro::tree_attention_partial")
    def _tree_attention_partial_fake(q, k_cache, v_cache, prefix_lens, tree_mask, num_splits, scale=None):
        _same_device("tree_attention_partial", q=q, k_cache=k_cache, v_cache=v_cache, prefix_lens=prefix_lens, tree_mask=tree_mask)
        B, T, H, D = q.shape
        return (q.new_empty((B, T, H, num_splits, D), dtype=torch.float32),
                q.new_empty((B, T, H, num_splits), dtype=torch.float32))

    @torch.library.register_fake("jakiro::merge_attention_states")
    def _merge_attention_states_fake(out_partial, lse_partial, out_dtype=None):
        _same_device("merge_attention_states", out_partial=out_partial, lse_partial=lse_partial)
        B, T, H, _, D = out_partial.shape
        return (out_partial.new_empty((B, T, H, D), dtype=out_dtype or torch.float32),
                out_partial.new_empty((B, T, H), dtype=torch.float32))

    @torch.library.register_fake("jakiro::tree_attention")
    def _tree_attention_fake(q, k_cache, v_cache, prefix_lens, tree_mask, scale=None, num_splits=None):
        _same_device("tree_attention", q=q, k_cache=k_cache, v_cache=v_cache, prefix_lens=prefix_lens, tree_mask=tree_mask)
        B, T, H, _ = q.shape
        return q.new_empty(q.shape), q.new_empty((B, T, H), dtype=torch.float32)

    @torch.library.register_fake("jakiro::moe_top2")
    def _moe_top2_fake(x, router_weight, w_gate, w_up, w_down, renormalize=False):
        _same_device("moe_top2", x=x, router_weight=router_weight, w_gate=w_gate, w_up=w_up, w_down=w_down)
        lead = x.shape[:-1]
        return (x.new_empty(x.shape), x.new_empty((*lead, 2, x.shape[-1])),
                x.new_empty((*lead, 2), dtype=torch.int64), x.new_empty((*lead, 2), dtype=torch.float32),
                x.new_empty((*lead, 2), dtype=torch.float32))

    @torch.library.register_fake("jakiro::contrastive_topk")
    def _contrastive_topk_fake(h_a, h_b, contrast_weight, lm_head, k):
        _same_device("contrastive_topk", h_a=h_a, h_b=h_b, contrast_weight=contrast_weight, lm_head=lm_head)
        lead = h_a.shape[:-1]
        return h_a.new_empty((*lead, k), dtype=torch.float32), h_a.new_empty((*lead, k), dtype=torch.int64)

    @torch.library.register_fake("jakiro::linear")
    def _linear_fake(x, weight, bias=None):
        _same_device("linear", x=x, weight=weight, bias=bias)
        return x.new_empty((*x.shape[:-1], weight.shape[0]))

    @torch.library.register_fake("jakiro::mlp_heads")
    def _mlp_heads_fake(x, w_in, b_in, w_blocks, b_blocks):
        _same_device("mlp_heads", x=x, w_in=w_in, b_in=b_in, w_blocks=w_blocks, b_blocks=b_blocks)
        return x.new_empty((*x.shape[:-1], w_in.shape[0], w_in.shape[1]))

    @torch.library.register_fake("jakiro::rms_norm")
    def _rms_norm_fake(x, weight, eps, residual=None):
        _same_device("rms_norm", x=x, weight=weight, residual=residual)
        return x.new_empty(x.shape), x.new_empty(x.shape)

    @torch.library.register_fake("jakiro::rope_kv_write")
    def _rope_kv_write_fake(qkv, cos, sin, kv_cache, lengths):
        _same_device("rope_kv_write", qkv=qkv, cos=cos, sin=sin, kv_cache=kv_cache, lengths=lengths)
        B, T, H, D = qkv.shape
        return qkv.new_empty((B, T, H - 2 * kv_cache.shape[2], D))

    @torch.library.register_fake("jakiro::silu_mul")
    def _silu_mul_fake(gate_up):
        return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))

    @torch.library.register_fake("jakiro::decoder_layer")
    def _decoder_layer_fake(delta, residual, input_norm, qkv_weight, qkv_bias, o_weight, post_norm, gate_up_weight,
                            down_weight, cos, sin, kv_cache, lengths, tree_mask, eps):
        _same_device("decoder_layer", delta=delta, residual=residual, input_norm=input_norm, qkv_weight=qkv_weight,
                     qkv_bias=qkv_bias, o_weight=o_weight, post_norm=post_norm, gate_up_weight=gate_up_weight,
                     down_weight=down_weight, cos=cos, sin=sin, kv_cache=kv_cache, lengths=lengths, tree_mask=tree_mask)
        return delta.new_empty(delta.shape), delta.new_empty(delta.shape)

    @torch.library.register_fake("jakiro::decoder_layers")
    def _decoder_layers_fake(delta, residual, input_norms, qkv_weights, qkv_biases, o_weights, post_norms,
                             gate_up_weights, down_weights, cos, sin, kv_cache, lengths, tree_mask, eps):
        lists = dict(input_norms=input_norms, qkv_weights=qkv_weights, qkv_biases=qkv_biases, o_weights=o_weights,
                     post_norms=post_norms, gate_up_weights=gate_up_weights, down_weights=down_weights)
        _same_device("decoder_layers", delta=delta, residual=residual, cos=cos, sin=sin, kv_cache=kv_cache,
                     lengths=lengths, tree_mask=tree_mask,
                     **{f"{name}[{i}]": t for name, ts in lists.items() for i, t in enumerate(ts)})
        return delta.new_empty(delta.shape), delta.new_empty(delta.shape)

    @torch.library.register_fake("jakiro::verify_tree")
    def _verify_tree_fake(parents, draft_tokens, target_logits, uniforms=None, temperature=0.0, top_p=1.0, top_k=0):
        _same_device("verify_tree", parents=parents, draft_tokens=draft_tokens, target_logits=target_logits, uniforms=uniforms)
        B = parents.shape[0]
        return parents.new_empty(parents.shape), parents.new_empty((B,)), parents.new_empty((B,))

    @torch.library.register_fake("jakiro::device_errors")
    def _device_errors_fake(like):
        return like.new_empty((1,), dtype=torch.int32)

    @torch.library.register_fake("jakiro::compact_kv")
    def _compact_kv_fake(cache, prefix_lens, path, path_len):
        _same_device("compact_kv", cache=cache, prefix_lens=prefix_lens, path=path, path_len=path_len)
        return None


# ----------------------------------------------------------------------------- entry points
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
    return _kernel("tree_attention")(q, k_cache, v_cache, prefix_lens, tree_mask, scale, num_splits)


def tree_attention_partial(q, k_cache, v_cache, prefix_lens, tree_mask, num_splits: int,
                           scale: Optional[float] = None):
    """The split half of :func:`tree_attention`. Sequence b's KV (length prefix_lens[b] + T) is cut
    into ``num_splits`` chunks of ceil(len / num_splits) keys; returns per chunk the normalised
    output ``out_partial`` [B, T, Hq, splits, D] and its log-sum-exp ``lse_partial`` [B, T, Hq, splits]
    (float32; an empty chunk gives 0 and -inf)."""
    return _kernel("tree_attention_partial")(q, k_cache, v_cache, prefix_lens, tree_mask, num_splits, scale)


def merge_attention_states(out_partial, lse_partial, out_dtype: Optional[torch.dtype] = None):
    """Merge partial attention states [B, T, H, S, D] / [B, T, H, S] over S by their log-sum-exp.
    Returns out [B, T, H, D] (``out_dtype``, default float32) and lse [B, T, H] float32."""
    return _kernel("merge_attention_states")(out_partial, lse_partial, out_dtype)


def moe_top2(x, router_weight, w_gate, w_up, w_down, renormalize: bool = False):
    """Jakiro's MoE block. x [..., H]; router_weight [N + 2, H]; w_gate, w_up [N, I, H];
    w_down [N, H, I]; all one dtype. Routing: softmax over the first N router logits, top-2
    (scores renormalised to sum 1 if ``renormalize``); the last 2 logits give the contrastive
    weights (their softmax, larger first).

    Returns out [..., H] = x + s_0 * h_0 + s_1 * h_1, expert_out [..., 2, H] = (h_0, h_1) the
    selected experts' SwiGLU outputs (higher score first), expert_idx [..., 2] int64,
    expert_score [..., 2] float32 and contrast_weight [..., 2] float32 = (w_hi, w_lo)."""
    return _kernel("moe_top2")(x, router_weight, w_gate, w_up, w_down, renormalize)


def contrastive_topk(h_a, h_b, contrast_weight, lm_head, k: int):
    """Top-k tokens of log_softmax(f @ lm_head.T) with f = w_hi * h_a - w_lo * h_b when ``h_b``
    and ``contrast_weight`` [..., 2] = (w_hi, w_lo) are given, or f = h_a when both are None
    (the MoE branch). h_a, h_b [..., H]; lm_head [V, H]. Returns logprobs [..., k] float32
    (descending) and token_ids [..., k] int64. The [..., V] logits are never materialised."""
    return _kernel("contrastive_topk")(h_a, h_b, contrast_weight, lm_head, k)


def linear(x, weight, bias=None):
    """y = x @ weight.T (+ bias), like ``torch.nn.functional.linear``. x [..., K]; weight [N, K];
    bias [N] or None; one dtype (float32 or bfloat16), or on the CPU a bfloat16 weight beside a
    float32 x (widened exactly: the bits of the same weight in float32). At decoding and tree-verification sizes
    (up to 64 rows) the weight is streamed once and each row is computed in the same order
    whatever the number of rows; more rows go to BLAS. Accumulates in float32."""
    return _kernel("linear")(x, weight, bias)


def silu_mul(gate_up):
    """SwiGLU's activation of a fused projection gate_up [..., 2 I] ([gate | up] halves):
    ``SiLU(gate) * up`` in float32, rounded once to gate_up's dtype (float32 or bfloat16); [..., I]."""
    return _kernel("silu_mul")(gate_up)


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
    return _kernel("decoder_layer")(delta, residual, input_norm, qkv_weight, qkv_bias, o_weight, post_norm,
                                    gate_up_weight, down_weight, cos, sin, kv_cache, lengths, tree_mask, eps)


def decoder_layers(delta, residual, input_norms, qkv_weights, qkv_biases, o_weights, post_norms, gate_up_weights,
                   down_weights, cos, sin, kv_cache, lengths, tree_mask, eps: float):
    """:func:`decoder_layer` applied to L layers in turn, the residual stream passed from each to
    the next: layer l takes the l-th tensor of each list (``qkv_biases``: one per layer, or empty
    for none) and ``kv_cache[l]`` (kv_cache [L, 2, B, Hkv, S, D]). Returns the last layer's
    ``(residual, delta)``. One call for a model's layers: on the CPU, where a layer runs as one
    parallel region, all of them run in one (nothing returns to Python, and no thread waits for
    another region, between two layers); the same bits as the layers called one by one."""
    return _kernel("decoder_layers")(delta, residual, input_norms, qkv_weights, qkv_biases, o_weights, post_norms,
                                     gate_up_weights, down_weights, cos, sin, kv_cache, lengths, tree_mask, eps)


def mlp_heads(x, w_in, b_in, w_blocks, b_blocks):
    """Gumiho's J parallel MLP heads on one input x [..., K]: head j is
    ``h = SiLU(x @ w_in[j].T + b_in[j])``, then for each of the NB blocks
    ``h = h + SiLU(h @ w_blocks[j, b].T + b_blocks[j, b])``; returns [..., J, H]. w_in [J, H, K],
    b_in [J, H], w_blocks [J, NB, H, H], b_blocks [J, NB, H]; one dtype (float32 or bfloat16).
    Activations in float32, the output rounded once; each row computed alike whatever the
    number of rows. One call for every layer of every head (weights streamed once)."""
    return _kernel("mlp_heads")(x, w_in, b_in, w_blocks, b_blocks)


def rms_norm(x, weight, eps: float, residual=None):
    """RMSNorm with the residual add fused: s = x + residual (or x), out = RMSNorm(s) * weight
    computed as the Llama checkpoints' code does (the add in x's dtype, the norm in float32,
    rounded to x's dtype, then times weight). x, residual [..., H]; weight [H]; one dtype
    (float32 or bfloat16). Returns (out, s): the layer input and the new residual stream."""
    return _kernel("rms_norm")(x, weight, eps, residual)


def rope_kv_write(qkv, cos, sin, kv_cache, lengths):
    """The attention block's glue in one call: RoPE (rotate-half layout, rounded as the eager
    ``x * cos + rotate_half(x) * sin``) of the q and k heads of a fused projection qkv
    [B, T, Hq + 2 Hkv, D]; the rotated k and the v heads written into kv_cache [2, B, Hkv, S, D]
    at slots lengths[b] + t (in place); returns the rotated q [B, T, Hq, D]. cos, sin [B, T, D]."""
    return _kernel("rope_kv_write")(qkv, cos, sin, kv_cache, lengths)


def verify_tree(parents, draft_tokens, target_logits, uniforms=None, temperature: float = 0.0,
                top_p: float = 1.0, top_k: int = 0):
    """Accept the longest valid path of each draft tree.

    Parameters
    ----------
    parents : [B, T] int64, parents[b, 0] = -1 (root), 0 <= parents[b, i] < i.
    draft_tokens : [B, T] int64, the token of each node (that of the root is not tested).
    target_logits : [B, T, V], the target's logits at each node (predicting its children).
    uniforms : [B, T + 1] float64 draws in [0, 1), needed when temperature > 0: uniforms[b, i]
        decides node i's acceptance test, uniforms[b, T] the bonus token.
    temperature, top_p, top_k : 0 temperature is greedy; otherwise lossless rejection sampling
        against the target distribution filtered by temperature, top-k then top-p.

    Returns
    -------
    path : [B, T] int64, accepted node indices from the root (path[b, 0] = 0), -1 padded.
    accept_len : [B] int64, accepted draft tokens (path length - 1).
    bonus : [B] int64, the token the target adds after the accepted path.
    """
    return _kernel("verify_tree")(parents, draft_tokens, target_logits, uniforms, temperature, top_p, top_k)


def compact_kv(cache, prefix_lens, path, path_len) -> None:
    """In place: for every sequence b, copy cache entries prefix_lens[b] + path[b, j] to
    prefix_lens[b] + j for j < path_len[b]. cache [..., B, H, S, D] contiguous (e.g. all
    layers' K and V in one buffer); path [B, P] int64 increasing tree indices."""
    _kernel("compact_kv")(cache, prefix_lens, path, path_len)


# What each bit of jakiro::device_errors means (DeviceError in csrc/cuda/device.h): the value a
# GPU kernel met where the CPU op would have raised, and what the kernel did instead.
DEVICE_ERRORS = {
    1: "jakiro::tree_attention: prefix_lens[b] + tree tokens beyond [0, cache capacity] (no key was read)",
    2: "jakiro::rope_kv_write: lengths[b] + new tokens beyond [0, cache capacity] (k and v were not written)",
    4: "jakiro::compact_kv: prefix_lens, path_len or path out of range, or path not strictly increasing "
       "(the sequence's entries were not moved)",
    8: "jakiro::verify_tree: parents are not a tree in topological order (parents[b, 0] = -1, "
       "0 <= parents[b, i] < i)",
    16: "jakiro::verify_tree: a draft token id outside the vocabulary [0, target_logits.shape[2])",
    32: "jakiro::verify_tree: a uniform outside [0, 1)",
}


def device_errors(like: torch.Tensor) -> torch.Tensor:
    """The bad index values the GPU kernels met on ``like``'s device since the last call, as
    :data:`DEVICE_ERRORS` bits in an int32 [1] tensor on that device, read and cleared in stream
    order (no synchronisation: read it with a value the host reads anyway, and pass that to
    :func:`raise_device_errors`). Always 0 on the CPU, whose ops raise at once."""
    if not isinstance(like, torch.Tensor):
        raise TypeError(f"device_errors: like must be a tensor on the device to ask, got {type(like).__name__}")
    return _kernel("device_errors")(like)


def raise_device_errors(word: int) -> None:
    """Raise a RuntimeError naming every error of the :func:`device_errors` bits ``word`` (none: return)."""
    if word:
        found = [message for bit, message in DEVICE_ERRORS.items() if word & bit]
        unknown = word & ~sum(DEVICE_ERRORS)
        if unknown:
            found.append(f"unknown error bits {unknown:#x}")
        raise RuntimeError("the GPU kernels met bad input values: " + "; ".join(found))


def build_tree_mask(parents: torch.Tensor, check: bool = True) -> torch.Tensor:
    """Bit-packed ancestor mask [B, T, ceil(T / 64)] int64 of trees given by parents [B, T]:
    bit j of row i is set when node j is node i itself or one of its ancestors. ``check=False``
    skips :func:`check_parents` (which reads the values on the host) for trees valid by
    construction, as the engine's are."""
    if check:
        check_parents(parents)
    B, T = parents.shape
    seen = torch.zeros(B, T, T, dtype=torch.bool, device=parents.device)
    idx = torch.arange(B, device=parents.device)
    seen[:, 0, 0] = True
    for i in range(1, T):  # parents precede children, so each row extends its parent's (no host read)
        seen[:, i] = seen[idx, parents[:, i]]
        seen[:, i, i] = True
    return pack_bits(seen)


def check_parents(parents) -> None:
    """What verify_tree checks of a tree: parents [B, T] int64, T >= 1, parents[b, 0] = -1 and
    0 <= parents[b, i] < i (parents precede children). Raises ValueError naming the entry."""
    if not isinstance(parents, torch.Tensor) or parents.dim() != 2 or parents.dtype != torch.int64:
        got = f"{tuple(parents.shape)} {parents.dtype}" if isinstance(parents, torch.Tensor) else type(parents).__name__
        raise ValueError(f"build_tree_mask: parents must be a [B, T] int64 tensor, got {got}")
    B, T = parents.shape
    if T < 1:
        raise ValueError(f"build_tree_mask: a tree has at least its root (parents.shape[1] >= 1), got {tuple(parents.shape)}")
    if parents.device.type == "meta":
        return
    index = torch.arange(T, device=parents.device)
    bad = (parents >= index) | (parents < 0)
    bad[:, 0] = parents[:, 0] != -1
    if bool(bad.any()):
        b, i = (int(x) for x in bad.nonzero()[0])
        want = "-1 (node 0 is the root)" if i == 0 else f"in [0, {i}) (nodes in topological order)"
        raise ValueError(f"build_tree_mask: parents[{b}, {i}] must be {want}, got {int(parents[b, i])}")


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """Pack a bool tensor [..., N] into int64 words [..., ceil(N / 64)] (bit j of word w = bits[64 w + j])."""
    *lead, n = bits.shape
    words = (n + 63) // 64
    padded = torch.zeros(*lead, words * 64, dtype=torch.int64, device=bits.device)
    padded[..., :n] = bits.to(torch.int64)
    shifts = torch.arange(64, device=bits.device, dtype=torch.int64)
    # Summing distinct powers of two is an OR; 1 << 63 wraps to int64's minimum, as intended.
    return (padded.view(*lead, words, 64) << shifts).sum(-1)


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on ``device`` without stalling the host: on a GPU through pinned memory,
    asynchronously (a plain copy from pageable memory waits for the device's queue to drain)."""
    device = torch.device(device)
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)
