"""The GPU kernels of tree attention, the split-KV merge and KV compaction (csrc/cuda) against
the references, on the op tests' shapes: under the SIMT emulator with warp widths 32 and 64, and
on a CUDA device when there is one (fixture gpu_backend, conftest.py)."""
import pytest
import torch

from conftest import TOL, randn, random_parents
from jakiro_ext import ops
from jakiro_ext.ops import reference
from op_cases.attention import ATTENTION_SHAPES, make_inputs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", ATTENTION_SHAPES, ids=lambda s: "x".join(map(str, s[:5])) + f"-p{max(s[5])}")
def test_gpu_tree_attention_matches_reference(gpu_backend, shape, dtype):
    q, k, v, lens, mask = make_inputs(*shape, dtype=dtype, seed=10)
    out, lse = gpu_backend.run("tree_attention", q, k, v, lens, mask)
    ref_out, ref_lse = reference.tree_attention(q, k, v, lens, mask)
    assert out.dtype == dtype and out.shape == q.shape and lse.shape == q.shape[:3]
    torch.testing.assert_close(out.float(), ref_out.float(), **TOL[dtype])
    torch.testing.assert_close(lse, ref_lse, **TOL[torch.float32])


# 150 splits: more than some sequences have keys (empty splits).
SPLIT_CASES = [(ATTENTION_SHAPES[1], 1), (ATTENTION_SHAPES[1], 2), (ATTENTION_SHAPES[1], 150), (ATTENTION_SHAPES[2], 13), (ATTENTION_SHAPES[5], 5)]


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
    q, k, v, lens, mask = make_inputs(*ATTENTION_SHAPES[1], dtype=torch.float32, seed=50)
    with pytest.raises(RuntimeError, match=r"v_cache must have the shape of k_cache"):
        gpu_backend.run("tree_attention", q, k, v[:, :, :-1], lens, mask)
    with pytest.raises(RuntimeError, match=r"num_splits must be >= 1, got 0"):
        gpu_backend.run("tree_attention_partial", q, k, v, lens, mask, 0)
    with pytest.raises(RuntimeError, match=r"k_cache in bfloat16 beside float32 q is read by the CPU kernels only"):
        gpu_backend.run("tree_attention", q, k.bfloat16(), v.bfloat16(), lens, mask)
    big = torch.zeros(1, 1, 1, 1025)
    with pytest.raises(RuntimeError, match=r"the GPU kernel supports head dims up to \d+, got 1025"):
        gpu_backend.run("tree_attention", big, big, big, torch.tensor([0]), torch.ones(1, 1, 1, dtype=torch.long))


# ----------------------------------------------------------------------------- tensor cores
# bf16 trees of >= 16 query rows per KV head (tree tokens x GQA group) with head dims of a multiple
# of 16 up to 128 run on tensor cores (kernels/tree_attention_wmma.cuh; WMMA, emulated here).
TENSOR_CORE_SHAPES = [
    (2, 17, 9, 3, 64, [0, 97], 128),    # 51 rows per KV head (one block, a partial tile), empty prefix
    (1, 60, 8, 2, 128, [600], 700),     # an EAGLE-sized tree, GQA 4: 240 rows, four blocks
    (2, 16, 4, 4, 32, [37, 300], 400),  # exactly one tile, keys not a multiple of 16
    (1, 20, 2, 1, 16, [150], 200),      # one 16-dim step
]
# (Fixed splits: a row's last 64 to 79 keys are summed in float, not in tiles; each case has more.)


@pytest.mark.parametrize("shape", TENSOR_CORE_SHAPES, ids=lambda s: "x".join(map(str, s[:5])) + f"-p{max(s[5])}")
@pytest.mark.parametrize("num_splits", [None, 3])
def test_gpu_tree_attention_on_tensor_cores_matches_reference(gpu_backend, shape, num_splits, monkeypatch):
    monkeypatch.delenv("JAKIRO_GPU_TENSOR_CORES", raising=False)  # (a run may have switched them off)
    q, k, v, lens, mask = make_inputs(*shape, dtype=torch.bfloat16, seed=50)
    out, lse = gpu_backend.run("tree_attention", q, k, v, lens, mask, num_splits=num_splits)
    ref_out, ref_lse = reference.tree_attention(q, k, v, lens, mask)
    torch.testing.assert_close(out.float(), ref_out.float(), **TOL[torch.bfloat16])
    torch.testing.assert_close(lse, ref_lse, **TOL[torch.float32])  # the softmax sum stays in float
    # The CUDA-core kernel (JAKIRO_GPU_TENSOR_CORES=0) rounds differently: the switch took effect.
    monkeypatch.setenv("JAKIRO_GPU_TENSOR_CORES", "0")
    cuda_cores, _ = gpu_backend.run("tree_attention", q, k, v, lens, mask, num_splits=num_splits)
    torch.testing.assert_close(cuda_cores.float(), ref_out.float(), **TOL[torch.bfloat16])
    assert not torch.equal(cuda_cores, out)


