"""decoder_layer (a Llama decoder layer in one call) and silu_mul (SwiGLU's activation) on the CPU
and every GPU backend against their references; the layer also equals the composition of the ops
it is made of, and a sequence's result never depends on the batch or tree it shares a call with."""
import math
import os
import subprocess
import sys

import pytest
import torch

from conftest import TOL, GpuBackend, randn
from jakiro_ext import ops
from jakiro_ext.ops import reference
from op_cases.decoder_layer import (COMPOSED_SHAPES, LAYER_SHAPES, PROJECTIONS, SILU_SHAPES, Layer, check_decoder_layer,
                                    check_silu_mul)

# ----------------------------------------------------------------------------- silu_mul

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SILU_SHAPES, ids=lambda s: f"{'x'.join(map(str, s[0]))}-I{s[1]}")
@pytest.mark.covers("silu_mul", "adversarial_shapes")
def test_silu_mul_matches_reference(shape, dtype):
    check_silu_mul(GpuBackend("cpu"), shape, dtype)  # GPU: test_gpu_decoder_layer.py


@pytest.mark.covers("silu_mul", "nonfinite")
def test_silu_mul_nonfinite_values_stay_in_their_element(any_backend):
    x = randn(4, 2 * 40, seed=2)
    x[1, 3] = math.nan          # gate
    x[2, 40 + 5] = math.inf     # up
    x[3, 7] = math.inf          # gate +inf: SiLU(inf) = inf
    out = any_backend.run("silu_mul", x)
    want = reference.silu_mul(x)
    torch.testing.assert_close(out, want, equal_nan=True, **TOL[torch.float32])
    assert out[1, 3].isnan() and out[2, 5].isinf() and out[3, 7].isinf()
    poisoned = torch.zeros_like(out, dtype=torch.bool)
    poisoned[1, 3] = poisoned[2, 5] = poisoned[3, 7] = True
    assert torch.isfinite(out[~poisoned]).all()


def test_silu_mul_noncontiguous_input_and_rows_alike():
    x = randn(2 * 33, 5, seed=3).t()  # [5, 66], not contiguous
    out = ops.silu_mul(x)
    torch.testing.assert_close(out, reference.silu_mul(x), **TOL[torch.float32])
    for r in range(5):  # every row computed alike, alone or among others
        assert torch.equal(ops.silu_mul(x[r:r + 1].contiguous()), out[r:r + 1])


def test_silu_mul_opcheck():
    torch.library.opcheck(torch.ops.jakiro.silu_mul.default, (randn(3, 2, 32, seed=4),))


def test_silu_mul_bad_input_errors(any_backend):
    cases = [
        (randn(3, 7, seed=5), r"gate_up must have shape \[..., 2 I\] with I >= 1 \(\[gate \| up\]\), got \[3, 7\]"),
        (torch.zeros(3, 0), r"gate_up must have shape \[..., 2 I\] with I >= 1"),
        (torch.tensor(1.0), r"gate_up must have shape \[..., 2 I\] with I >= 1"),
        (randn(3, 8, seed=6).double(), r"gate_up must have dtype Float or BFloat16, got Double"),
    ]
    for x, message in cases:
        with pytest.raises(RuntimeError, match=message):
            any_backend.run("silu_mul", x)


# ----------------------------------------------------------------------------- decoder_layer

