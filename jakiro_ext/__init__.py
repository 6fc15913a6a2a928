"""jakiro_ext: tree-based speculative decoding with Mixture-of-Experts draft heads (Jakiro).

``jakiro_ext.speculative_generate`` is the draft-verify loop (:mod:`jakiro_ext.engine`). The fused kernels are torch ops in the ``torch.ops.jakiro`` namespace; ``jakiro_ext.ops``
wraps them with shapes documented, ``jakiro_ext.reference`` holds their pure-PyTorch
specifications.
"""
from jakiro_ext import ops, reference
from jakiro_ext.ops import (
    build_tree_mask,
    compact_kv,
    contrastive_topk,
    linear,
    merge_attention_states,
    mlp_heads,
    moe_top2,
    rms_norm,
    rope_kv_write,
    tree_attention,
    tree_attention_partial,
    verify_tree,
)

from jakiro_ext.engine import GenerationOutput, GenerationStats, TreeConfig, generate_many, speculative_generate

__version__ = "0.1.0"

__all__ = [
    "speculative_generate",
    "generate_many",
    "GenerationOutput",
    "GenerationStats",
    "TreeConfig",
    "ops",
    "reference",
    "build_tree_mask",
    "compact_kv",
    "contrastive_topk",
    "linear",
    "merge_attention_states",
    "mlp_heads",
    "moe_top2",
    "rms_norm",
    "rope_kv_write",
    "tree_attention",
    "tree_attention_partial",
    "verify_tree",
]