def test_gpu_tree_attention_on_tensor_cores_empty_splits_and_masked_rows(gpu_backend):
    q, k, v, lens, mask = make_inputs(2, 16, 4, 2, 32, [0, 21], 64, dtype=torch.bfloat16, seed=60)
    mask[0, 5] = 0  # a row that sees nothing (sequence 0 has no prefix)
    out_p, lse_p = gpu_backend.run("tree_attention_partial", q, k, v, lens, mask, 40)  # 40 splits: most empty
    ref_p, ref_lse_p = reference.tree_attention_partial(q, k, v, lens, mask, 40)
    torch.testing.assert_close(out_p, ref_p, **TOL[torch.bfloat16])
    torch.testing.assert_close(lse_p, ref_lse_p, **TOL[torch.float32])  # -inf for the empty splits on both
    out, lse = gpu_backend.run("tree_attention", q, k, v, lens, mask)
    assert torch.equal(out[0, 5].float(), torch.zeros(4, 32)) and bool(torch.isneginf(lse[0, 5]).all())


# Where a non-finite value goes: q, a prefix key, a tree key that some rows do not see, a prefix
# value, a tree value that some rows do not see (0 * NaN must not reach them), a value past the tree.
NONFINITE_PLACES = {"nan_in_q": ("q", (0, 3, 1, 5)), "inf_in_prefix_key": ("k", (0, 1, 9, 2)),
                    "nan_in_masked_tree_key": ("k", (0, 0, 30 + 2, 3)), "nan_in_prefix_value": ("v", (0, 1, 4, 7)),
                    "nan_in_masked_tree_value": ("v", (0, 0, 30 + 2, 6)), "nan_beyond_the_tree": ("v", (0, 0, 30 + 9, 1))}


@pytest.mark.parametrize("place", list(NONFINITE_PLACES))
def test_gpu_tree_attention_on_tensor_cores_nonfinite_reaches_only_what_reads_it(gpu_backend, place):
    q, k, v, lens, _ = make_inputs(1, 8, 8, 2, 16, [30], 48, dtype=torch.bfloat16, seed=70)  # 32 rows per KV head
    mask = ops.build_tree_mask(torch.tensor([[-1, 0, 0, 1, 2, 2, 3, 4]]))  # node 2: seen by 2, 4, 5, 7 only
    name, index = NONFINITE_PLACES[place]
    dict(q=q, k=k, v=v)[name][index] = float("inf") if place.startswith("inf") else float("nan")
    out, lse = gpu_backend.run("tree_attention", q, k, v, lens, mask, num_splits=2)
    ref_out, ref_lse = reference.tree_attention(q.float(), k.float(), v.float(), lens, mask, num_splits=2)
    assert torch.equal(out.float().isnan(), ref_out.isnan()) and torch.equal(lse.isnan(), ref_lse.isnan()), place
    assert bool(out.float().isnan().any()) == (place != "nan_beyond_the_tree")
    finite = ~ref_out.isnan()
    torch.testing.assert_close(out.float()[finite], ref_out[finite], **TOL[torch.bfloat16])


def _one_token_steps(backend, q, k, v, lens, parents, capacity):
    """Every tree token's one-token step, as plain decoding computes it: its ancestors' keys and
    values committed after the prefix (in depth order, itself last), in a cache of `capacity`."""
    B, T, _, D = q.shape
    out, lse = torch.empty_like(q), torch.empty(q.shape[:3])
    one = ops.build_tree_mask(torch.tensor([[-1]]))
    for b in range(B):
        P = int(lens[b])
        for t in range(T):
            path = [t]
            while int(parents[b, path[-1]]) >= 0:
                path.append(int(parents[b, path[-1]]))
            keys = torch.tensor(list(range(P)) + [P + i for i in reversed(path)])
            k1, v1 = (torch.zeros(1, k.shape[1], capacity, D, dtype=k.dtype) for _ in range(2))
            k1[0, :, :len(keys)], v1[0, :, :len(keys)] = k[b, :, keys], v[b, :, keys]
            o, l = backend.run("tree_attention", q[b:b + 1, t:t + 1], k1, v1, torch.tensor([len(keys) - 1]), one)
            out[b, t], lse[b, t] = o[0, 0], l[0, 0]
    return out, lse


