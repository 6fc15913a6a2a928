"""Cases of rms_norm and rope_kv_write shared by their CPU tests (ops/) and GPU tests (gpu/)."""
import torch

from conftest import TOL, randn
from jakiro_ext.models.rope import rope_cos_sin
from jakiro_ext.ops import reference

# (leading dims, hidden size H): one row, one element, odd sizes (no vector multiple), SmolLM2's
# 576, a large H beyond the GPU block, many rows.
RMS_NORM_SHAPES = [((1,), 1), ((3,), 7), ((1, 1), 576), ((2, 5), 131), ((4,), 2049), ((300,), 64)]


def check_rms_norm(backend, shape, dtype, with_residual):
    lead, H = shape
    x = randn(*lead, H, seed=1, dtype=dtype, scale=3.0)
    w = randn(H, seed=2, dtype=dtype)
    r = randn(*lead, H, seed=3, dtype=dtype) if with_residual else None
    out, s = backend.run("rms_norm", x, w, 1e-6, r)
    want_out, want_s = reference.rms_norm(x, w, 1e-6, r)
    assert out.shape == x.shape and out.dtype == dtype and s.dtype == dtype
    assert torch.equal(s, want_s)  # one rounded add: exact
    torch.testing.assert_close(out, want_out, **TOL[dtype])


# (B, T, Hq, Hkv, D, S): decoding, a tree, GQA and MHA, odd head dims and counts, a full cache.
ROPE_SHAPES = [(1, 1, 9, 3, 64, 600), (2, 5, 4, 2, 8, 16), (3, 2, 1, 1, 2, 4), (1, 7, 6, 1, 128, 7), (2, 3, 3, 3, 6, 9)]


def rope_case(B, T, Hq, Hkv, D, S, dtype, seed=0):
    qkv = randn(B, T, Hq + 2 * Hkv, D, seed=seed, dtype=dtype)
    positions = torch.randint(0, 5000, (B, T), generator=torch.Generator().manual_seed(seed))
    cos, sin = rope_cos_sin(positions, D, 10000.0, dtype)
    cache = randn(2, B, Hkv, S, D, seed=seed + 1, dtype=dtype)
    lengths = torch.randint(0, S - T + 1, (B,), generator=torch.Generator().manual_seed(seed + 2))
    return qkv, cos[:, :, 0], sin[:, :, 0], cache, lengths


def check_rope_kv_write(backend, shape, dtype, cache_dtype=None):
    qkv, cos, sin, cache, lengths = rope_case(*shape, dtype)
    cache = cache.to(cache_dtype or dtype)  # (a bf16 cache beside float32 rows: the CPU kernel's)
    want_cache = cache.clone()
    want_q = reference.rope_kv_write(qkv, cos, sin, want_cache, lengths)
    got_cache = backend.to_device(cache.clone())
    got_q = backend.ops.rope_kv_write(*(backend.to_device(t) for t in (qkv, cos, sin)), got_cache,
                                      backend.to_device(lengths))
    assert torch.equal(got_q.cpu(), want_q)
    assert torch.equal(got_cache.cpu(), want_cache)  # the new slots written, every other slot untouched
