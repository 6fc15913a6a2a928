"""rope_kv_write (RoPE of q and k, the KV cache write) on the CPU and every GPU backend against
its reference, the eager code it replaces: bit for bit, since it rounds where that code rounds."""
import pytest
import torch

from conftest import GpuBackend, randn
from jakiro_ext import ops
from jakiro_ext.ops import reference
from op_cases.norm_rope import ROPE_SHAPES, check_rope_kv_write, rope_case


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", ROPE_SHAPES, ids=lambda s: "B{}-T{}-Hq{}-Hkv{}-D{}-S{}".format(*s))
@pytest.mark.covers("rope_kv_write", "adversarial_shapes")
def test_rope_kv_write_matches_reference_exactly(shape, dtype):
    check_rope_kv_write(GpuBackend("cpu"), shape, dtype)  # GPU: test_gpu_norm_rope.py


@pytest.mark.parametrize("shape", ROPE_SHAPES, ids=lambda s: "B{}-T{}-Hq{}-Hkv{}-D{}-S{}".format(*s))
@pytest.mark.covers("rope_kv_write", "adversarial_shapes")
def test_rope_kv_write_into_a_bf16_cache_beside_float32_rows(shape):
    # A quantized target's cache on the CPU: the key rotated in float32, then rounded to bf16 as
    # stored, the value rounded; q stays float32 (bit for bit the reference's).
    check_rope_kv_write(GpuBackend("cpu"), shape, torch.float32, cache_dtype=torch.bfloat16)


def test_rope_kv_write_matches_the_model_code():
    # What the engine's eager code did: rotary() on q and k, then index_put of k and v.
    from jakiro_ext.models.rope import rotary

    B, T, Hq, Hkv, D, S = 2, 3, 6, 2, 16, 10
    qkv, cos, sin, cache, lengths = rope_case(B, T, Hq, Hkv, D, S, torch.float32, seed=5)
    want = cache.clone()
    q = rotary(qkv[:, :, :Hq], cos.unsqueeze(2), sin.unsqueeze(2))
    k = rotary(qkv[:, :, Hq:Hq + Hkv], cos.unsqueeze(2), sin.unsqueeze(2))
    rows, slots = torch.arange(B).unsqueeze(1), lengths.unsqueeze(1) + torch.arange(T)
    want[0][rows, :, slots] = k
    want[1][rows, :, slots] = qkv[:, :, Hq + Hkv:]
    got = cache.clone()
    assert torch.equal(ops.rope_kv_write(qkv, cos, sin, got, lengths), q)
    assert torch.equal(got, want)


def test_rope_kv_write_into_a_layer_of_a_bigger_cache():
    # The model passes cache.kv[layer]: a view with an offset; other layers stay untouched.
    qkv, cos, sin, _, lengths = rope_case(1, 2, 3, 1, 8, 6, torch.float32, seed=7)
    kv = randn(4, 2, 1, 1, 6, 8, seed=8)
    before = kv.clone()
    want = before[2].clone()
    reference.rope_kv_write(qkv, cos, sin, want, lengths)
    ops.rope_kv_write(qkv, cos, sin, kv[2], lengths)
    assert torch.equal(kv[2], want) and torch.equal(kv[[0, 1, 3]], before[[0, 1, 3]])


def test_rope_kv_write_opcheck():
    qkv, cos, sin, cache, lengths = rope_case(2, 3, 4, 2, 8, 8, torch.float32, seed=9)
    torch.library.opcheck(torch.ops.jakiro.rope_kv_write.default, (qkv, cos, sin, cache, lengths))


def test_rope_kv_write_bad_input_errors(any_backend):
    qkv, cos, sin, cache, lengths = rope_case(2, 3, 4, 2, 8, 8, torch.float32, seed=10)
    cases = [
        ((qkv[0], cos, sin, cache, lengths), r"qkv must have 4 dimensions \[B, T, Hq \+ 2 Hkv, D\]"),
        ((qkv, cos, sin, cache[0], lengths), r"kv_cache must have 5 dimensions \[2, B, Hkv, S, D\]"),
        ((qkv.double(), cos.double(), sin.double(), cache.double(), lengths), r"qkv must have dtype Float or BFloat16"),
        ((qkv, cos.bfloat16(), sin, cache, lengths), r"cos must have the dtype of qkv"),
        ((qkv, cos, sin, cache.double(), lengths), r"kv_cache must have the dtype of qkv"),
        ((qkv.bfloat16(), cos.bfloat16(), sin.bfloat16(), cache, lengths), r"kv_cache must have the dtype of qkv"),
        ((qkv[..., :7], cos[..., :7], sin[..., :7], cache[..., :7].contiguous(), lengths), r"head dim .* must be even"),
        ((qkv[:, :, :4], cos, sin, cache, lengths), r"qkv.shape\[2\] must be Hq \+ 2 Hkv with Hq >= 1"),
        ((qkv, cos, sin, torch.cat([cache, cache]), lengths), r"kv_cache.shape\[0\] \(keys and values\) must be 2"),
        ((qkv, cos, sin, cache[:, :1], lengths), r"kv_cache.shape\[1\] \(batch, as qkv.shape\[0\]\) must be 2, got 1"),
        ((qkv, cos[:, :2], sin, cache, lengths), r"cos must have shape \[B, T, D\] = \[2, 3, 8\], got \[2, 2, 8\]"),
        ((qkv, cos, sin, cache.transpose(3, 4), lengths), r"kv_cache must have contiguous \[S, D\] rows"),
        ((qkv, cos, sin, cache, lengths.int()), r"lengths must have dtype Long"),
    ]
    for args, message in cases:
        with pytest.raises(RuntimeError, match=message):
            any_backend.run("rope_kv_write", *args)
    # A bf16 cache beside float32 rows: the CPU kernel's (tested above); the GPU kernels take one dtype.
    if any_backend.name != "cpu":
        with pytest.raises(RuntimeError, match=r"kv_cache in bfloat16 beside float32 qkv is read by the CPU kernels only"):
            any_backend.run("rope_kv_write", qkv, cos, sin, cache.bfloat16(), lengths)
    # Lengths that leave no room: the CPU op raises; a GPU kernel (and its emulation) reads no
    # value on the host, writes no k or v there and reports it to the device's error word.
    for bad, message in [([0, 6], r"lengths\[1\] \+ new tokens = 6 \+ 3 must be within \[0, cache capacity 8"),
                         ([-1, 0], r"lengths\[0\] \+ new tokens = -1 \+ 3")]:
        if any_backend.name == "cpu":
            with pytest.raises(RuntimeError, match=message):
                any_backend.run("rope_kv_write", qkv, cos, sin, cache, torch.tensor(bad))
        else:
            any_backend.run("rope_kv_write", qkv, cos, sin, cache, torch.tensor(bad))
            assert any_backend.ops.device_errors(any_backend.to_device(qkv)).tolist() == [2]