@pytest.mark.parametrize("residual", [False, True], ids=["first", "residual"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", LAYER_SHAPES, ids=lambda s: "B{}-T{}-H{}-Hq{}-Hkv{}-D{}-I{}".format(*s[:7]))
@pytest.mark.covers("decoder_layer", "adversarial_shapes")
def test_decoder_layer_matches_reference(shape, dtype, bias, residual):
    check_decoder_layer(GpuBackend("cpu"), shape, dtype, bias, residual)



@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", COMPOSED_SHAPES, ids=lambda s: "B{}-T{}-H{}-Hq{}-Hkv{}-D{}-I{}".format(*s[:7]))
def test_decoder_layer_equals_its_parts_composed(shape, dtype, threads):
    # Bit for bit: the layer (one parallel region up to 64 rows, whatever the threads) is the
    # composition of the ops the unfused model called one by one.
    B, T, H, Hq, Hkv, D, I, prefix, bias, residual = shape
    layer = Layer(B, T, H, Hq, Hkv, D, I, dtype=dtype, bias=bias, residual=residual, prefix=prefix)
    cache = layer.kv_cache.clone()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = ops.decoder_layer(*layer.args(cache))
    finally:
        torch.set_num_threads(before)
    w, B, T = layer.weights, layer.B, layer.T
    parts_cache = layer.kv_cache.clone()
    h, stream = ops.rms_norm(layer.delta, w["input_norm"], 1e-5, layer.residual)
    qkv = ops.linear(h, w["qkv_weight"], w["qkv_bias"]).view(B, T, layer.Hq + 2 * layer.Hkv, layer.D)
    q = ops.rope_kv_write(qkv, layer.cos, layer.sin, parts_cache, layer.lengths)
    attention, _ = ops.tree_attention(q, parts_cache[0], parts_cache[1], layer.lengths, layer.tree_mask)
    h, stream = ops.rms_norm(ops.linear(attention.reshape(B, T, -1), w["o_weight"]), w["post_norm"], 1e-5, stream)
    delta = ops.linear(ops.silu_mul(ops.linear(h, w["gate_up_weight"])), w["down_weight"])
    assert torch.equal(got[0], stream) and torch.equal(got[1], delta) and torch.equal(cache, parts_cache)


@pytest.mark.parametrize("stream", ["intel", "zen5"])
def test_decoder_layer_equals_its_parts_composed_as_far_as_each_cpu_kind_fuses(stream):
    # Each CPU kind streams the weights its own way (Zen 5: one stream up to 5 rows; elsewhere
    # register tiles), inside the fused layer as in the composed ops: the test above runs again
    # under each kind, named (JAKIRO_CPU_WEIGHT_STREAM), whatever this CPU is.
    env = {**os.environ, "JAKIRO_CPU_WEIGHT_STREAM": stream}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.abspath(__file__),
                          "-k", "test_decoder_layer_equals_its_parts_composed and not cpu_kind"],
                         env=env, cwd=os.path.dirname(os.path.abspath(__file__)), capture_output=True, text=True)
    cases = 2 * 2 * len(COMPOSED_SHAPES)
    assert out.returncode == 0 and f"{cases} passed" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]


def test_decoder_layer_sequences_do_not_depend_on_their_batch():
    # Three sequences of 30 tokens (90 rows: beyond the 64 rows of one streamed pass) give, each,
    # exactly what it gives alone: the projections stream every short sequence's rows in one order.
    layer = Layer(B=3, T=30, H=64, Hq=4, Hkv=2, D=16, I=80, prefix=(4, 11, 0))
    cache = layer.kv_cache.clone()
    residual, delta = ops.decoder_layer(*layer.args(cache))
    for b in range(3):
        one = [a[b:b + 1] if isinstance(a, torch.Tensor) and a.shape[:1] == (3,) else a for a in layer.args()]
        one[11] = layer.kv_cache[:, b:b + 1].clone()
        r1, d1 = ops.decoder_layer(*one)
        assert torch.equal(r1, residual[b:b + 1]) and torch.equal(d1, delta[b:b + 1])
        assert torch.equal(one[11], cache[:, b:b + 1])


@pytest.mark.covers("decoder_layer", "nonfinite")
def test_decoder_layer_nonfinite_input_stays_in_its_sequence(any_backend):
    layer = Layer(B=3, T=4, prefix=(5, 2, 7))
    layer.delta[1, 2, 7] = math.nan
    cache = layer.kv_cache.clone()
    residual, delta = any_backend.run("decoder_layer", *layer.args(cache))
    assert residual[1, 2].isnan().any() and delta[1].isnan().any()
    clean = [0, 2]
    assert torch.isfinite(delta[clean]).all() and torch.isfinite(residual[clean]).all()
    want_residual, want_delta = reference.decoder_layer(*layer.args())
    torch.testing.assert_close(delta[clean], want_delta[clean], **TOL[torch.float32])


def test_decoder_layer_opcheck():
    for bias, residual in ((True, True), (False, False)):
        layer = Layer(B=2, T=3, bias=bias, residual=residual)
        torch.library.opcheck(torch.ops.jakiro.decoder_layer.default, layer.args())
    layer = Layer(B=2, T=3).with_bf16_projections()
    torch.library.opcheck(torch.ops.jakiro.decoder_layer.default, layer.args())



