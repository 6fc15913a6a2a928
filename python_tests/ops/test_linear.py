"""linear (the weight-streaming projection) against its reference, and its row independence."""
import pytest
import torch

from conftest import TOL, randn
from jakiro_ext import ops
from jakiro_ext.ops import reference
from op_cases.linear_moe import LINEAR_SHAPES


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", LINEAR_SHAPES, ids=lambda s: f"{'x'.join(map(str, s[0]))}-K{s[1]}-N{s[2]}")
@pytest.mark.covers("linear", "adversarial_shapes")
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


def test_linear_short_sequences_do_not_depend_on_their_batch():
    # Sequences of at most 64 tokens each (x [B, T, K], a batch's trees) stream the weight even when
    # their rows together are more than 64: a sequence's result is what it gives alone. One long
    # sequence (a prompt) goes to BLAS: there only the reference's tolerance holds.
    x = randn(5, 30, 96, seed=30)
    w = randn(70, 96, seed=31)
    batch = ops.linear(x, w)
    for b in range(5):
        assert torch.equal(ops.linear(x[b:b + 1], w), batch[b:b + 1]), b
    torch.testing.assert_close(batch, reference.linear(x, w), **TOL[torch.float32])
    prompt = randn(1, 150, 96, seed=32)
    torch.testing.assert_close(ops.linear(prompt, w), reference.linear(prompt, w), **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_many_rows_go_to_blas_where_it_wins(dtype):
    """Beyond 64 rows of one sequence (a prompt), float32 is oneDNN's product where torch has it
    (bit for bit mkldnn::_linear_pointwise's; ATen's linear with JAKIRO_CPU_ONEDNN=0:
    test_linear_cpu_kernel_choice_and_its_fallbacks), else torch's BLAS product; bf16 is torch's
    where the CPU multiplies bf16 natively (AMX / AVX512-BF16), else the weight is streamed 64 rows
    at a time (each chunk what it gives alone)."""
    x = randn(150, 96, seed=33, dtype=dtype)
    w = randn(70, 96, seed=34, dtype=dtype, scale=96**-0.5)
    b = randn(70, seed=35, dtype=dtype)
    got = ops.linear(x, w)
    if dtype == torch.float32 and ops.cpu_onednn():
        assert torch.equal(got, torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""))
        assert torch.equal(ops.linear(x, w, b), torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], ""))
        assert torch.equal(ops.linear(x.view(2, 75, 96), w), got.view(2, 75, 70))
        torch.testing.assert_close(got, torch.nn.functional.linear(x, w), **TOL[dtype])
    elif dtype == torch.float32 or ops.cpu_bf16_dot():
        assert torch.equal(got, torch.nn.functional.linear(x, w))
    else:
        assert torch.equal(got, torch.cat([ops.linear(x[i: i + 64], w) for i in range(0, 150, 64)]))


def test_linear_noncontiguous_inputs():
    x = randn(40, 6, seed=6).t()  # [6, 40]
    w = randn(40, 30, seed=7).t()  # [30, 40]
    torch.testing.assert_close(ops.linear(x, w), reference.linear(x, w), **TOL[torch.float32])


def test_linear_opcheck():
    x, w, b = randn(2, 3, 32, seed=8), randn(20, 32, seed=9), randn(20, seed=10)
    torch.library.opcheck(torch.ops.jakiro.linear.default, (x, w, b))
    torch.library.opcheck(torch.ops.jakiro.linear.default, (x, w, None))
    torch.library.opcheck(torch.ops.jakiro.linear.default, (x, w.bfloat16(), b))  # bf16 weights, float32 rows


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("shape", LINEAR_SHAPES, ids=lambda s: f"{'x'.join(map(str, s[0]))}-K{s[1]}-N{s[2]}")
@pytest.mark.covers("linear", "adversarial_shapes")
def test_linear_bf16_weights_beside_float32_rows_give_the_float32_weights_bits(shape, bias):
    """A bf16 weight with float32 rows (a bf16 checkpoint's weights read as they are) is widened
    exactly: the same bits as the same weight in float32, streamed (up to 64 rows, and sequences of
    up to 64 tokens) or through BLAS; float32 out."""
    lead, K, N = shape
    x = randn(*lead, K, seed=1)
    w = randn(N, K, seed=2, dtype=torch.bfloat16, scale=K**-0.5)
    b = randn(N, seed=3) if bias else None
    got = ops.linear(x, w, b)
    assert got.dtype == torch.float32 and got.shape == (*lead, N)
    assert torch.equal(got, ops.linear(x, w.float(), b))
    torch.testing.assert_close(got, reference.linear(x, w, b), **TOL[torch.float32])


def test_linear_bad_input_errors():
    x, w, b = randn(3, 32, seed=11), randn(20, 32, seed=12), randn(20, seed=13)
    cases = [
        (dict(x=x, weight=w[:, :31]), r"weight.shape\[1\] \(in features K, as x.shape\[-1\]\) must be 32, got 31"),
        (dict(x=x, weight=w[0]), r"weight must have 2 dimensions \[N, K\]"),
        (dict(x=x.bfloat16(), weight=w), r"weight must have the dtype of x \(BFloat16\), got Float"),
        (dict(x=x, weight=w.half()), r"weight must have the dtype of x \(Float\), got Half"),
        (dict(x=x, weight=w.bfloat16(), bias=b.bfloat16()), r"bias must have the dtype of x \(Float\), got BFloat16"),
        (dict(x=x.double(), weight=w.double()), r"x must have dtype Float or BFloat16, got Double"),
        (dict(x=x, weight=w, bias=b[:19]), r"bias.shape\[0\] \(out features N, as weight.s rows\) must be 20, got 19"),
        (dict(x=x, weight=w, bias=b.bfloat16()), r"bias must have the dtype of x"),
        (dict(x=torch.tensor(1.0), weight=w), r"x must have shape \[..., K\]"),
    ]
    for kwargs, message in cases:
        with pytest.raises(RuntimeError, match=message):
            ops.linear(**{"bias": None, **kwargs})


