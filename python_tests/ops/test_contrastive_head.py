"""contrastive_topk against its reference (full logits, log_softmax, topk)."""
import pytest
import torch

from conftest import TOL, randn
from jakiro_ext import ops
from jakiro_ext.ops import quantized, reference
from op_cases.head_verify import CONTRASTIVE_SHAPES, contrast_weights
from test_quantized import FORMATS, packed_weight



@pytest.mark.parametrize("contrastive", [False, True], ids=["plain", "contrastive"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", CONTRASTIVE_SHAPES, ids=lambda s: f"{'x'.join(map(str, s[0]))}-H{s[1]}-V{s[2]}-k{s[3]}")
@pytest.mark.covers("contrastive_topk", "adversarial_shapes")
def test_contrastive_topk_matches_reference(shape, dtype, contrastive):
    lead, H, V, k = shape
    h_a = randn(*lead, H, seed=1, dtype=dtype)
    lm_head = randn(V, H, seed=2, dtype=dtype, scale=H**-0.5)
    h_b = randn(*lead, H, seed=3, dtype=dtype) if contrastive else None
    w = contrast_weights(lead, seed=4) if contrastive else None
    logprobs, ids = ops.contrastive_topk(h_a, h_b, w, lm_head, k)
    ref_logprobs, ref_ids = reference.contrastive_topk(h_a, h_b, w, lm_head, k)
    assert logprobs.shape == (*lead, k) and ids.dtype == torch.int64
    assert torch.equal(ids, ref_ids)
    # Logits are computed in float32 from the given (possibly bf16) inputs on both sides.
    torch.testing.assert_close(logprobs, ref_logprobs, atol=1e-4, rtol=1e-5)
    assert torch.all(logprobs[..., :-1] >= logprobs[..., 1:])


@pytest.mark.parametrize("contrastive", [False, True], ids=["plain", "contrastive"])
@pytest.mark.parametrize("shape", CONTRASTIVE_SHAPES, ids=lambda s: f"{'x'.join(map(str, s[0]))}-H{s[1]}-V{s[2]}-k{s[3]}")
@pytest.mark.covers("contrastive_topk", "adversarial_shapes")
def test_contrastive_topk_bf16_lm_head_beside_float32_features(shape, contrastive):
    """A bf16 LM head with float32 features (a float32 draft reading its LM head rows in bf16) is
    widened exactly: fewer than 16 feature rows (a draft's) give the bits of the same LM head in
    float32; more (float32 through BLAS) the reference's ids and close log-probabilities."""
    lead, H, V, k = shape
    h_a = randn(*lead, H, seed=1)
    lm_head = randn(V, H, seed=2, dtype=torch.bfloat16, scale=H**-0.5)
    h_b = randn(*lead, H, seed=3) if contrastive else None
    w = contrast_weights(lead, seed=4) if contrastive else None
    logprobs, ids = ops.contrastive_topk(h_a, h_b, w, lm_head, k)
    assert logprobs.dtype == torch.float32 and ids.shape == (*lead, k)
    if h_a[..., 0].numel() < 16:
        widened = ops.contrastive_topk(h_a, h_b, w, lm_head.float(), k)
        assert torch.equal(logprobs, widened[0]) and torch.equal(ids, widened[1])
    ref_logprobs, ref_ids = reference.contrastive_topk(h_a, h_b, w, lm_head, k)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(logprobs, ref_logprobs, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("contrastive", [False, True], ids=["plain", "contrastive"])
@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("shape", [((1,), 32, 16, 1), ((3,), 64, 80, 5), ((2, 9), 96, 1040, 16), ((4,), 32, 48, 48)],
                         ids=lambda s: f"{'x'.join(map(str, s[0]))}-H{s[1]}-V{s[2]}-k{s[3]}")
@pytest.mark.covers("contrastive_topk", "adversarial_shapes")
def test_contrastive_topk_with_a_packed_lm_head(shape, format, contrastive):
    """A quantized target's own LM head rows (packed): the features quantized per row and the
    integer products of ``linear``, as the specification computes them (1040 rows: two
    vocabulary chunks and a part of 16; k = V); each row's result its own, whatever the others."""
    lead, H, V, k = shape
    lm_head = packed_weight(V, H, format, seed=2)
    h_a = randn(*lead, H, seed=1)
    h_b = randn(*lead, H, seed=3) if contrastive else None
    w = contrast_weights(lead, seed=4) if contrastive else None
    logprobs, ids = ops.contrastive_topk(h_a, h_b, w, lm_head, k)
    ref_logprobs, ref_ids = reference.contrastive_topk(h_a, h_b, w, lm_head, k)
    assert logprobs.shape == (*lead, k) and torch.equal(ids, ref_ids)
    torch.testing.assert_close(logprobs, ref_logprobs, atol=1e-4, rtol=1e-5)
    first = (0,) * len(lead)
    alone = ops.contrastive_topk(h_a[first][None], None if h_b is None else h_b[first][None],
                                 None if w is None else w[first][None], lm_head, k)
    assert torch.equal(alone[0][0], logprobs[first]) and torch.equal(alone[1][0], ids[first])


def test_a_packed_lm_head_gives_the_rows_of_its_linear_op():
    lm_head = packed_weight(64, 64, "Q8_0", seed=5)
    f = randn(3, 64, seed=6)
    logprobs, ids = ops.contrastive_topk(f, None, None, lm_head, 64)
    logits = ops.linear(f, lm_head)
    assert torch.equal(ids, logits.sort(dim=-1, descending=True, stable=True).indices)
    torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1).sort(dim=-1, descending=True).values)


def test_contrastive_topk_noncontiguous_features():
    h_a = randn(40, 6, seed=17).t()  # [6, 40] with transposed strides
    h_b = randn(40, 6, seed=18).t()
    w = contrast_weights((6,), seed=19)
    lm_head = randn(300, 40, seed=20)
    got = ops.contrastive_topk(h_a, h_b, w, lm_head, 5)
    want = reference.contrastive_topk(h_a, h_b, w, lm_head, 5)
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0], want[0], atol=1e-4, rtol=1e-5)


