"""The fused ops of ``torch.ops.jakiro``: thin Python entry points with their shapes documented,
one module per family, each op's fake (meta) implementation beside it:

- :mod:`~jakiro_ext.ops.attention`: ``tree_attention``, ``tree_attention_partial``, ``merge_attention_states``;
- :mod:`~jakiro_ext.ops.layers`: ``linear``, ``dequantize_rows`` (and ``embedding``, a table's lookup, dense or
  packed), ``silu_mul``, ``rms_norm``, ``rope_kv_write``, ``decoder_layer``, ``decoder_layers``;
- :mod:`~jakiro_ext.ops.drafting`: ``moe_top2``, ``contrastive_topk``, ``mlp_heads``;
- :mod:`~jakiro_ext.ops.verification`: ``verify_tree``, ``compact_kv``, ``device_errors``;
- :mod:`~jakiro_ext.ops.masks`: the bit-packed tree masks the attention reads.

Loading the library and what it found of the CPU: :mod:`~jakiro_ext.ops.library`; which kernels
run (native, the SIMT emulator, the references): :mod:`~jakiro_ext.ops.backends`. Every op's
pure-PyTorch specification is in :mod:`jakiro_ext.ops.reference` under the same name. If the
compiled library cannot be loaded, importing still works (so ``python -m jakiro_ext show-config``
can say why), but calling an op raises, unless ``JAKIRO_USE_REFERENCE=1`` explicitly selects the
(slower) reference implementations.
"""
from jakiro_ext.ops import emulator, reference  # noqa: F401
from jakiro_ext.ops.attention import merge_attention_states, tree_attention, tree_attention_partial
from jakiro_ext.ops.backends import BACKENDS, backend, to_device, use_backend
from jakiro_ext.ops.drafting import contrastive_topk, mlp_heads, moe_top2
from jakiro_ext.ops.layers import (decoder_layer, decoder_layers, dequantize_rows, embedding, linear, rms_norm,
                                   rope_kv_write, silu_mul)
from jakiro_ext.ops.library import (LOAD_ERROR, USE_REFERENCE, compiled_available, cpu_avx512, cpu_bf16_dot,
                                    cpu_onednn, cpu_weight_stream, registered_ops, schema_version)
from jakiro_ext.ops.library import compiled as _C  # noqa: F401  (the library module; None without it)
from jakiro_ext.ops.masks import build_tree_mask, check_parents, pack_bits
from jakiro_ext.ops.verification import DEVICE_ERRORS, compact_kv, device_errors, raise_device_errors, verify_tree

OP_NAMES = registered_ops()  # the ops the library registered (csrc/op_schemas.h); empty without it

__all__ = ["BACKENDS", "DEVICE_ERRORS", "LOAD_ERROR", "OP_NAMES", "USE_REFERENCE", "backend", "build_tree_mask",
           "check_parents", "compact_kv", "compiled_available", "contrastive_topk", "cpu_avx512", "cpu_bf16_dot",
           "cpu_onednn", "cpu_weight_stream", "decoder_layer", "decoder_layers", "dequantize_rows", "device_errors",
           "embedding", "emulator", "linear", "merge_attention_states", "mlp_heads", "moe_top2", "pack_bits",
           "raise_device_errors", "reference", "registered_ops", "rms_norm", "rope_kv_write", "schema_version",
           "silu_mul", "to_device", "tree_attention", "tree_attention_partial", "use_backend", "verify_tree"]