def run_kernel_check(script, cwd, args=(), **env):
    """``script`` in a new Python process (the CPU kernel choices are read once a process), with
    every JAKIRO_CPU_* setting of this one dropped and ``env`` set."""
    import os
    import subprocess
    import sys

    env = {**{k: v for k, v in os.environ.items() if not k.startswith("JAKIRO_CPU_")}, **env}
    return subprocess.run([sys.executable, "-c", script, *args], env=env, cwd=cwd, capture_output=True, text=True)


KERNEL_CHECK = """
import sys
import torch
from jakiro_ext import ops, reference
dtype = getattr(torch, sys.argv[1])
g = torch.Generator().manual_seed(0)
x = torch.randn(64, 333, generator=g).to(dtype)  # K not a multiple of any vector width; 64 rows:
# beyond, float32 goes to BLAS
w = (torch.randn(97, 333, generator=g) * 333 ** -0.5).to(dtype)
full = ops.linear(x, w)
tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
torch.testing.assert_close(full, reference.linear(x, w), atol=tol, rtol=tol)
for rows in (1, 3, 6, 7, 8, 9, 25, 64):  # every tile shape's edges, one stream and register tiles
    assert torch.equal(ops.linear(x[:rows], w), full[:rows]), rows
prompt = torch.randn(150, 333, generator=g).to(dtype)  # a prompt's rows: oneDNN, else torch's BLAS
if dtype == torch.float32 and not ops.cpu_onednn():
    assert torch.equal(ops.linear(prompt, w), torch.nn.functional.linear(prompt, w))
torch.testing.assert_close(ops.linear(prompt, w), reference.linear(prompt, w), atol=tol, rtol=tol)
print(ops.cpu_avx512(), ops.cpu_bf16_dot(), ops.cpu_onednn())
"""


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("setting", ["detected", "JAKIRO_CPU_AVX512=0", "JAKIRO_CPU_BF16_DOT=0", "JAKIRO_CPU_ONEDNN=0"])
def test_linear_cpu_kernel_choice_and_its_fallbacks(setting, dtype, tmp_path):
    # float32 products run on 512-bit vectors and bf16 x bf16 on AVX512-BF16 dot products where the
    # CPU has them (chosen at run time), else on the 256-bit kernels (bf16 widened to float32); the
    # environment variables force the fallbacks. Every path stays correct and row-independent.
    import os

    env = {} if setting == "detected" else dict([setting.split("=")])
    out = run_kernel_check(KERNEL_CHECK, tmp_path, [dtype], **env)
    assert out.returncode == 0, out.stderr
    flags = open("/proc/cpuinfo").read().split() if os.path.exists("/proc/cpuinfo") else []
    avx512 = setting != "JAKIRO_CPU_AVX512=0" and all(f in flags for f in ("avx512f", "avx512bw", "avx512vl", "avx512dq"))
    bf16_dot = avx512 and setting != "JAKIRO_CPU_BF16_DOT=0" and "avx512_bf16" in flags
    onednn = setting != "JAKIRO_CPU_ONEDNN=0" and torch.backends.mkldnn.is_available()
    assert out.stdout.split()[-3:] == [str(avx512), str(bf16_dot), str(onednn)]


STREAM_CHECK = """
import hashlib
import torch
from jakiro_ext import ops
g = torch.Generator().manual_seed(0)
digest = hashlib.sha256()
for dtype in (torch.float32, torch.bfloat16):
    x = torch.randn(64, 333, generator=g).to(dtype)
    w = (torch.randn(97, 333, generator=g) * 333 ** -0.5).to(dtype)
    for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 25, 64):
        digest.update(ops.linear(x[:rows], w).float().numpy().tobytes())
print(ops.cpu_weight_stream(), digest.hexdigest())
"""


def test_linear_weight_streams_give_the_same_bits(tmp_path):
    # How a product's rows read the weight is chosen per CPU (one stream a weight row at a time for
    # up to 5 rows on Zen 5, for one row on Zen 4, register tiles on Intel's) and can be named with
    # JAKIRO_CPU_WEIGHT_STREAM: every one computes each output the same way, so the bits agree.
    if not ops.cpu_avx512():
        pytest.skip("the weight streams are the 512-bit kernels'")

    def run(value):
        return run_kernel_check(STREAM_CHECK, tmp_path, JAKIRO_CPU_WEIGHT_STREAM=value)

    digests = {}
    for name in ("zen5", "zen4", "intel"):
        out = run(name)
        assert out.returncode == 0, out.stderr
        chosen, digests[name] = out.stdout.split()[-2:]
        assert chosen == name
    assert len(set(digests.values())) == 1, digests
    bad = run("zen6")
    assert bad.returncode != 0
    assert "JAKIRO_CPU_WEIGHT_STREAM must be zen5, zen4 or intel (or unset), got 'zen6'" in bad.stderr