@pytest.mark.parametrize("shape", LAYER_SHAPES, ids=lambda s: "B{}-T{}-H{}-Hq{}-Hkv{}-D{}-I{}".format(*s[:7]))
@pytest.mark.covers("decoder_layer", "adversarial_shapes")
def test_decoder_layer_bf16_projections_beside_float32_rows_give_the_float32_weights_bits(shape):
    """The four projection weights in bf16 with float32 rows (a bf16 checkpoint's weights read as
    they are; on the CPU) give the bits of the same weights in float32, fused (up to 64 rows) or
    composed (a prompt), the cache written alike."""
    B, T, H, Hq, Hkv, D, I, prefix = shape
    layer = Layer(B, T, H, Hq, Hkv, D, I, prefix=prefix).with_bf16_projections()
    widened = Layer(B, T, H, Hq, Hkv, D, I, prefix=prefix)
    widened.weights.update({k: layer.weights[k].float() for k in PROJECTIONS})
    got_cache, want_cache = layer.kv_cache.clone(), layer.kv_cache.clone()
    got = ops.decoder_layer(*layer.args(got_cache))
    want = ops.decoder_layer(*widened.args(want_cache))
    assert got[0].dtype == got[1].dtype == torch.float32
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and torch.equal(got_cache, want_cache)
    ref_cache = layer.kv_cache.clone()
    torch.testing.assert_close(got[1], reference.decoder_layer(*layer.args(ref_cache))[1], **TOL[torch.float32])


def test_decoder_layer_bad_input_errors(any_backend):
    layer = Layer(B=2, T=3, H=48, Hq=4, Hkv=2, D=16, I=40)
    good = list(layer.args())

    def with_(index, value):
        args = list(good)
        args[index] = value
        return args

    w = layer.weights
    cases = [
        (with_(0, layer.delta[0]), r"delta must have 3 dimensions \[B, T, H\], got shape \[3, 48\]"),
        (with_(0, layer.delta.double()), r"delta must have dtype Float or BFloat16, got Double"),
        (with_(1, layer.residual[:, :2]), r"residual must have the shape of delta \[2, 3, 48\], got \[2, 2, 48\]"),
        (with_(2, w["input_norm"][:40]), r"input_norm.shape\[0\] \(hidden size H, as delta.shape\[2\]\) must be 48, got 40"),
        (with_(3, w["qkv_weight"][:-16]), r"qkv_weight.shape\[0\] \(\(Hq \+ 2 Hkv\) D\) must be 128, got 112"),
        (with_(4, w["qkv_bias"][:5]), r"qkv_bias.shape\[0\] \(\(Hq \+ 2 Hkv\) D\) must be 128, got 5"),
        (with_(5, w["o_weight"][:, :50]), r"o_weight.shape\[1\] must be Hq \* D with D = 16 \(kv_cache.shape\[4\]\) "
                                          r"and Hq a multiple of Hkv = 2, got 50"),
        (with_(5, w["o_weight"][:, :48]), r"Hq a multiple of Hkv = 2, got 48"),
        (with_(7, w["gate_up_weight"][:79]), r"gate_up_weight.shape\[0\] \(2 I, I = down_weight.shape\[1\]\) must be 80, got 79"),
        (with_(8, w["down_weight"].half()), r"down_weight must have the dtype of delta \(Float\), got Half"),
        (with_(6, w["post_norm"].bfloat16()), r"post_norm must have the dtype of delta \(Float\), got BFloat16"),
        (with_(8, w["down_weight"].bfloat16()), r"the four projection weights must share one dtype, got qkv Float, o Float, "
                                                r"gate_up Float, down BFloat16" if any_backend.name == "cpu" else
                                                r"down_weight in bfloat16 beside float32 delta is read by the CPU kernels only"),
        (with_(9, layer.cos[:, :2]), r"cos must have shape \[B, T, D\] = \[2, 3, 16\], got \[2, 2, 16\]"),
        (with_(11, layer.kv_cache[:, :1].clone()), r"kv_cache.shape\[1\] \(batch, as delta.shape\[0\]\) must be 2, got 1"),
        (with_(11, layer.kv_cache[..., :15].clone()), r"kv_cache \[2, B, Hkv, S, D\] must have Hkv >= 1 and an even D >= 2"),
        (with_(12, layer.lengths.int()), r"lengths must have dtype Long, got Int"),
        (with_(14, float("nan")), r"eps must be finite and >= 0, got nan"),
        (with_(0, torch.zeros(2, 0, 48)), r"delta must hold at least one token of at least one feature"),
    ]
    if any_backend.name == "cpu":  # value checks read the host (a GPU reports bad lengths on its error word)
        cases.append((with_(12, torch.tensor([9, layer.kv_cache.shape[3] - 2])),
                      r"lengths\[1\] \+ new tokens = \d+ \+ 3 must be within \[0, cache capacity \d+"))
    for args, message in cases:
        with pytest.raises(RuntimeError, match=message):
            any_backend.run("decoder_layer", *args)
