"""GPU kernels of linear, dequantize_rows and moe_top2 (csrc/cuda) against the references, run by the
`gpu_backend` fixture: under the SIMT emulator (warp widths 32 and 64) and on CUDA when present."""
import pytest
import torch

from conftest import TOL, randn
from jakiro_ext.ops import quantized, reference
from op_cases.linear_moe import LINEAR_SHAPES, MOE_SHAPES, assert_moe_close, make_moe


# ----------------------------------------------------------------------------- dequantize_rows
@pytest.mark.parametrize("format", list(quantized.FORMATS))
@pytest.mark.parametrize("shape", [(1,), (2, 3), (0,)])
def test_gpu_dequantize_rows_matches_reference(gpu_backend, format, shape):
    # The same arithmetic as the CPU kernel (jakiro/quant.h): the reference's bits.
    packed = quantized.from_float(randn(48, 96, seed=15), format)
    rows = torch.tensor([47, 0, 16, 16, 31, 2][: int(torch.tensor(shape).prod())], dtype=torch.int64).reshape(shape)
    got = gpu_backend.run("dequantize_rows", packed, rows)
    assert got.shape == (*shape, 96) and torch.equal(got, reference.dequantize_rows(packed, rows))


# ----------------------------------------------------------------------------- linear
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", LINEAR_SHAPES, ids=lambda s: f"{'x'.join(map(str, s[0]))}-K{s[1]}-N{s[2]}")
def test_gpu_linear_matches_reference(gpu_backend, shape, dtype, bias):
    lead, K, N = shape
    x = randn(*lead, K, seed=1, dtype=dtype)
    w = randn(N, K, seed=2, dtype=dtype, scale=K**-0.5)
    b = randn(N, seed=3, dtype=dtype) if bias else None
    got = gpu_backend.run("linear", x, w, b)
    want = reference.linear(x, w, b)
    assert got.shape == (*lead, N) and got.dtype == dtype
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("cores", ["tensor", "cuda"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_linear_row_does_not_depend_on_the_other_rows(gpu_backend, dtype, cores, monkeypatch):
    # The CUDA-core kernel's rows fall into passes of 8, 4, 2 and 1: every split must give
    # bit-identical rows (bf16 takes the tensor-core kernel unless they are switched off).
    if cores == "cuda":
        monkeypatch.setenv("JAKIRO_GPU_TENSOR_CORES", "0")
    else:
        monkeypatch.delenv("JAKIRO_GPU_TENSOR_CORES", raising=False)
    x = randn(23, 70, seed=4, dtype=dtype)
    w = randn(37, 70, seed=5, dtype=dtype)
    full = gpu_backend.run("linear", x, w)
    for rows in (1, 2, 3, 5, 7, 8, 9, 15):
        assert torch.equal(gpu_backend.run("linear", x[:rows], w), full[:rows]), rows
    assert torch.equal(gpu_backend.run("linear", x[13:14], w), full[13:14])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_linear_wide_tiles(gpu_backend, dtype):
    # Enough output features that each warp streams several weight rows, 4 at a time plus a
    # remainder (linear.cuh's kLinearWideColumns); rows still independent of each other.
    x = randn(9, 24, seed=14, dtype=dtype)
    w = randn(16421, 24, seed=15, dtype=dtype, scale=24**-0.5)
    b = randn(16421, seed=16, dtype=dtype)
    full = gpu_backend.run("linear", x, w, b)
    torch.testing.assert_close(full, reference.linear(x, w, b), **TOL[dtype])
    assert torch.equal(gpu_backend.run("linear", x[3:8], w, b), full[3:8])
    assert torch.equal(gpu_backend.run("linear", x[8:], w, b), full[8:])


def test_gpu_linear_noncontiguous_and_edge_shapes(gpu_backend):
    x = randn(40, 6, seed=6).t()  # [6, 40]
    w = randn(40, 30, seed=7).t()  # [30, 40]
    torch.testing.assert_close(gpu_backend.run("linear", x, w), reference.linear(x, w), **TOL[torch.float32])
    # No rows, no output features, no input features.
    for x_shape, w_shape in (((0, 16), (5, 16)), ((2, 0, 16), (5, 16)), ((3, 16), (0, 16)), ((3, 0), (4, 0))):
        x, w, b = randn(*x_shape, seed=8), randn(*w_shape, seed=9), randn(w_shape[0], seed=10)
        got = gpu_backend.run("linear", x, w, b)
        assert got.shape == (*x_shape[:-1], w_shape[0])
        torch.testing.assert_close(got, reference.linear(x, w, b), **TOL[torch.float32])


def test_gpu_linear_bad_input_errors(gpu_backend):
    x, w = randn(3, 32, seed=11), randn(20, 32, seed=12)
    with pytest.raises(RuntimeError, match=r"weight.shape\[1\] \(in features K, as x.shape\[-1\]\) must be 32"):
        gpu_backend.run("linear", x, w[:, :31])
    with pytest.raises(RuntimeError, match=r"weight must have the dtype of x"):
        gpu_backend.run("linear", x, w.bfloat16())


# ----------------------------------------------------------------------------- moe_top2
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", MOE_SHAPES, ids=lambda s: f"{'x'.join(map(str, s[0]))}-H{s[1]}-I{s[2]}-N{s[3]}")
def test_gpu_moe_top2_matches_reference(gpu_backend, shape, dtype, renormalize):
    args = make_moe(*shape, dtype=dtype, seed=100)
    got = gpu_backend.run("moe_top2", *args, renormalize=renormalize)
    assert_moe_close(got, reference.moe_top2(*args, renormalize=renormalize), dtype)
    lead, H = shape[0], shape[1]
    assert [tuple(t.shape) for t in got] == [(*lead, H), (*lead, 2, H), (*lead, 2), (*lead, 2), (*lead, 2)]
    assert got[3].dtype == torch.float32 and got[4].dtype == torch.float32


def test_gpu_moe_top2_many_tokens(gpu_backend):
    # 300 tokens = 600 (token, slot) rows: more than one chunk of the per-block expert scan.
    args = make_moe((300,), 40, 24, 3, torch.float32, seed=21)
    assert_moe_close(gpu_backend.run("moe_top2", *args), reference.moe_top2(*args), torch.float32)


def test_gpu_moe_top2_noncontiguous_input(gpu_backend):
    _, router, w_gate, w_up, w_down = make_moe((1,), 32, 24, 4, torch.float32, seed=11)
    for x in (randn(32, 5, 3, seed=12).transpose(0, 2), randn(6, 64, seed=13)[:, ::2]):
        assert not x.is_contiguous()
        assert_moe_close(gpu_backend.run("moe_top2", x, router, w_gate, w_up, w_down),
                         reference.moe_top2(x, router, w_gate, w_up, w_down), torch.float32)


def test_gpu_moe_top2_ties_pick_the_lower_expert_first(gpu_backend):
    x, router, w_gate, w_up, w_down = make_moe((9,), 32, 16, 4, torch.float32, seed=8)
    router[2] = router[1]  # experts 1 and 2 always tie
    router[3] = router[1]
    router[0] = -router[1]
    _, _, idx, _, _ = gpu_backend.run("moe_top2", x, router, w_gate, w_up, w_down)
    _, _, r_idx, _, _ = reference.moe_top2(x, router, w_gate, w_up, w_down)
    assert torch.equal(idx, r_idx)
    positive = (x @ router[1]) > 0
    assert torch.equal(idx[positive], torch.tensor([[1, 2]]).expand(int(positive.sum()), 2))


def test_gpu_moe_top2_edge_shapes(gpu_backend):
    # No tokens: empty outputs of the right shapes.
    _, router, w_gate, w_up, w_down = make_moe((1,), 16, 8, 3, torch.float32, seed=30)
    got = gpu_backend.run("moe_top2", torch.zeros(0, 4, 16), router, w_gate, w_up, w_down)
    assert [tuple(t.shape) for t in got] == [(0, 4, 16), (0, 4, 2, 16), (0, 4, 2), (0, 4, 2), (0, 4, 2)]
    # Expert width 0: the experts add nothing.
    x, router = randn(3, 16, seed=31), randn(5, 16, seed=32, scale=0.25)
    w_gate, w_up, w_down = torch.zeros(3, 0, 16), torch.zeros(3, 0, 16), torch.zeros(3, 16, 0)
    assert_moe_close(gpu_backend.run("moe_top2", x, router, w_gate, w_up, w_down),
                     reference.moe_top2(x, router, w_gate, w_up, w_down), torch.float32)


def test_gpu_moe_top2_bad_input_errors(gpu_backend):
    x, router, w_gate, w_up, w_down = make_moe((5,), 32, 24, 4, torch.float32, seed=10)
    with pytest.raises(RuntimeError, match=r"router_weight must have shape \[N \+ 2, H\] = \[6, 32\]"):
        gpu_backend.run("moe_top2", x, router[:5], w_gate, w_up, w_down)
    # The CPU kernel reads bf16 experts beside float32 activations; the GPU's takes one dtype and says so.
    with pytest.raises(RuntimeError, match=r"w_up in bfloat16 beside float32 x is read by the CPU kernels only"):
        gpu_backend.run("moe_top2", x, router, w_gate, w_up.bfloat16(), w_down)