def test_contrastive_feature_is_w_hi_h_a_minus_w_lo_h_b():
    h_a, h_b = randn(6, 40, seed=5), randn(6, 40, seed=6)
    w = contrast_weights((6,), seed=7)
    lm_head = randn(300, 40, seed=8)
    f = w[:, :1] * h_a - w[:, 1:] * h_b
    got = ops.contrastive_topk(h_a, h_b, w, lm_head, 5)
    plain = ops.contrastive_topk(f, None, None, lm_head, 5)
    assert torch.equal(got[1], plain[1])
    torch.testing.assert_close(got[0], plain[0], **TOL[torch.float32])


def test_contrastive_topk_opcheck():
    h_a, h_b = randn(2, 3, 32, seed=9), randn(2, 3, 32, seed=10)
    w = contrast_weights((2, 3), seed=11)
    lm_head = randn(200, 32, seed=12)
    torch.library.opcheck(torch.ops.jakiro.contrastive_topk.default, (h_a, h_b, w, lm_head, 4))
    torch.library.opcheck(torch.ops.jakiro.contrastive_topk.default, (h_a, None, None, lm_head, 4))
    torch.library.opcheck(torch.ops.jakiro.contrastive_topk.default, (h_a, None, None, lm_head.bfloat16(), 4))
    torch.library.opcheck(torch.ops.jakiro.contrastive_topk.default, (h_a, h_b, w, packed_weight(208, 32, "Q4_1"), 4))


def test_contrastive_topk_bad_input_errors():
    h_a, h_b = randn(3, 32, seed=13), randn(3, 32, seed=14)
    w = contrast_weights((3,), seed=15)
    lm_head = randn(100, 32, seed=16)
    packed = packed_weight(96, 32, "Q8_0")
    cases = [
        (dict(h_a=h_a, lm_head=lm_head, k=0), r"k must be in \[1, vocab size 100\], got 0"),
        (dict(h_a=h_a, lm_head=lm_head, k=101), r"k must be in \[1, vocab size 100\], got 101"),
        (dict(h_a=h_a, lm_head=lm_head[:, :31], k=3), r"lm_head.shape\[1\] \(hidden size, as h_a.shape\[-1\]\) must be 32"),
        (dict(h_a=h_a, lm_head=lm_head, k=3, h_b=h_b), r"h_b and contrast_weight go together"),
        (dict(h_a=h_a, lm_head=lm_head, k=3, h_b=h_b[:2], contrast_weight=w), r"h_b must have the shape of h_a"),
        (dict(h_a=h_a, lm_head=lm_head, k=3, h_b=h_b, contrast_weight=w[:, :1]), r"contrast_weight must have shape"),
        (dict(h_a=h_a.bfloat16(), lm_head=lm_head, k=3), r"lm_head must have the dtype of h_a \(BFloat16\), got Float"),
        (dict(h_a=h_a, lm_head=lm_head.half(), k=3), r"lm_head must have the dtype of h_a \(Float\), got Half"),
        (dict(h_a=h_a[:, :0], lm_head=lm_head[:, :0], k=3), r"h_a must have shape \[..., H\] with H >= 1"),
        (dict(h_a=h_a, lm_head=packed, k=97), r"k must be in \[1, vocab size 96\], got 97"),
        (dict(h_a=h_a.bfloat16(), lm_head=packed, k=3), r"a packed quantized lm_head takes float32 h_a, got BFloat16"),
        (dict(h_a=randn(3, 64, seed=17), lm_head=packed, k=3),
         r"lm_head's columns \(hidden size, as h_a.shape\[-1\]\) must be 64, got 32 \(packed"),
        (dict(h_a=h_a, lm_head=quantized.unpack(packed), k=3), r"lm_head in uint8 must be a packed quantized weight"),
    ]
    for kwargs, message in cases:
        with pytest.raises(RuntimeError, match=message):
            ops.contrastive_topk(**{"h_b": None, "contrast_weight": None, **kwargs})
