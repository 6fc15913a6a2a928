"""mlp_heads (Gumiho's parallel MLP heads in one call) against its reference on the CPU kernel
(its GPU kernel: test_gpu_mlp_heads.py): adversarial shapes, row independence, opcheck, bad
input, and the draft head's differentiable twin."""
import pytest
import torch

from conftest import randn
from jakiro_ext import ops
from jakiro_ext.ops import reference

# (leading dims of x, in features K, heads J, hidden H, blocks NB): no blocks, one head, odd
# sizes (no vector width divides them), 0 and 1..130 rows (both sides of the 64-row passes),
# the shipped head's shape.
SHAPES = [((1,), 1, 1, 1, 0), ((3,), 17, 2, 5, 1), ((2, 5), 54, 3, 33, 2), ((1, 7), 1152, 2, 576, 5),
          ((64,), 70, 1, 37, 3), ((65,), 24, 2, 16, 1), ((2, 65), 40, 2, 24, 2), ((0,), 8, 2, 4, 1), ((4,), 0, 2, 3, 1)]


def make(shape, dtype, seed=0):
    lead, K, J, H, NB = shape
    x = randn(*lead, K, seed=seed + 1, dtype=dtype)
    w_in = randn(J, H, K, seed=seed + 2, dtype=dtype, scale=max(K, 1) ** -0.5)
    b_in = randn(J, H, seed=seed + 3, dtype=dtype, scale=0.5)
    w_blocks = randn(J, NB, H, H, seed=seed + 4, dtype=dtype, scale=H**-0.5)
    b_blocks = randn(J, NB, H, seed=seed + 5, dtype=dtype, scale=0.5)
    return x, w_in, b_in, w_blocks, b_blocks


def ids(shape):
    lead, K, J, H, NB = shape
    return f"{'x'.join(map(str, lead))}-K{K}-J{J}-H{H}-NB{NB}"


# bf16: each layer's float32 activations against the reference's, over up to 6 layers (the GPU kernels;
# the CPU kernel is bit-exact in bf16, test_mlp_heads_matches_reference)
TOL_HEADS = {torch.float32: dict(atol=5e-5, rtol=5e-5), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=ids)
@pytest.mark.covers("mlp_heads", "adversarial_shapes")
def test_mlp_heads_matches_reference(shape, dtype):
    args = make(shape, dtype)
    got = ops.mlp_heads(*args)
    want = reference.mlp_heads(*args)
    lead, _, J, H, _ = shape
    assert got.shape == (*lead, J, H) and got.dtype == dtype
    if dtype == torch.bfloat16:
        # Both accumulate in float32 and round to bf16 once, at the end; their sums differ only in
        # the order of the float32 additions (which depends on the CPU's vector width), so an
        # element may round to the neighbouring bf16 value, never further.
        assert_within_one_bf16_step(got, want)
    else:
        torch.testing.assert_close(got, want, **TOL_HEADS[dtype])


def assert_within_one_bf16_step(got, want):
    got, want = got.float(), want.float()
    step = torch.ldexp(torch.ones_like(want), torch.frexp(want).exponent - 8)  # a bf16 step at want's magnitude
    off = (got - want).abs()
    assert bool((off <= step).all()), f"{int((off > step).sum())} elements differ by more than one bf16 step"
    assert float((off > 0).float().mean()) <= 0.01 if want.numel() else True  # and most are equal


def rows_are_independent(run):
    # A sequence's draft features must not change with the batch drafted beside it.
    for dtype in (torch.float32, torch.bfloat16):
        x, *weights = make(((70,), 40, 2, 24, 2), dtype, seed=7)
        full = run(x, *weights)
        for rows in (1, 2, 3, 5, 8, 9, 63, 64, 65):
            assert torch.equal(run(x[:rows], *weights), full[:rows]), (dtype, rows)
        assert torch.equal(run(x[37:38], *weights), full[37:38])


def test_mlp_heads_row_does_not_depend_on_the_other_rows():
    rows_are_independent(ops.mlp_heads)