# (parents, prefix lengths, q heads, kv heads, head dim, dtype, the tree's and the steps' cache capacities)
ONE_TOKEN_STEP_CASES = {
    "chain16": ([list(range(-1, 15))], [300], 4, 2, 64, torch.float32, 512, 1024),
    "branching16-bf16": ([[-1, 0, 0, 1, 1, 2, 3, 3, 4, 5, 6, 8, 8, 9, 11, 12]], [300], 9, 3, 64, torch.bfloat16, 1024, 512),
    "batch2-splits": ("random", [37, 520], 4, 4, 32, torch.float32, 768, 2048),
    "eagle60-gqa4-bf16": ("random60", [250], 8, 2, 128, torch.bfloat16, 512, 1024),
}


@pytest.mark.parametrize("case", list(ONE_TOKEN_STEP_CASES))
def test_a_tree_rows_attention_is_its_one_token_steps_bits(any_backend, case):
    """Each row of a tree (siblings between a row's ancestors, prefixes across split boundaries)
    against the same token's one-token step with its ancestors committed, in a cache of another
    capacity: the same bits (output and log-sum-exp). Both kernels split a row's own run (the
    prefix, then its ancestors, then itself) at fixed positions, so a tree's verification gives
    plain decoding's tokens even at a near tie. Splits the caller chose cut the keys as they lie:
    there rows differ (the comparison can fail)."""
    parents, prefix, Hq, Hkv, D, dtype, capacity, step_capacity = ONE_TOKEN_STEP_CASES[case]
    if parents == "random":
        parents = random_parents(2, 24, seed=3, max_children=3)
    elif parents == "random60":
        parents = random_parents(1, 60, seed=4, max_children=4)
    parents = torch.as_tensor(parents)
    B, T = parents.shape
    lens = torch.tensor(prefix)
    q = randn(B, T, Hq, D, seed=80, dtype=dtype)
    k, v = (randn(B, Hkv, capacity, D, seed=81 + i, dtype=dtype) for i in range(2))
    mask = ops.build_tree_mask(parents)
    tree, tree_lse = any_backend.run("tree_attention", q, k, v, lens, mask)
    steps, steps_lse = _one_token_steps(any_backend, q, k, v, lens, parents, step_capacity)
    differ = [(b, t) for b in range(B) for t in range(T)
              if not (torch.equal(tree[b, t], steps[b, t]) and torch.equal(tree_lse[b, t], steps_lse[b, t]))]
    assert differ == []
    torch.testing.assert_close(tree.float(), reference.tree_attention(q, k, v, lens, mask)[0].float(), **TOL[dtype])
    even, even_lse = any_backend.run("tree_attention", q, k, v, lens, mask, num_splits=3)
    assert not (torch.equal(even, steps) and torch.equal(even_lse, steps_lse))


def test_gpu_tree_attention_fixed_splits_same_bits_from_an_unaligned_cache(gpu_backend):
    """The tensor-core kernel's near runs read keys with 16-byte loads where rows are aligned and
    one element at a time where not (a cache at an odd offset): the same sums, the same bits."""
    q, k, v, lens, mask = make_inputs(1, 20, 8, 2, 64, [150], 200, dtype=torch.bfloat16, seed=90)
    shifted = [torch.empty(t.numel() + 1, dtype=t.dtype)[1:].view(t.shape).copy_(t) for t in (k, v)]
    assert shifted[0].data_ptr() % 16 != 0
    out, lse = gpu_backend.run("tree_attention", q, k, v, lens, mask)
    out_shifted, lse_shifted = gpu_backend.run("tree_attention", q, *shifted, lens, mask)
    assert torch.equal(out, out_shifted) and torch.equal(lse, lse_shifted)
    torch.testing.assert_close(out.float(), reference.tree_attention(q, k, v, lens, mask)[0].float(), **TOL[torch.bfloat16])
