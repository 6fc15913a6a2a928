"""decoder_layers (a model's layers in one call) on the CPU and every GPU backend: bit for bit the
layers called one by one with decoder_layer, close to the reference, and its lists checked."""
import math

import pytest
import torch

from conftest import TOL, GpuBackend
from jakiro_ext import ops
from jakiro_ext.ops import reference
from op_cases.decoder_layer import COMPOSED_SHAPES, LAYER_SHAPES, Layer, Layers, check_decoder_layers


@pytest.mark.parametrize("L", [1, 3])
@pytest.mark.parametrize("bias,residual", [(False, False), (True, True)], ids=["first-nobias", "residual-bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", LAYER_SHAPES, ids=lambda s: "B{}-T{}-H{}-Hq{}-Hkv{}-D{}-I{}".format(*s[:7]))
@pytest.mark.covers("decoder_layers", "adversarial_shapes")
def test_decoder_layers_matches_reference(shape, dtype, bias, residual, L):
    check_decoder_layers(GpuBackend("cpu"), shape, dtype, bias, residual, L)


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("weights", ["float32", "bfloat16", "bf16-projections", "bf16-cache"])
@pytest.mark.parametrize("shape", COMPOSED_SHAPES, ids=lambda s: "B{}-T{}-H{}-Hq{}-Hkv{}-D{}-I{}".format(*s[:7]))
def test_decoder_layers_equal_decoder_layer_called_layer_by_layer(shape, weights, threads):
    # Bit for bit, caches included: the layers in one parallel region (up to 64 rows) or composed
    # (beyond), whatever the threads, and float32 rows beside bf16 projection weights or a bf16 cache.
    B, T, H, Hq, Hkv, D, I, prefix, bias, residual = shape
    dtype = torch.bfloat16 if weights == "bfloat16" else torch.float32
    layers = Layers(3, B, T, H, Hq, Hkv, D, I, dtype=dtype, bias=bias, residual=residual, prefix=prefix)
    if weights == "bf16-projections":
        for layer in layers.layers:
            layer.with_bf16_projections()
    if weights == "bf16-cache":
        layers.kv_cache = layers.kv_cache.bfloat16()
    got_cache, want_cache = layers.kv_cache.clone(), layers.kv_cache.clone()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = ops.decoder_layers(*layers.args(got_cache))
        want = layers.one_by_one(want_cache)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and torch.equal(got_cache, want_cache)


@pytest.mark.parametrize("shape", LAYER_SHAPES, ids=lambda s: "B{}-T{}-H{}-Hq{}-Hkv{}-D{}-I{}".format(*s[:7]))
def test_decoder_layers_with_a_bf16_cache_match_reference(shape):
    # Float32 rows beside a bf16 cache (a quantized target's on the CPU): the keys and values
    # rounded as written, the arithmetic float32; the reference rounds them alike.
    check_decoder_layers(GpuBackend("cpu"), shape, torch.float32, True, True, 2, cache_dtype=torch.bfloat16)


def test_decoder_layers_of_one_layer_are_decoder_layer():
    layers = Layers(1, B=2, T=4)
    got_cache, want_cache = layers.kv_cache.clone(), layers.kv_cache.clone()
    got = ops.decoder_layers(*layers.args(got_cache))
    want = ops.decoder_layer(*layers.first.args(want_cache[0]))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and torch.equal(got_cache, want_cache)


@pytest.mark.covers("decoder_layers", "nonfinite")
def test_decoder_layers_nonfinite_input_stays_in_its_sequence(any_backend):
    layers = Layers(2, B=3, T=4, prefix=(5, 2, 7))
    layers.first.delta[1, 2, 7] = math.nan
    cache = layers.kv_cache.clone()
    residual, delta = any_backend.run("decoder_layers", *layers.args(cache))
    assert delta[1].isnan().any() and residual[1].isnan().any()
    clean = [0, 2]
    assert torch.isfinite(delta[clean]).all() and torch.isfinite(residual[clean]).all()
    _, want_delta = reference.decoder_layers(*layers.args())
    torch.testing.assert_close(delta[clean], want_delta[clean], **TOL[torch.float32])


def test_decoder_layers_opcheck():
    for bias, residual in ((True, True), (False, False)):
        layers = Layers(2, B=2, T=3, bias=bias, residual=residual)
        torch.library.opcheck(torch.ops.jakiro.decoder_layers.default, layers.args())
    layers = Layers(2, B=2, T=3)
    for layer in layers.layers:
        layer.with_bf16_projections()
    torch.library.opcheck(torch.ops.jakiro.decoder_layers.default, layers.args())
    layers.kv_cache = layers.kv_cache.bfloat16()
    torch.library.opcheck(torch.ops.jakiro.decoder_layers.default, layers.args())


def test_decoder_layers_bad_input_errors(any_backend):
    layers = Layers(3, B=2, T=3, H=48, Hq=4, Hkv=2, D=16, I=40)
    good = list(layers.args())

    def with_(index, value):
        args = list(good)
        args[index] = value
        return args

    def in_layer(index, layer, value):
        return with_(index, [value if i == layer else t for i, t in enumerate(good[index])])

    narrower = Layer(B=2, T=3, H=48, Hq=4, Hkv=2, D=16, I=24, seed=9)
    cases = [
        (with_(2, []), r"decoder_layers: input_norms must hold at least one layer's weight, got none"),
        (with_(3, good[3][:2]), r"decoder_layers: qkv_weights must hold one tensor per layer, 3 as input_norms, got 2"),
        (with_(8, good[8] + good[8][:1]), r"down_weights must hold one tensor per layer, 3 as input_norms, got 4"),
        (with_(4, good[4][:1]), r"qkv_biases must hold one tensor per layer, 3 as input_norms, or none, got 1"),
        (with_(11, layers.kv_cache[0].clone()), r"kv_cache must have 6 dimensions \[L, 2, B, Hkv, S, D\], got shape"),
        (with_(11, layers.kv_cache[:2].clone()), r"kv_cache.shape\[0\] \(layers, as len\(input_norms\)\) must be 3, got 2"),
        (in_layer(3, 1, good[3][1][:-16]),
         r"decoder_layers: layer 1: jakiro::decoder_layer: qkv_weight.shape\[0\] \(\(Hq \+ 2 Hkv\) D\) must be 128, got 112"),
        (in_layer(6, 2, good[6][2].double()), r"decoder_layers: layer 2: .*post_norm must have the dtype of delta"),
        (in_layer(7, 1, narrower.weights["gate_up_weight"]),
         r"layer 1: .*gate_up_weight.shape\[0\] \(2 I, I = down_weight.shape\[1\]\) must be 80, got 48"),
        (with_(0, layers.first.delta.double()), r"layer 0: .*delta must have dtype Float or BFloat16, got Double"),
        (with_(11, layers.kv_cache.half()), r"layer 0: .*kv_cache must have the dtype of delta \(Float\), got Half"),
    ]
    if any_backend.name != "cpu":  # a bf16 cache beside float32 rows: the CPU kernels' (the GPU: one dtype)
        cases.append((with_(11, layers.kv_cache.bfloat16()),
                      r"kv_cache in bfloat16 beside float32 delta is read by the CPU kernels only"))
    if any_backend.name == "cpu":  # every layer of one MLP width and weight dtype (the GPU: one dtype)
        wider = [narrower.weights["gate_up_weight"] if i == 1 else t for i, t in enumerate(good[7])]
        down = [narrower.weights["down_weight"] if i == 1 else t for i, t in enumerate(good[8])]
        args = with_(7, wider)
        args[8] = down
        cases.append((args, r"every layer must have layer 0's MLP width 40 and weight dtype Float, layer 1 has 24 and Float"))
        bf16 = [t.bfloat16() if i == 2 else t for i, t in enumerate(good[3])]
        args = with_(3, bf16)
        for index in (5, 7, 8):
            args[index] = [t.bfloat16() if i == 2 else t for i, t in enumerate(good[index])]
        cases.append((args, r"every layer must have layer 0's MLP width 40 and weight dtype Float, layer 2 has 40 and BFloat16"))
    for args, message in cases:
        with pytest.raises(RuntimeError, match=message):
            any_backend.run("decoder_layers", *args)
