"""linear (the weight-streaming projection) against its reference, and its row independence."""
import pytest
import torch

from conftest import TOL, randn
from jakiro_ext import ops, reference

# (leading dims of x, in features K, out features N): odd sizes, 1..200 rows (both sides of the
# 64-row float32 BLAS crossover), the SmolLM2 projections and LM head.
SHAPES = [((1,), 1, 1), ((3,), 17, 5), ((2, 5), 54, 97), ((1, 7), 576, 1536), ((60,), 576, 576), ((64,), 111, 130),
          ((65,), 64, 33), ((2, 100), 96, 211), ((4,), 576, 49152)]


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{'x'.join(map(str, s[0]))}-K{s[1]}-N{s[2]}")
def test_linear_matches_reference(shape, dtype, bias):
    lead, K, N = shape
    x = randn(*lead, K, seed=1, dtype=dtype)
    w = randn(N, K, seed=2, dtype=dtype, scale=K**-0.5)
    b = randn(N, seed=3, dtype=dtype) if bias else None
    got = ops.linear(x, w, b)
    want = reference.linear(x, w, b)
    assert got.shape == (*lead, N) and got.dtype == dtype
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_row_does_not_depend_on_the_other_rows(dtype):
    # A token's logits must not change with the size of the tree verified alongside it.
    x = randn(64, 200, seed=4, dtype=dtype)
    w = randn(301, 200, seed=5, dtype=dtype)
    full = ops.linear(x, w)
    for rows in (1, 2, 3, 5, 16, 63):
        assert torch.equal(ops.linear(x[:rows], w), full[:rows]), rows
    assert torch.equal(ops.linear(x[37:38], w), full[37:38])


def test_linear_noncontiguous_inputs():
    x = randn(40, 6, seed=6).t()  # [6, 40]
    w = randn(40, 30, seed=7).t()  # [30, 40]
    torch.testing.assert_close(ops.linear(x, w), reference.linear(x, w), **TOL[torch.float32])


def test_linear_opcheck():
    x, w, b = randn(2, 3, 32, seed=8), randn(20, 32, seed=9), randn(20, seed=10)
    torch.library.opcheck(torch.ops.jakiro.linear.default, (x, w, b))
    torch.library.opcheck(torch.ops.jakiro.linear.default, (x, w, None))


def test_linear_bad_input_errors():
    x, w, b = randn(3, 32, seed=11), randn(20, 32, seed=12), randn(20, seed=13)
    cases = [
        (dict(x=x, weight=w[:, :31]), r"weight.shape\[1\] \(in features K, as x.shape\[-1\]\) must be 32, got 31"),
        (dict(x=x, weight=w[0]), r"weight must have 2 dimensions \[N, K\]"),
        (dict(x=x, weight=w.bfloat16()), r"weight must have the dtype of x \(Float\), got BFloat16"),
        (dict(x=x.double(), weight=w.double()), r"x must have dtype Float or BFloat16, got Double"),
        (dict(x=x, weight=w, bias=b[:19]), r"bias.shape\[0\] \(out features N, as weight.shape\[0\]\) must be 20, got 19"),
        (dict(x=x, weight=w, bias=b.bfloat16()), r"bias must have the dtype of x"),
        (dict(x=torch.tensor(1.0), weight=w), r"x must have shape \[..., K\]"),
    ]
    for kwargs, message in cases:
        with pytest.raises(RuntimeError, match=message):
            ops.linear(**{"bias": None, **kwargs})


BF16_DOT_CHECK = """
import torch
from jakiro_ext import ops, reference
g = torch.Generator().manual_seed(0)
x = torch.randn(70, 333, generator=g).bfloat16()  # K not a multiple of the 32-wide bf16 dot
w = (torch.randn(97, 333, generator=g) * 333 ** -0.5).bfloat16()
full = ops.linear(x, w)
torch.testing.assert_close(full, reference.linear(x, w), atol=2e-2, rtol=2e-2)
for rows in (1, 3, 8, 9, 64):  # both kernels' paths: one stream (<= 8 rows) and register tiles
    assert torch.equal(ops.linear(x[:rows], w), full[:rows]), rows
print(ops.cpu_bf16_dot())
"""


@pytest.mark.parametrize("setting", ["detected", "0"])
def test_linear_bf16_native_dot_and_its_fallback(setting, tmp_path):
    # bf16 x bf16 products use AVX512-BF16 where the CPU has it (chosen at run time), else bf16
    # widened to fp32; JAKIRO_CPU_BF16_DOT=0 forces the fallback. Both stay correct and row-independent.
    import os
    import subprocess
    import sys

    env = dict(os.environ)
    env.pop("JAKIRO_CPU_BF16_DOT", None)
    if setting == "0":
        env["JAKIRO_CPU_BF16_DOT"] = "0"
    out = subprocess.run([sys.executable, "-c", BF16_DOT_CHECK], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    flags = open("/proc/cpuinfo").read().split() if os.path.exists("/proc/cpuinfo") else []
    native = setting != "0" and "avx512_bf16" in flags and "avx512bw" in flags and "avx512vl" in flags
    assert out.stdout.split()[-1] == str(native)
