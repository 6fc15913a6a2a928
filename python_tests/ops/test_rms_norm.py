"""rms_norm (residual add + RMSNorm in one pass) on the CPU and every GPU backend against its
reference, which is the checkpoints' eager code."""
import pytest
import torch

from conftest import TOL, GpuBackend, randn
from jakiro_ext import ops
from jakiro_ext.ops import reference
from op_cases.norm_rope import RMS_NORM_SHAPES, check_rms_norm


@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", RMS_NORM_SHAPES, ids=lambda s: f"{'x'.join(map(str, s[0]))}-H{s[1]}")
@pytest.mark.covers("rms_norm", "adversarial_shapes")
def test_rms_norm_matches_reference(shape, dtype, with_residual):
    check_rms_norm(GpuBackend("cpu"), shape, dtype, with_residual)  # GPU: test_gpu_norm_rope.py


def test_rms_norm_matches_the_model_code_in_float32():
    # The eager formula the Llama checkpoints use, within float32 rounding of the sum of squares.
    x, w = randn(8, 576, seed=4), randn(576, seed=5)
    x32 = x.float()
    want = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)) * w
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5)[0], want, atol=1e-6, rtol=1e-6)


@pytest.mark.covers("rms_norm", "nonfinite")
def test_rms_norm_rows_are_independent_and_non_finite_rows_stay_theirs(any_backend):
    x, w = randn(6, 100, seed=6), randn(100, seed=7)
    x[2, 5] = float("nan")
    x[4, 0] = float("inf")
    out, _ = any_backend.run("rms_norm", x, w, 1e-6)
    assert out[2].isnan().all() and out[4].isnan().any()
    finite = [0, 1, 3, 5]
    assert torch.isfinite(out[finite]).all()
    alone, _ = any_backend.run("rms_norm", x[3:4], w, 1e-6)
    assert torch.equal(alone, out[3:4])


def test_rms_norm_zero_row_with_zero_eps_is_nan_as_in_eager_code():
    out, _ = ops.rms_norm(torch.zeros(1, 8), torch.ones(8), 0.0)
    want, _ = reference.rms_norm(torch.zeros(1, 8), torch.ones(8), 0.0)
    assert out.isnan().all() and want.isnan().all()


def test_rms_norm_noncontiguous_inputs():
    x = randn(40, 6, seed=8).t()  # [6, 40]
    r = randn(40, 6, seed=9).t()
    w = randn(80, seed=10)[::2]
    out, s = ops.rms_norm(x, w, 1e-6, r)
    want_out, want_s = reference.rms_norm(x, w, 1e-6, r)
    torch.testing.assert_close(out, want_out, **TOL[torch.float32])
    assert torch.equal(s, want_s)


def test_rms_norm_opcheck():
    x, w, r = randn(2, 3, 32, seed=11), randn(32, seed=12), randn(2, 3, 32, seed=13)
    torch.library.opcheck(torch.ops.jakiro.rms_norm.default, (x, w, 1e-6, r))
    torch.library.opcheck(torch.ops.jakiro.rms_norm.default, (x, w, 1e-6, None))


def test_rms_norm_bad_input_errors(any_backend):
    x, w, r = randn(3, 32, seed=14), randn(32, seed=15), randn(3, 32, seed=16)
    cases = [
        ((x, w[:31], 1e-6, None), r"weight.shape\[0\] \(hidden size H, as x.shape\[-1\]\) must be 32, got 31"),
        ((x, w.view(4, 8), 1e-6, None), r"weight must have 1 dimensions \[H\]"),
        ((x, w.bfloat16(), 1e-6, None), r"weight must have the dtype of x \(Float\), got BFloat16"),
        ((x.double(), w.double(), 1e-6, None), r"x must have dtype Float or BFloat16, got Double"),
        ((x, w, 1e-6, r[:2]), r"residual must have the shape of x \[3, 32\], got \[2, 32\]"),
        ((x, w, 1e-6, r.bfloat16()), r"residual must have the dtype of x"),
        ((x, w, float("nan"), None), r"eps must be finite and >= 0, got nan"),
        ((x, w, -1.0, None), r"eps must be finite and >= 0, got -1"),
        ((torch.zeros(3, 0), torch.zeros(0), 1e-6, None), r"x must have shape \[..., H\] with H >= 1"),
        ((torch.tensor(1.0), w, 1e-6, None), r"x must have shape \[..., H\] with H >= 1"),
    ]
    for args, message in cases:
        with pytest.raises(RuntimeError, match=message):
            any_backend.run("rms_norm", *args)
