"""Cases of mlp_heads shared by its CPU tests (ops/) and GPU tests (gpu/)."""
import torch

from conftest import randn

# (leading dims of x, in features K, heads J, hidden H, blocks NB): no blocks, one head, odd
# sizes (no vector width divides them), 0 and 1..130 rows (both sides of the 64-row passes),
# the shipped head's shape.
MLP_HEADS_SHAPES = [((1,), 1, 1, 1, 0), ((3,), 17, 2, 5, 1), ((2, 5), 54, 3, 33, 2), ((1, 7), 1152, 2, 576, 5),
          ((64,), 70, 1, 37, 3), ((65,), 24, 2, 16, 1), ((2, 65), 40, 2, 24, 2), ((0,), 8, 2, 4, 1), ((4,), 0, 2, 3, 1)]


def make_mlp_heads(shape, dtype, seed=0):
    lead, K, J, H, NB = shape
    x = randn(*lead, K, seed=seed + 1, dtype=dtype)
    w_in = randn(J, H, K, seed=seed + 2, dtype=dtype, scale=max(K, 1) ** -0.5)
    b_in = randn(J, H, seed=seed + 3, dtype=dtype, scale=0.5)
    w_blocks = randn(J, NB, H, H, seed=seed + 4, dtype=dtype, scale=H**-0.5)
    b_blocks = randn(J, NB, H, seed=seed + 5, dtype=dtype, scale=0.5)
    return x, w_in, b_in, w_blocks, b_blocks


def mlp_heads_id(shape):
    lead, K, J, H, NB = shape
    return f"{'x'.join(map(str, lead))}-K{K}-J{J}-H{H}-NB{NB}"


# bf16: each layer's float32 activations against the reference's, over up to 6 layers (the GPU kernels;
# the CPU kernel is bit-exact in bf16, test_mlp_heads_matches_reference)
TOL_HEADS = {torch.float32: dict(atol=5e-5, rtol=5e-5), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


def rows_are_independent(run):
    # A sequence's draft features must not change with the batch drafted beside it.
    for dtype in (torch.float32, torch.bfloat16):
        x, *weights = make_mlp_heads(((70,), 40, 2, 24, 2), dtype, seed=7)
        full = run(x, *weights)
        for rows in (1, 2, 3, 5, 8, 9, 63, 64, 65):
            assert torch.equal(run(x[:rows], *weights), full[:rows]), (dtype, rows)
        assert torch.equal(run(x[37:38], *weights), full[37:38])
