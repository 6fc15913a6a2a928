"""Cases of tree_attention shared by its CPU tests (ops/) and GPU tests (gpu/)."""
import torch

from conftest import randn, random_parents
from jakiro_ext import ops

# (batch, tree tokens, q heads, kv heads, head dim, prefix lengths, cache capacity)
ATTENTION_SHAPES = [
    (1, 1, 1, 1, 64, [0], 1),  # smallest: one token, no prefix
    (2, 17, 9, 3, 64, [0, 97], 128),  # SmolLM2-like heads, odd tree, empty prefix in the batch
    (3, 60, 24, 3, 128, [1000, 5, 511], 1100),  # GQA 8, EAGLE-sized tree, per-sequence lengths
    (1, 5, 8, 8, 128, [4000], 4096),  # GQA 1, long prefix with a short tree
    (2, 111, 6, 2, 64, [54, 300], 420),  # tree over one 64-bit mask word, crosses key blocks
    (1, 130, 4, 4, 54, [257], 400),  # three mask words, odd head dim
    (2, 2, 6, 2, 54, [700, 33], 800),  # few query rows (streaming path), odd head dim
]


def make_inputs(B, T, Hq, Hkv, D, prefix, S, dtype, seed):
    q = randn(B, T, Hq, D, seed=seed, dtype=dtype)
    k = randn(B, Hkv, S, D, seed=seed + 1, dtype=dtype)
    v = randn(B, Hkv, S, D, seed=seed + 2, dtype=dtype)
    mask = ops.build_tree_mask(random_parents(B, T, seed=seed + 3, max_children=4))
    return q, k, v, torch.tensor(prefix, dtype=torch.int64), mask
