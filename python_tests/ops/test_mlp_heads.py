"""mlp_heads (Gumiho's parallel MLP heads in one call) against its reference on the CPU kernel
(its GPU kernel: test_gpu_mlp_heads.py): adversarial shapes, row independence, opcheck, bad
input, and the draft head's differentiable twin."""
import pytest
import torch

from conftest import randn
from jakiro_ext import ops
from jakiro_ext.ops import reference
from op_cases.mlp_heads import MLP_HEADS_SHAPES, TOL_HEADS, make_mlp_heads, mlp_heads_id, rows_are_independent


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", MLP_HEADS_SHAPES, ids=mlp_heads_id)
@pytest.mark.covers("mlp_heads", "adversarial_shapes")
def test_mlp_heads_matches_reference(shape, dtype):
    args = make_mlp_heads(shape, dtype)
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



def test_mlp_heads_row_does_not_depend_on_the_other_rows():
    rows_are_independent(ops.mlp_heads)


def test_mlp_heads_noncontiguous_inputs():
    x, w_in, b_in, w_blocks, b_blocks = make_mlp_heads(((6,), 40, 2, 24, 2), torch.float32, seed=9)
    xt = x.t().contiguous().t()  # same values, transposed strides
    w_in_t = w_in.transpose(1, 2).contiguous().transpose(1, 2)
    torch.testing.assert_close(ops.mlp_heads(xt, w_in_t, b_in, w_blocks, b_blocks),
                               reference.mlp_heads(x, w_in, b_in, w_blocks, b_blocks), **TOL_HEADS[torch.float32])


def test_mlp_heads_opcheck():
    args = make_mlp_heads(((2, 3), 32, 2, 16, 2), torch.float32, seed=11)
    torch.library.opcheck(torch.ops.jakiro.mlp_heads.default, args)
    torch.library.opcheck(torch.ops.jakiro.mlp_heads.default, make_mlp_heads(((3,), 8, 1, 4, 0), torch.float32, seed=12))


def test_mlp_heads_bad_input_errors():
    x, w_in, b_in, w_blocks, b_blocks = make_mlp_heads(((3,), 32, 2, 16, 2), torch.float32, seed=13)
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
