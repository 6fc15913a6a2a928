"""Packed quantized weights (GGML's Q4_0, Q4_1, Q8_0 blocks) in jakiro::linear and the decoder
layer ops: the layout's round trip, the products against their pure-PyTorch specification, every
row independent of the others, the 512-bit VNNI kernel and the portable one bit for bit, and the
errors for weights that are not packed as the kernels read them."""
import pytest
import torch

from conftest import randn
from jakiro_ext import ops
from jakiro_ext.ops import quantized, reference
from op_cases.decoder_layer import Layer, Layers
from test_linear import run_kernel_check

FORMATS = list(quantized.FORMATS)


def random_blocks(N, K, format, seed=0):
    """GGML rows of random codes with scales of a real model's size (and Q4_1 minimums)."""
    g = torch.Generator().manual_seed(seed)
    f = quantized.FORMATS[format]
    rows = torch.randint(0, 256, (N, K // 32, f.block_bytes), dtype=torch.uint8, generator=g)
    scales = (torch.rand(N, K // 32, 2 if f.has_min else 1, generator=g) * 0.02 + 0.001).half()
    if f.has_min:
        scales[..., 1] = -scales[..., 1] * 4
    rows[..., : scales.shape[-1] * 2] = scales.contiguous().view(torch.uint8)
    return rows.reshape(N, -1)


def packed_weight(N, K, format, seed=0):
    return quantized.pack(random_blocks(N, K, format, seed), format)


def assert_close_to_spec(got, x, w, b=None):
    """The kernel's float32 block sums against the specification's float64 product, to a bound
    of float32 rounding over the terms' magnitudes."""
    want = quantized.linear(x, w, b)
    K = x.shape[-1]
    codes, scale, _ = quantized.quantize_rows(x.reshape(-1, K))
    rows = (codes.double().reshape(-1, K // 32, 32) * scale.double().unsqueeze(-1)).reshape(-1, K)
    magnitude = (rows.abs() @ quantized.dequantize(w).double().abs().T).float().reshape(want.shape)
    assert got.shape == want.shape and got.dtype == torch.float32
    assert ((got - want).abs() <= 1e-5 * magnitude + 1e-6).all(), (got - want).abs().max()


@pytest.mark.parametrize("format", FORMATS)
def test_pack_unpack_and_dequantize(format):
    raw = random_blocks(48, 96, format)
    packed = quantized.pack(raw, format)
    assert packed.shape == (3, 3, 16 * quantized.FORMATS[format].block_bytes) and quantized.format_of(packed) == format
    assert torch.equal(quantized.unpack(packed), raw)
    w = quantized.dequantize(packed)
    assert w.shape == (48, 96) and quantized.matrix_shape(packed) == (48, 96)
    rows = torch.tensor([0, 17, 47, 17])
    assert torch.equal(quantized.dequantize(packed, rows), w[rows])
    assert torch.equal(ops.embedding(packed, rows.view(2, 2)), w[rows].view(2, 2, 96))
    assert quantized.dequantize(packed, rows[:0]).shape == (0, 96)
    assert torch.equal(quantized.dequantize(packed, rows.int()), w[rows])  # (int32 indices)
    grid = rows.view(2, 2).t()  # (a transposed view of the tokens)
    assert torch.equal(ops.embedding(packed, grid), w[grid])
    some = torch.arange(47, -1, -3)  # 16 rows, in another order
    assert torch.equal(quantized.unpack(quantized.select_rows(packed, some)), raw[some])
    with pytest.raises(ValueError, match="a packed weight takes rows 16 at a time: got 15 rows"):
        quantized.select_rows(packed, some[:15])
    # GGML's arithmetic, written out for row 5's first block
    f, block = quantized.FORMATS[format], raw[5, : quantized.FORMATS[format].block_bytes]
    d = block[:2].view(torch.float16).float()
    if format == "Q8_0":
        want = block[2:].view(torch.int8).float() * d
    else:
        qs = block[4:] if f.has_min else block[2:]
        codes = torch.cat([qs & 15, qs >> 4]).float()
        want = codes * d + block[2:4].view(torch.float16).float() if f.has_min else (codes - 8) * d
    assert torch.equal(w[5, :32], want)


@pytest.mark.parametrize("format", FORMATS)
def test_from_float_quantizes_as_ggml(format):
    w = randn(32, 64, seed=3)
    packed = quantized.from_float(w, format)
    error = (quantized.dequantize(packed) - w).abs().max()
    assert error < (0.02 if format == "Q8_0" else 0.3) * w.abs().max(), error


# ----------------------------------------------------------------------------- dequantize_rows
@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("shape", [(), (1,), (3,), (2, 3), (0,), (4, 0, 2)])
@pytest.mark.covers("dequantize_rows", "adversarial_shapes")
def test_dequantize_rows_matches_reference(format, shape):
    # Any shape of rows (a scalar, empty ones, 3-D), the first and last row of the weight, rows
    # of the same 16-row group and repeats: the reference's bits, and the full matrix's rows.
    packed = packed_weight(48, 96, format, seed=7)
    n = int(torch.tensor(shape).prod()) if shape else 1
    rows = torch.tensor([0, 47, 15, 16, 16, 31, 2, 47][:n] + [5] * max(0, n - 8), dtype=torch.int64).reshape(shape)
    got = ops.dequantize_rows(packed, rows)
    assert got.shape == (*shape, 96) and got.dtype == torch.float32
    assert torch.equal(got, reference.dequantize_rows(packed, rows))
    assert torch.equal(got, quantized.dequantize(packed)[rows])
    one = packed_weight(16, 32, format, seed=8)  # one group of one block: the smallest weight
    assert torch.equal(ops.dequantize_rows(one, torch.arange(16)), quantized.dequantize(one))


def test_dequantize_rows_is_the_embedding_of_a_packed_table():
    packed = packed_weight(64, 64, "Q8_0", seed=3)
    w = quantized.dequantize(packed)
    for tokens in ([[3, 5, 3]], [[5]], [[7, 3, 9, 11]]):
        tokens = torch.tensor(tokens)
        got = ops.embedding(packed, tokens)
        assert torch.equal(got, w[tokens]) and got.shape == (*tokens.shape, 64)
    got = ops.embedding(packed, torch.tensor([21]))
    got.zero_()  # (the caller's own tensor)
    assert torch.equal(ops.embedding(packed, torch.tensor([21])), w[[21]])
    with torch.no_grad():  # the table changed in place: its rows as they are now
        packed[1, 0, :32] = 0
    assert torch.equal(ops.embedding(packed, torch.tensor([21])), quantized.dequantize(packed)[[21]])
    assert not torch.equal(quantized.dequantize(packed)[21], w[21])  # (the check can fail)
    dense = randn(64, 8, seed=12)  # a dense table: torch's embedding
    assert torch.equal(ops.embedding(dense, torch.tensor([[3, 63]])), dense[torch.tensor([[3, 63]])])


@pytest.mark.covers("dequantize_rows", "nonfinite")
@pytest.mark.parametrize("format", FORMATS)
def test_dequantize_rows_nonfinite_scales_stay_in_their_block(format):
    # A block whose float16 scale (or Q4_1 minimum) is NaN or infinite: its row's 32 weights are
    # what GGML's arithmetic makes of it (NaN, or +-inf, or NaN where the code times inf is 0 * inf),
    # every other weight as before.
    raw = random_blocks(32, 64, format, seed=9)
    f = quantized.FORMATS[format]
    raw = raw.reshape(32, 2, f.block_bytes)
    raw[3, 1, 0:2] = torch.tensor([float("nan")], dtype=torch.float16).view(torch.uint8)
    raw[20, 0, 0:2] = torch.tensor([float("inf")], dtype=torch.float16).view(torch.uint8)
    if f.has_min:
        raw[7, 0, 2:4] = torch.tensor([float("-inf")], dtype=torch.float16).view(torch.uint8)
    packed = quantized.pack(raw.reshape(32, -1), format)
    rows = torch.arange(32)
    got = ops.dequantize_rows(packed, rows)
    want = reference.dequantize_rows(packed, rows)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
    assert got[3, 32:].isnan().all() and torch.isfinite(got[3, :32]).all() and not torch.isfinite(got[20, :32]).any()
    bad = {3, 20, 7} if f.has_min else {3, 20}
    assert torch.isfinite(got[[r for r in range(32) if r not in bad]]).all()


def test_dequantize_rows_opcheck():
    packed = packed_weight(32, 64, "Q4_1", seed=10)
    torch.library.opcheck(torch.ops.jakiro.dequantize_rows.default, (packed, torch.tensor([[1, 31], [16, 0]])))


def test_dequantize_rows_bad_input_errors(any_backend):
    packed = packed_weight(32, 64, "Q8_0", seed=11)
    rows = torch.tensor([1, 2])
    cases = [
        ((packed.view(-1), rows), r"packed must be a packed quantized weight, uint8 \[N / 16, K / 32, 16 B\]"),
        ((packed[..., :100], rows), r"packed must be a packed quantized weight.*got Byte of shape \[2, 2, 100\]"),
        ((packed.float(), rows), r"packed must be a packed quantized weight.*got Float"),
        ((packed.transpose(0, 1), rows), "packed must be contiguous"),
        ((packed, rows.int()), "rows must have dtype"),
        ((packed, rows.float()), "rows must have dtype"),
    ]
    for args, match in cases:
        with pytest.raises((RuntimeError, ValueError), match=match):
            any_backend.run("dequantize_rows", *args)
    if any_backend.name == "cpu":  # (on the GPU a bad row is a device error: test_gpu_dequantize_rows_*)
        for bad in ([32], [-1], [0, 5, 99]):
            with pytest.raises(IndexError, match=r"rows must be in \[0, 32\)"):
                ops.dequantize_rows(packed, torch.tensor(bad))
        with pytest.raises(IndexError, match=r"rows must be in \[0, 32\)"):
            reference.dequantize_rows(packed, torch.tensor([-1]))
    with pytest.raises(RuntimeError, match="every tensor must be on one device"):
        ops.dequantize_rows(packed.to("meta"), rows)


def test_q8_0_from_float_gives_gguf_reference_bytes():
    """from_float's own Q8_0 (no gguf needed: drafting quantizes a float target's LM-head rows with
    it) writes the bytes of gguf's reference: zero blocks, tiny ones, codes at .5 ties (rounded
    away from zero), the block maximum at +-127."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    w = randn(48, 256, seed=7) * 0.1
    w[3, :32] = 0
    w[5, 32:64] = 1e-30
    w[7, :32] = torch.arange(32) * 0.5 - 8  # (d = 8 / 127: codes at exact halves before rounding)
    w[9, :32] = torch.linspace(-127, 127, 32)
    w[11, 64:96] = -w[11, 64:96].abs()
    want = torch.from_numpy(quantize(w.numpy(), GGMLQuantizationType.Q8_0).copy())
    assert torch.equal(quantized.unpack(quantized.from_float(w, "Q8_0")), want)
    assert not torch.equal(quantized.unpack(quantized.from_float(w * 1.01, "Q8_0")), want)  # (the check can fail)


def test_from_float_bad_input_errors():
    with pytest.raises(ValueError, match="must be finite"):
        quantized.from_float(torch.tensor([[float("nan")] + [0.0] * 31] * 16), "Q8_0")
    with pytest.raises(ValueError, match="K a multiple of 32"):
        quantized.from_float(torch.zeros(16, 48), "Q8_0")
    with pytest.raises(ValueError, match="format must be one of"):
        quantized.from_float(torch.zeros(16, 32), "Q5_K")


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("lead", [(1,), (5,), (8,), (9,), (2, 33), (65,)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.covers("linear", "adversarial_shapes")
def test_quantized_linear_matches_its_specification(format, lead, bias):
    w = packed_weight(48, 160, format, seed=1)
    x = randn(*lead, 160, seed=2)
    b = randn(48, seed=3) if bias else None
    assert_close_to_spec(ops.linear(x, w, b), x, w, b)
    assert_close_to_spec(reference.linear(x, w, b), x, w, b)


@pytest.mark.parametrize("format", FORMATS)
def test_quantized_linear_rows_do_not_depend_on_the_other_rows(format):
    # A token's logits are the same bits alone as in a tree of 64 (the row tiles of 8, their tails).
    w = packed_weight(64, 96, format, seed=4)
    x = randn(64, 96, seed=5)
    x[3, 40] = 1e4  # a row with a large block quantizes alone
    together = ops.linear(x, w)
    for rows in [(0, 1), (3, 4), (5, 13), (13, 64)]:
        assert torch.equal(ops.linear(x[rows[0]:rows[1]], w), together[rows[0]:rows[1]])


@pytest.mark.covers("linear", "nonfinite")
def test_quantized_linear_non_finite_rows_stay_their_own():
    w = packed_weight(32, 64, "Q4_1")
    x = randn(3, 64, seed=6)
    x[1, 5] = float("inf")
    y = ops.linear(x, w)
    assert torch.isnan(y[1]).all() and torch.isfinite(y[[0, 2]]).all()
    assert torch.equal(y[[0, 2]], ops.linear(x[[0, 2]], w))


VNNI_CHECK = """
import hashlib, sys
import torch
sys.path.insert(0, sys.argv[1])
from test_quantized import packed_weight
from jakiro_ext import ops
from jakiro_ext.ops import quantized
digest = hashlib.sha256()
g = torch.Generator().manual_seed(0)
for format in quantized.FORMATS:
    w = packed_weight(80, 224, format, seed=7)
    x = torch.randn(21, 224, generator=g)
    for rows in (1, 3, 8, 16, 21, 40):
        digest.update(ops.linear(x[:rows], w, torch.randn(80, generator=g)).numpy().tobytes())
print(digest.hexdigest())
"""


def test_vnni_and_portable_kernels_give_the_same_bits(tmp_path):
    import os

    here = os.path.dirname(os.path.abspath(__file__))
    digests = set()
    for env in ({}, {"JAKIRO_CPU_VNNI": "0"}, {"JAKIRO_CPU_AVX512": "0"}):
        out = run_kernel_check(VNNI_CHECK, tmp_path, [here], PYTHONPATH=os.pathsep.join(
            [here, os.path.dirname(here), os.environ.get("PYTHONPATH", "")]), **env)
        assert out.returncode == 0, out.stderr
        digests.add(out.stdout.split()[-1])
    assert len(digests) == 1, digests


def test_quantized_linear_opcheck():
    w, b = packed_weight(32, 64, "Q8_0"), randn(32, seed=8)
    x = randn(2, 3, 64, seed=9)
    torch.library.opcheck(torch.ops.jakiro.linear.default, (x, w, b))
    torch.library.opcheck(torch.ops.jakiro.linear.default, (x, w, None))


def test_quantized_linear_bad_input_errors():
    w = packed_weight(32, 64, "Q4_1")
    x = randn(2, 64, seed=1)
    with pytest.raises(RuntimeError, match=r"weight in uint8 must be a packed quantized weight \[N / 16, K / 32, 16 B\]"):
        ops.linear(x, quantized.unpack(w))  # GGML's rows, not packed
    with pytest.raises(RuntimeError, match=r"288 \(Q4_0\), 320 \(Q4_1\) or 544 \(Q8_0\).*got shape \[2, 2, 300\]"):
        ops.linear(x, torch.zeros(2, 2, 300, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="a packed quantized weight takes float32 x, got BFloat16"):
        ops.linear(x.bfloat16(), w)
    with pytest.raises(RuntimeError, match=r"weight's columns \(in features K, as x.shape\[-1\]\) must be 96, got 64 \(packed"):
        ops.linear(randn(2, 96, seed=2), w)
    with pytest.raises(RuntimeError, match=r"bias.shape\[0\] \(out features N, as weight's rows\) must be 32, got 31"):
        ops.linear(x, w, randn(31, seed=3))
    with pytest.raises(ValueError, match="N must be a multiple of 16 and K of 32, got N = 20"):
        quantized.pack(random_blocks(20, 64, "Q4_1"), "Q4_1")
    with pytest.raises(ValueError, match=r"Q8_0 rows are uint8 \[N, K / 32 \* 34\]"):
        quantized.pack(random_blocks(32, 64, "Q4_1"), "Q8_0")
    with pytest.raises(ValueError, match="format must be one of Q4_0, Q4_1, Q8_0, got 'Q5_0'"):
        quantized.pack(random_blocks(32, 64, "Q4_1"), "Q5_0")
    with pytest.raises(IndexError, match=r"rows must be in \[0, 32\)"):
        quantized.dequantize(w, torch.tensor([32]))


@pytest.mark.parametrize("cache", [torch.float32, torch.bfloat16])  # bf16: a quantized target's cache on the CPU
@pytest.mark.parametrize("format", FORMATS)
def test_decoder_layer_with_packed_weights(format, cache):
    """The fused layer (a batch of trees) on packed weights against the reference (its products
    quantized.linear), and each sequence of the batch the same bits alone."""
    layer = Layer(B=2, T=5, H=64, Hq=4, Hkv=2, D=16, I=96, prefix=(3, 7)).with_packed_projections(format)
    layer.kv_cache = layer.kv_cache.to(cache)
    want_cache, got_cache = layer.kv_cache.clone(), layer.kv_cache.clone()
    want = reference.decoder_layer(*layer.args(want_cache))
    got = ops.decoder_layer(*layer.args(got_cache))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(got_cache, want_cache, atol=2e-4, rtol=2e-4)
    layer.B = 1
    for name in ("delta", "residual", "cos", "sin", "lengths", "tree_mask"):
        setattr(layer, name, getattr(layer, name)[1:])
    alone_cache = layer.kv_cache[:, 1:].clone()
    for g, a in zip(got, ops.decoder_layer(*layer.args(alone_cache))):
        assert torch.equal(g[1:], a)
    assert torch.equal(alone_cache, got_cache[:, 1:])


@pytest.mark.parametrize("cache", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("format", ["Q4_1"])
def test_decoder_layers_with_packed_weights_fused_and_composed(format, cache):
    """Every layer in one parallel region (at most 64 rows) and the ops composed (beyond, or with
    JAKIRO_CPU_FUSED_LAYER=0) give the same bits: both quantize the rows alike (and round the keys
    and values of a bf16 cache alike)."""
    layers = Layers(3, 1, 9, 64, 4, 2, 16, 96, prefix=(4,))
    for layer in layers.layers:
        layer.with_packed_projections(format)
    layers.kv_cache = layers.kv_cache.to(cache)
    fused_cache, composed_cache = layers.kv_cache.clone(), layers.kv_cache.clone()
    fused = ops.decoder_layers(*layers.args(fused_cache))
    composed = reference_free_composed(layers, composed_cache)
    for a, b in zip(fused, composed):
        assert torch.equal(a, b)
    assert torch.equal(fused_cache, composed_cache)


def reference_free_composed(layers, kv_cache):
    """The layers through the ops one by one, as the composed CPU path runs them."""
    f = layers.first
    residual, delta = f.residual, f.delta
    for i, layer in enumerate(layers.layers):
        w = layer.weights
        h, stream = ops.rms_norm(delta, w["input_norm"], 1e-5, residual)
        qkv = ops.linear(h, w["qkv_weight"], w["qkv_bias"]).view(f.B, f.T, f.Hq + 2 * f.Hkv, f.D)
        q = ops.rope_kv_write(qkv, f.cos, f.sin, kv_cache[i], f.lengths)
        attention, _ = ops.tree_attention(q, kv_cache[i][0], kv_cache[i][1], f.lengths, f.tree_mask)
        o = ops.linear(attention.reshape(f.B, f.T, f.Hq * f.D), w["o_weight"])
        h2, residual = ops.rms_norm(o, w["post_norm"], 1e-5, stream)
        delta = ops.linear(ops.silu_mul(ops.linear(h2, w["gate_up_weight"])), w["down_weight"])
    return residual, delta


def test_decoder_layer_packed_weights_bad_inputs():
    layer = Layer(B=1, T=2, H=64, Hq=4, Hkv=2, D=16, I=96, prefix=(3,)).with_packed_projections("Q8_0")
    args = list(layer.args())
    o = args[5]
    args[5] = quantized.dequantize(o)
    with pytest.raises(RuntimeError, match="the four projection weights must share one dtype"):
        ops.decoder_layer(*args)
    args[5] = o[:2]
    with pytest.raises(RuntimeError, match=r"o_weight's rows \(hidden size H, as delta.shape\[2\]\) must be 64, got 32"):
        ops.decoder_layer(*args)
