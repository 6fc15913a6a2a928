"""moe_top2 against its reference (the loop over experts)."""
import pytest
import torch

from conftest import randn
from jakiro_ext import ops
from jakiro_ext.ops import reference
from op_cases.linear_moe import MOE_SHAPES, assert_moe_close, make_moe



@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", MOE_SHAPES, ids=lambda s: f"{'x'.join(map(str, s[0]))}-H{s[1]}-I{s[2]}-N{s[3]}")
@pytest.mark.covers("moe_top2", "adversarial_shapes")
def test_moe_top2_matches_reference(shape, dtype, renormalize):
    args = make_moe(*shape, dtype=dtype, seed=100)
    assert_moe_close(ops.moe_top2(*args, renormalize=renormalize),
                     reference.moe_top2(*args, renormalize=renormalize), dtype)


def test_moe_top2_noncontiguous_input():
    _, router, w_gate, w_up, w_down = make_moe((1,), 32, 24, 4, torch.float32, seed=11)
    for x in (randn(32, 5, 3, seed=12).transpose(0, 2), randn(6, 64, seed=13)[:, ::2]):
        assert not x.is_contiguous()
        assert_moe_close(ops.moe_top2(x, router, w_gate, w_up, w_down),
                         reference.moe_top2(x, router, w_gate, w_up, w_down), torch.float32)


def test_moe_top2_semantics():
    x, router, w_gate, w_up, w_down = make_moe((40,), 32, 24, 6, torch.float32, seed=7)
    out, expert_out, idx, score, contrast = ops.moe_top2(x, router, w_gate, w_up, w_down)
    logits = x @ router.T
    probs = torch.softmax(logits[:, :6], -1)
    assert torch.all(idx[:, 0] != idx[:, 1])
    torch.testing.assert_close(score, probs.gather(1, idx))
    assert torch.all(score[:, 0] >= score[:, 1]) and torch.all(contrast[:, 0] >= contrast[:, 1])
    torch.testing.assert_close(contrast.sum(-1), torch.ones(40))
    e = int(idx[3, 1])
    h = torch.nn.functional.silu(x[3] @ w_gate[e].T) * (x[3] @ w_up[e].T) @ w_down[e].T
    torch.testing.assert_close(expert_out[3, 1], h, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, x + (score.unsqueeze(-1) * expert_out).sum(1), atol=1e-5, rtol=1e-5)


def test_moe_top2_ties_pick_the_lower_expert_first():
    x, router, w_gate, w_up, w_down = make_moe((9,), 32, 16, 4, torch.float32, seed=8)
    router[2] = router[1]  # experts 1 and 2 always tie
    router[3] = router[1]
    router[0] = -router[1]
    _, _, idx, score, _ = ops.moe_top2(x, router, w_gate, w_up, w_down)
    _, _, r_idx, _, _ = reference.moe_top2(x, router, w_gate, w_up, w_down)
    assert torch.equal(idx, r_idx)
    positive = (x @ router[1]) > 0
    assert torch.equal(idx[positive], torch.tensor([[1, 2]]).expand(int(positive.sum()), 2))


def test_moe_routing_is_one_definition_in_the_kernel_training_and_serving():
    # route_top2 is the routing the kernel is held to; the training forward and the serving
    # class route by it, so all three pick the same experts, ties included (lower expert first).
    from jakiro_ext.serving.layers import JakiroMoE

    x, router, w_gate, w_up, w_down = make_moe((9,), 32, 16, 4, torch.float32, seed=8)
    router[2] = router[1]  # experts 1 and 2 tie in every row
    for renormalize in (False, True):
        _, _, idx, score, contrast = ops.moe_top2(x, router, w_gate, w_up, w_down, renormalize)
        r_score, r_idx, r_contrast = reference.route_top2(x @ router.T, 4, renormalize)
        assert torch.equal(idx, r_idx)
        torch.testing.assert_close(score, r_score)
        torch.testing.assert_close(contrast, r_contrast)
        block = JakiroMoE(32, 16, 4, renormalize)
        with torch.no_grad():
            block.router.copy_(router)
        weights = block.routing(x)
        assert torch.equal(weights.nonzero()[:, 1].view(-1, 2), idx.sort(-1).values)
        torch.testing.assert_close(weights.gather(1, idx), score)


def test_moe_top2_opcheck():
    args = make_moe((2, 5), 32, 24, 4, torch.float32, seed=9)
    torch.library.opcheck(torch.ops.jakiro.moe_top2.default, args + (True,))
    torch.library.opcheck(torch.ops.jakiro.moe_top2.default, args[:2] + tuple(w.bfloat16() for w in args[2:]) + (True,))


@pytest.mark.parametrize("shape", MOE_SHAPES, ids=lambda s: f"{'x'.join(map(str, s[0]))}-H{s[1]}-I{s[2]}-N{s[3]}")
@pytest.mark.covers("moe_top2", "adversarial_shapes")
def test_moe_top2_bf16_experts_beside_float32_activations(shape):
    # A bf16 checkpoint's experts read as they are (drafting's copies): the bits of the same
    # weights in float32 where the products stream the weights (fewer than 16 rows an expert),
    # the reference's results where float32 would go to BLAS; routing untouched.
    x, router, *experts = make_moe(*shape, dtype=torch.float32, seed=120)
    halves = [w.bfloat16() for w in experts]
    widened = [w.float() for w in halves]
    got = ops.moe_top2(x, router, *halves)
    assert_moe_close(got, reference.moe_top2(x, router, *halves), torch.float32)
    same = ops.moe_top2(x, router, *widened)
    assert torch.equal(got[2], same[2]) and torch.equal(got[3], same[3]) and torch.equal(got[4], same[4])
    if 2 * x[..., 0].numel() < 16:  # (every expert below cpu/gemm.h's kBlasRows)
        assert torch.equal(got[0], same[0]) and torch.equal(got[1], same[1])


def test_moe_top2_bad_input_errors():
    x, router, w_gate, w_up, w_down = make_moe((5,), 32, 24, 4, torch.float32, seed=10)
    cases = [
        ((x, router, w_gate[:1], w_up[:1], w_down[:1]), r"number of experts N \(w_gate.shape\[0\]\) must be in \[2, 8\], got 1"),
        ((x, router[:5], w_gate, w_up, w_down), r"router_weight must have shape \[N \+ 2, H\] = \[6, 32\]"),
        ((x[:, :31], router, w_gate, w_up, w_down), r"w_gate.shape\[2\] \(hidden size, as x.shape\[-1\]\) must be 31"),
        ((x, router, w_gate, w_up, w_down.transpose(1, 2)), r"w_down must have shape \[N, H, I\] = \[4, 32, 24\]"),
        ((x, router, w_gate, w_up.bfloat16(), w_down), r"w_up must have the dtype of w_gate"),
        ((x, router, w_gate.half(), w_up.half(), w_down.half()), r"w_gate must have the dtype of x"),
        ((x, router.bfloat16(), w_gate, w_up, w_down), r"router_weight must have the dtype of x"),
        ((x.bfloat16(), router.bfloat16(), w_gate, w_up, w_down), r"w_gate must have the dtype of x"),
        ((x, router, w_gate[0], w_up, w_down), r"w_gate must have 3 dimensions \[N, I, H\]"),
        ((x[:, :0], router[:, :0], w_gate[:, :, :0], w_up[:, :, :0], w_down[:, :0]), r"x must have shape \[..., H\] with H >= 1"),
    ]
    for args, message in cases:
        with pytest.raises(RuntimeError, match=message):
            ops.moe_top2(*args)
