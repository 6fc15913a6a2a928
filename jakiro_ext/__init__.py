"""jakiro_ext: tree-based speculative decoding with Mixture-of-Experts draft heads (Jakiro).

``speculative_generate`` and ``generate_many`` run the draft-verify loop (:mod:`jakiro_ext.engine`)
on a target (``LlamaModel``, :mod:`jakiro_ext.models`) with a draft head (``DraftHead``,
:mod:`jakiro_ext.models.heads`). The fused kernels are torch ops in the ``torch.ops.jakiro``
namespace; :mod:`jakiro_ext.ops` wraps them with shapes documented, ``jakiro_ext.ops.reference``
holds their pure-PyTorch specifications. Training lives in :mod:`jakiro_ext.training`, the
command line in :mod:`jakiro_ext.cli`.
"""
from jakiro_ext import ops
from jakiro_ext.config import TreeConfig
from jakiro_ext.engine import GenerationOutput, GenerationStats, generate_many, speculative_generate
from jakiro_ext.models import LlamaConfig, LlamaModel
from jakiro_ext.models.heads import DraftConfig, DraftHead
from jakiro_ext.ops import (build_tree_mask, compact_kv, contrastive_topk, linear, merge_attention_states, mlp_heads,
                            moe_top2, reference, rms_norm, rope_kv_write, tree_attention, tree_attention_partial,
                            verify_tree)

__version__ = "0.1.0"

__all__ = [
    "speculative_generate",
    "generate_many",
    "GenerationOutput",
    "GenerationStats",
    "TreeConfig",
    "LlamaConfig",
    "LlamaModel",
    "DraftConfig",
    "DraftHead",
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