def test_mlp_heads_noncontiguous_inputs():
    x, w_in, b_in, w_blocks, b_blocks = make(((6,), 40, 2, 24, 2), torch.float32, seed=9)
    xt = x.t().contiguous().t()  # same values, transposed strides
    w_in_t = w_in.transpose(1, 2).contiguous().transpose(1, 2)
    torch.testing.assert_close(ops.mlp_heads(xt, w_in_t, b_in, w_blocks, b_blocks),
                               reference.mlp_heads(x, w_in, b_in, w_blocks, b_blocks), **TOL_HEADS[torch.float32])


def test_mlp_heads_opcheck():
    args = make(((2, 3), 32, 2, 16, 2), torch.float32, seed=11)
    torch.library.opcheck(torch.ops.jakiro.mlp_heads.default, args)
    torch.library.opcheck(torch.ops.jakiro.mlp_heads.default, make(((3,), 8, 1, 4, 0), torch.float32, seed=12))


def test_mlp_heads_bad_input_errors():
    x, w_in, b_in, w_blocks, b_blocks = make(((3,), 32, 2, 16, 2), torch.float32, seed=13)
    good = dict(x=x, w_in=w_in, b_in=b_in, w_blocks=w_blocks, b_blocks=b_blocks)
    cases = [
        (dict(x=torch.tensor(1.0)), r"x must have shape \[..., K\]"),
        (dict(x=x.double()), r"x must have dtype Float or BFloat16, got Double"),
        (dict(w_in=w_in[0]), r"w_in must have 3 dimensions \[J, H, K\]"),
        (dict(w_in=w_in[:, :, :31]), r"w_in.shape\[2\] \(in features K, as x.shape\[-1\]\) must be 32, got 31"),
        (dict(b_in=b_in[:1]), r"b_in.shape\[0\] \(heads J, as w_in.shape\[0\]\) must be 2, got 1"),
        (dict(b_in=b_in[:, :15]), r"b_in.shape\[1\] \(hidden H, as w_in.shape\[1\]\) must be 16, got 15"),
        (dict(w_blocks=w_blocks[0]), r"w_blocks must have 4 dimensions \[J, NB, H, H\]"),
        (dict(w_blocks=w_blocks[:, :, :, :15]), r"w_blocks.shape\[3\] \(hidden H, as w_in.shape\[1\]\) must be 16"),
        (dict(b_blocks=b_blocks[:, :1]), r"b_blocks.shape\[1\] \(blocks NB, as w_blocks.shape\[1\]\) must be 2, got 1"),
        (dict(w_blocks=w_blocks.bfloat16()), r"w_blocks must have the dtype of x \(Float\), got BFloat16"),
        (dict(b_blocks=b_blocks.to("meta")), r"every tensor must be on one device|b_blocks must be on cpu"),
    ]
    for change, message in cases:
        with pytest.raises(RuntimeError, match=message):
            ops.mlp_heads(**{**good, **change})


def test_draft_head_mlp_heads_drafting_and_training_twins_agree():
    # DraftHead.mlp_heads: the fused op when drafting, plain PyTorch (differentiable) in training.
    from jakiro_ext.models.heads.config import DraftConfig
    from jakiro_ext.models.heads.draft_head import DraftHead
    from helpers import tiny_target

    target = tiny_target()
    head = DraftHead(DraftConfig.for_target(target.config, "gumiho")).init_weights(2, std=0.2).bind(target)
    with torch.no_grad():
        head.mlp_block_weight.normal_(0, 0.1, generator=torch.Generator().manual_seed(4))
    x = randn(2, 5, 2 * target.config.hidden_size, seed=14)
    torch.testing.assert_close(head.mlp_heads(x), head.mlp_heads(x, train=True), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(head.mlp_heads(x), reference.mlp_heads(x, head.mlp_in_weight, head.mlp_in_bias,
                                                                      head.mlp_block_weight, head.mlp_block_bias))
