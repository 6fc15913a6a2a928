"""How a draft head runs when drafting (its inference forward's parts; training runs plain PyTorch
on the modules' own weights): the weights its products read (:func:`drafting_products`: fused,
and on the CPU bf16 where that gives the same bits), its RoPE table, its attention over the draft's
KV cache and its dense MLP."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Dict, NamedTuple, Optional, Tuple

import torch
from torch import nn

from jakiro_ext import ops
from jakiro_ext.memory import in_huge_pages
from jakiro_ext.models.rope import RopeTable
from jakiro_ext.models.weights import bf16_weights_enabled, exactly_bf16
from jakiro_ext.ops import quantized

if TYPE_CHECKING:  # annotations only
    from jakiro_ext.kv_cache import KVCache, TreeKV


class LayerProducts(NamedTuple):
    """What drafting's products of one serial layer read (:meth:`DraftHead.products`): its
    ``[q | k | v]`` projections as one weight, ``o`` and, with a dense MLP, ``[gate | up]`` as one
    weight and ``down`` (None with experts)."""
    qkv: torch.Tensor
    o: torch.Tensor
    gate_up: Optional[torch.Tensor]
    down: Optional[torch.Tensor]


class Products(NamedTuple):
    """:meth:`DraftHead.products`: ``fc``'s weight, each serial layer's :class:`LayerProducts`
    by the module holding its weights (``id``: the head itself for layer 0, then ``layers[i]``),
    the LM head rows the draft's top-k pass reads and, with experts, ``(w_gate, w_up, w_down)`` as
    ``jakiro::moe_top2`` reads them."""
    fc: torch.Tensor
    layers: Dict[int, LayerProducts]
    lm_head: Optional[torch.Tensor]  # (None: the head is not bound to a target)
    experts: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None


def rounded_draft_lm_head_enabled() -> bool:
    """Whether a float32 draft on the CPU reads its LM head rows packed (Q8_0) or in bf16, not in
    float32 (:meth:`DraftHead.products`): the CPU kernels run the ops (not the GPU kernels'
    emulation) and ``JAKIRO_CPU_BF16_DRAFT_LM_HEAD`` is not ``0``."""
    return os.environ.get("JAKIRO_CPU_BF16_DRAFT_LM_HEAD") != "0" and ops.backend() == "native"


# A serial layer's projections, in the order LayerProducts concatenates them (the MLP's: dense only).
_PRODUCT_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def drafting_products(head) -> Products:
    """What drafting's products read instead of the modules' weights, made on the first forward
    and made again when a weight changes (its version or storage). Each serial layer's ``[q | k |
    v]`` and (a dense MLP) ``[gate | up]`` projections are one weight, read in one pass by one
    call (each output column computed as from its own weight). On the CPU, where every one of
    them, ``fc`` and the experts are exactly bf16 values in a float32 head (the shipped heads are
    stored in bf16), they are bf16 copies, which the products widen in registers: the same bits
    (an expert's products for fewer than 16 rows; more go to BLAS in float32), half the bytes
    (``JAKIRO_CPU_BF16_WEIGHTS=0``: float32). A float32 draft on the CPU reads its LM head
    rows in packed Q8_0 blocks, the features quantized per row as a quantized target's are (0.27x
    float32's bytes): beside a quantized target (a GGUF file's) the target's own blocks, else its
    rows quantized as GGML does, here; bf16 rows where the draft vocabulary is not a multiple of
    16 rows or a row is not finite (which drafting then reports), float32 with
    ``JAKIRO_CPU_BF16_DRAFT_LM_HEAD=0``. The draft's scores are then those of rounded weights,
    which changes which tokens are drafted at most where two candidates tie within the rounding,
    never the tokens emitted (the target's verification decides them); beside the float32 default
    model, the shipped Jakiro head's Q8_0 rows against bf16 ones: drafting 0.33-0.43 ms a round
    faster, tau 1.896 -> 1.891, 1.6-1.7% more tokens/s (docs/benchmarks.md)."""
    # (Read from the modules' dicts, not through nn.Module's attribute lookup: this runs every forward.)
    serial = head._modules.get("layers")
    modules = [head] + (list(serial._modules.values()) if serial is not None else [])
    own = {id(m): [m._modules[name]._parameters["weight"] for name in _PRODUCT_NAMES if name in m._modules]
           for m in modules}
    fc_weight, lm_head = head._modules["fc"]._parameters["weight"], head.__dict__["lm_head_weight"]
    experts = [head._parameters[name] for name in ("w_gate", "w_up", "w_down") if head._parameters.get(name) is not None]
    sources = [fc_weight] + [w for ws in own.values() for w in ws] + experts
    settings = (bf16_weights_enabled(), rounded_draft_lm_head_enabled())
    key = [settings] + [(t.data_ptr(), t._version) for t in sources + ([] if lm_head is None else [lm_head])]
    kept = head.__dict__.get("_products")
    if kept is not None and kept[0] == key:
        return kept[1]
    cpu32 = fc_weight.device.type == "cpu" and fc_weight.dtype == torch.float32
    as_bf16 = cpu32 and settings[0] and all(exactly_bf16(w) for w in sources)
    with torch.no_grad():
        fc = fc_weight.detach()
        layers = {}
        for m in modules:
            w = [t.detach() for t in own[id(m)]]  # q, k, v, o (, gate, up, down)
            layers[id(m)] = LayerProducts(torch.cat(w[:3]), w[3], torch.cat(w[4:6]) if len(w) > 4 else None,
                                          w[6] if len(w) > 4 else None)
        packed = head.__dict__.get("packed_lm_head")
        if lm_head is not None and cpu32 and settings[1]:  # a quantized target's own rows, else Q8_0 or bf16 ones
            if packed is None and lm_head.shape[0] % quantized.LANES == 0 and bool(torch.isfinite(lm_head).all()):
                packed = in_huge_pages([quantized.from_float(lm_head, "Q8_0")])[0]
            lm_head = packed if packed is not None else in_huge_pages([lm_head.bfloat16()])[0]
        experts = [w.detach() for w in experts]
        if as_bf16:
            flat = [fc] + [t for p in layers.values() for t in p if t is not None] + experts
            copies = iter(in_huge_pages([t.bfloat16() for t in flat]))
            fc = next(copies)
            layers = {k: LayerProducts(*(None if t is None else next(copies) for t in p)) for k, p in layers.items()}
            experts = list(copies)
    made = Products(fc, layers, lm_head, tuple(experts) if experts else None)
    head.__dict__["_products"] = (key, made)
    return made


def rope(head, positions: torch.Tensor, capacity: int, dtype: torch.dtype):
    """cos, sin [B, T, D] at positions [B, T] (< capacity), from the head's :class:`RopeTable`."""
    table = head.__dict__.get("_rope_table")
    if table is None:
        table = head.__dict__["_rope_table"] = RopeTable(head.config.head_dim, head.config.rope_theta)
    return table(positions, capacity, dtype)


def attention(head, x: torch.Tensor, positions: torch.Tensor, cache: "KVCache", tree_mask: torch.Tensor,
              ancestors: Optional["TreeKV"], layer: int = 0, weights: Optional[nn.Module] = None,
              products: Optional[Products] = None) -> torch.Tensor:
    """Layer ``layer``'s attention from x [B, T, *] (the projections of ``weights``, default the
    head's own, as ``products`` holds them): k and v written after each sequence's prefix, the
    prefix, the new rows of ``tree_mask`` and the tree ancestors attended; returns o_proj of the
    output [B, T, H]."""
    c = head.config
    w = (products or drafting_products(head)).layers[id(head if weights is None else weights)]
    B, T = x.shape[:2]
    qkv = ops.linear(x, w.qkv).view(B, T, c.num_heads + 2 * c.num_kv_heads, c.head_dim)
    cache.reserve(max(cache.host_lengths) + T)
    cos, sin = rope(head, positions, cache.capacity, x.dtype)
    q = ops.rope_kv_write(qkv, cos, sin, cache.kv[layer], cache.lengths)  # k and v at lengths + t
    out, lse = ops.tree_attention(q, cache.kv[layer, 0], cache.kv[layer, 1], cache.lengths, tree_mask)
    if ancestors is not None and ancestors.keys:
        out = ancestors.merge_into(q, out, lse, layer)
    return ops.linear(out.reshape(B, T, -1), w.o)


def mlp(head, x: torch.Tensor, weights: Optional[nn.Module] = None, products: Optional[Products] = None) -> torch.Tensor:
    """The dense SwiGLU MLP of ``weights`` (default the head's own): ``[gate | up]`` in one product,
    ``jakiro::silu_mul``, then down."""
    w = (products or drafting_products(head)).layers[id(head if weights is None else weights)]
    return ops.linear(ops.silu_mul(ops.linear(x, w.gate_up)), w.down)
