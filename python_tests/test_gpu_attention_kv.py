"""The GPU kernels of tree attention, the split-KV merge and KV compaction (csrc/cuda) against
the references, on the op tests' shapes: under the SIMT emulator with warp widths 32 and 64, and
on a CUDA device when there is one (fixture gpu_backend, conftest.py)."""
import pytest
import torch

from conftest import TOL, randn
from jakiro_ext import ops, reference
from test_tree_attention import SHAPES, make_inputs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:5])) + f"-p{max(s[5])}")
def test_gpu_tree_attention_matches_reference(gpu_backend, shape, dtype):
    q, k, v, lens, mask = make_inputs(*shape, dtype=dtype, seed=10)
    out, lse = gpu_backend.run("tree_attention", q, k, v, lens, mask)
    ref_out, ref_lse = reference.tree_attention(q, k, v, lens, mask)
    assert out.dtype == dtype and out.shape == q.shape and lse.shape == q.shape[:3]
    torch.testing.assert_close(out.float(), ref_out.float(), **TOL[dtype])
    torch.testing.assert_close(lse, ref_lse, **TOL[torch.float32])


# 150 splits: more than some sequences have keys (empty splits).
SPLIT_CASES = [(SHAPES[1], 1), (SHAPES[1], 2), (SHAPES[1], 150), (SHAPES[2], 13), (SHAPES[5], 5)]


@pytest.mark.parametrize("shape,num_splits", SPLIT_CASES, ids=["9-3-1", "9-3-2", "9-3-150", "24-3-13", "odd-dim-5"])
def test_gpu_tree_attention_partial_matches_reference_on_splits(gpu_backend, shape, num_splits):
    q, k, v, lens, mask = make_inputs(*shape, dtype=torch.float32, seed=20)
    out_p, lse_p = gpu_backend.run("tree_attention_partial", q, k, v, lens, mask, num_splits)
    ref_p, ref_lse_p = reference.tree_attention_partial(q, k, v, lens, mask, num_splits)
    torch.testing.assert_close(out_p, ref_p, **TOL[torch.float32])
    torch.testing.assert_close(lse_p, ref_lse_p, **TOL[torch.float32])  # -inf for empty splits on both
    out, _ = gpu_backend.run("tree_attention", q, k, v, lens, mask, num_splits=num_splits)
    torch.testing.assert_close(out, reference.tree_attention(q, k, v, lens, mask)[0], **TOL[torch.float32])


def test_gpu_tree_attention_strided_cache_masked_rows_and_scale(gpu_backend):
    B, T, Hq, Hkv, D, S = 2, 9, 6, 2, 40, 64
    q = randn(B, T, Hq, D, seed=30)
    kv = randn(B, 2, Hkv, S, D, seed=31)  # k and v interleaved per batch: batch stride 2 * Hkv * S * D
    k, v = kv[:, 0], kv[:, 1]
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2, 3, 3, 4]] * B)
    mask = ops.build_tree_mask(parents)
    mask[1, 4] = 0  # a row that sees nothing (and no prefix: sequence 1 has none)
    lens = torch.tensor([17, 0])
    out, lse = gpu_backend.run("tree_attention", q, k, v, lens, mask, scale=0.3, num_splits=3)
    ref_out, ref_lse = reference.tree_attention(q, k, v, lens, mask, scale=0.3, num_splits=3)
    torch.testing.assert_close(out, ref_out, **TOL[torch.float32])
    torch.testing.assert_close(lse, ref_lse, **TOL[torch.float32])
    assert torch.equal(out[1, 4], torch.zeros(Hq, D)) and bool(torch.isneginf(lse[1, 4]).all())


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_gpu_merge_attention_states_matches_reference(gpu_backend, out_dtype):
    out_p = randn(2, 3, 4, 5, 70, seed=40)
    lse_p = randn(2, 3, 4, 5, seed=41)
    lse_p[0, 0, 0, :] = float("-inf")  # every split empty
    lse_p[1, 2, 3, 1:4] = float("-inf")
    out, lse = gpu_backend.run("merge_attention_states", out_p, lse_p, out_dtype)
    ref_out, ref_lse = reference.merge_attention_states(out_p, lse_p, out_dtype)
    assert out.dtype == out_dtype
    torch.testing.assert_close(out.float(), ref_out.float(), **TOL[torch.float32])
    torch.testing.assert_close(lse, ref_lse, **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lead,D", [((), 64), ((3,), 64), ((4, 2), 7)], ids=["one-cache", "layers", "odd-row"])
def test_gpu_compact_kv_matches_reference(gpu_backend, lead, D, dtype):
    B, H, S = 3, 5, 200
    cache = randn(*lead, B, H, S, D, seed=1, dtype=dtype)
    prefix_lens = torch.tensor([0, 57, 139])
    path = torch.tensor([[0, 1, 4, 9, 30, -1], [0, 3, -1, -1, -1, -1], [0, 2, 5, 6, 7, 60]])
    path_len = torch.tensor([5, 2, 6])
    want = cache.clone()
    reference.compact_kv(want, prefix_lens, path, path_len)
    on_device = gpu_backend.to_device(cache)
    gpu_backend.ops.compact_kv(on_device, *[gpu_backend.to_device(t) for t in (prefix_lens, path, path_len)])
    assert torch.equal(on_device.cpu(), want)


def test_gpu_kernels_check_their_inputs(gpu_backend):
    q, k, v, lens, mask = make_inputs(*SHAPES[1], dtype=torch.float32, seed=50)
    with pytest.raises(RuntimeError, match=r"v_cache must have the shape of k_cache"):
        gpu_backend.run("tree_attention", q, k, v[:, :, :-1], lens, mask)
    with pytest.raises(RuntimeError, match=r"num_splits must be >= 1, got 0"):
        gpu_backend.run("tree_attention_partial", q, k, v, lens, mask, 0)
    big = torch.zeros(1, 1, 1, 1025)
    with pytest.raises(RuntimeError, match=r"the GPU kernel supports head dims up to \d+, got 1025"):
        gpu_backend.run("tree_attention", big, big, big, torch.tensor([0]), torch.ones(1, 1, 1, dtype=torch.long))
