"""tree_attention, tree_attention_partial and merge_attention_states against their references."""
import math

import pytest
import torch

from conftest import TOL, gen, randn, random_parents
from jakiro_ext import ops
from jakiro_ext.ops import reference
from op_cases.attention import ATTENTION_SHAPES, make_inputs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", ATTENTION_SHAPES, ids=lambda s: "x".join(map(str, s[:5])) + f"-p{max(s[5])}")
@pytest.mark.covers("tree_attention", "adversarial_shapes")
def test_tree_attention_matches_reference(shape, dtype):
    q, k, v, lens, mask = make_inputs(*shape, dtype=dtype, seed=10)
    out, lse = ops.tree_attention(q, k, v, lens, mask)
    ref_out, ref_lse = reference.tree_attention(q, k, v, lens, mask)
    assert out.dtype == dtype and out.shape == q.shape and lse.shape == q.shape[:3]
    torch.testing.assert_close(out.float(), ref_out.float(), **TOL[dtype])
    torch.testing.assert_close(lse, ref_lse, **TOL[torch.float32])


@pytest.mark.parametrize("shape", ATTENTION_SHAPES, ids=lambda s: "x".join(map(str, s[:5])) + f"-p{max(s[5])}")
@pytest.mark.covers("tree_attention", "adversarial_shapes")
def test_tree_attention_float32_queries_over_a_bf16_cache(shape):
    # A quantized target's cache on the CPU: bf16 keys and values widened exactly, the arithmetic
    # float32 (the reference reads the same bf16 values as float32); with a split too.
    q, k, v, lens, mask = make_inputs(*shape, dtype=torch.float32, seed=12)
    k, v = k.bfloat16(), v.bfloat16()
    ref_out, ref_lse = reference.tree_attention(q, k, v, lens, mask)
    for splits in (None, 3):
        out, lse = ops.tree_attention(q, k, v, lens, mask, num_splits=splits)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, ref_out, **TOL[torch.float32])
        torch.testing.assert_close(lse, ref_lse, **TOL[torch.float32])


@pytest.mark.parametrize("num_splits", [1, 2, 5, 13, 150])  # 150: more splits than some sequences have keys
@pytest.mark.parametrize("shape", [ATTENTION_SHAPES[1], ATTENTION_SHAPES[2], ATTENTION_SHAPES[3]], ids=["9-3", "24-3", "8-8-long"])
@pytest.mark.covers("tree_attention_partial", "adversarial_shapes")
def test_tree_attention_partial_matches_reference_on_splits(shape, num_splits):
    q, k, v, lens, mask = make_inputs(*shape, dtype=torch.float32, seed=20)
    out_p, lse_p = ops.tree_attention_partial(q, k, v, lens, mask, num_splits)
    ref_p, ref_lse_p = reference.tree_attention_partial(q, k, v, lens, mask, num_splits)
    assert out_p.shape == (*q.shape[:3], num_splits, q.shape[3])
    torch.testing.assert_close(out_p, ref_p, **TOL[torch.float32])
    torch.testing.assert_close(lse_p, ref_lse_p, **TOL[torch.float32])  # -inf for empty splits on both
    # Whatever the split count, the merged result is the same attention.
    out, lse = ops.merge_attention_states(out_p, lse_p, q.dtype)
    full_out, full_lse = reference.tree_attention(q, k, v, lens, mask)
    torch.testing.assert_close(out, full_out, **TOL[torch.float32])
    torch.testing.assert_close(lse, full_lse, **TOL[torch.float32])
    explicit_out, _ = ops.tree_attention(q, k, v, lens, mask, num_splits=num_splits)
    torch.testing.assert_close(explicit_out, full_out, **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 3, 40])
def test_tree_attention_few_rows_streaming_path_with_splits(num_splits, dtype):
    # G * T <= 8 query rows per task: the kernel streams K/V instead of calling a GEMM.
    q, k, v, lens, mask = make_inputs(2, 2, 6, 2, 64, [900, 41], 1000, dtype=dtype, seed=60)
    out, lse = ops.tree_attention(q, k, v, lens, mask, num_splits=num_splits)
    ref_out, ref_lse = reference.tree_attention(q, k, v, lens, mask)
    torch.testing.assert_close(out.float(), ref_out.float(), **TOL[dtype])
    torch.testing.assert_close(lse, ref_lse, **TOL[torch.float32])


def test_tree_attention_noncontiguous_q_and_padded_mask():
    q, k, v, lens, mask = make_inputs(*ATTENTION_SHAPES[1], dtype=torch.float32, seed=61)
    q_strided = q.transpose(1, 2).contiguous().transpose(1, 2)  # same values, other strides
    padded = torch.cat([mask, torch.full_like(mask, -1)], dim=2)  # extra words are ignored
    out, lse = ops.tree_attention(q_strided, k, v, lens, padded, num_splits=2)
    ref_out, ref_lse = reference.tree_attention(q, k, v, lens, mask)
    torch.testing.assert_close(out, ref_out, **TOL[torch.float32])
    torch.testing.assert_close(lse, ref_lse, **TOL[torch.float32])


def test_tree_attention_arbitrary_masks_and_fully_masked_rows():
    # Not just ancestor masks: any bit pattern, including rows that see nothing (no prefix):
    # those give zeros and lse = -inf, never NaN.
    B, T, Hq, Hkv, D = 2, 70, 6, 3, 64
    q = randn(B, T, Hq, D, seed=1)
    k = randn(B, Hkv, 100, D, seed=2)
    v = randn(B, Hkv, 100, D, seed=3)
    bits = torch.rand(B, T, T, generator=gen(4)) < 0.3
    bits[0, 5] = False
    mask = ops.pack_bits(bits)
    lens = torch.tensor([0, 30])
    for splits in (1, 3):
        out, lse = ops.tree_attention(q, k, v, lens, mask, num_splits=splits)
        ref_out, ref_lse = reference.tree_attention(q, k, v, lens, mask)
        torch.testing.assert_close(out, ref_out, **TOL[torch.float32])
        torch.testing.assert_close(lse, ref_lse, **TOL[torch.float32])
        assert torch.all(out[0, 5] == 0) and torch.all(lse[0, 5] == -math.inf)
        assert not torch.isnan(out).any()


def test_tree_attention_reads_layer_slices_of_one_cache_buffer():
    # The engine keeps every layer's K and V in one [L, 2, B, H, S, D] buffer and passes slices.
    L, B, T, Hq, Hkv, D, S = 3, 2, 9, 6, 2, 64, 80
    buf = randn(L, 2, B, Hkv, S, D, seed=5)
    q = randn(B, T, Hq, D, seed=6)
    mask = ops.build_tree_mask(random_parents(B, T, seed=7))
    lens = torch.tensor([40, 71])
    out, _ = ops.tree_attention(q, buf[1, 0], buf[1, 1], lens, mask, num_splits=2)
    ref, _ = reference.tree_attention(q, buf[1, 0].clone(), buf[1, 1].clone(), lens, mask)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


def test_tree_attention_scale_argument():
    q, k, v, lens, mask = make_inputs(*ATTENTION_SHAPES[1], dtype=torch.float32, seed=30)
    out, lse = ops.tree_attention(q, k, v, lens, mask, scale=0.3)
    ref_out, ref_lse = reference.tree_attention(q, k, v, lens, mask, scale=0.3)
    torch.testing.assert_close(out, ref_out, **TOL[torch.float32])
    torch.testing.assert_close(lse, ref_lse, **TOL[torch.float32])


def test_build_tree_mask_is_ancestor_closure():
    parents = random_parents(3, 150, seed=8)
    sees = reference.unpack_tree_mask(ops.build_tree_mask(parents), 150)
    for b in range(3):
        for i in range(150):
            expected, node = set(), i
            while node >= 0:
                expected.add(node)
                node = int(parents[b, node])
            assert set(torch.nonzero(sees[b, i]).flatten().tolist()) == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_attention_states_matches_reference(dtype):
    out_p = randn(2, 7, 5, 4, 64, seed=9)
    lse_p = randn(2, 7, 5, 4, seed=10, scale=3.0)
    lse_p[0, 0, 0] = -math.inf  # every split empty
    lse_p[1, 2, :, 1] = -math.inf  # one split empty
    out, lse = ops.merge_attention_states(out_p, lse_p, dtype)
    ref_out, ref_lse = reference.merge_attention_states(out_p, lse_p, dtype)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref_out.float(), **TOL[dtype])
    torch.testing.assert_close(lse, ref_lse, **TOL[torch.float32])
    assert torch.all(out[0, 0, 0] == 0) and lse[0, 0, 0] == -math.inf


@pytest.mark.parametrize("shape", [(1, 1, 1, 1, 1), (1, 3, 1, 2, 54), (3, 1, 9, 1, 7), (2, 5, 2, 6, 128)],
                         ids=lambda s: "B{}-T{}-S{}-H{}-D{}".format(*s))
@pytest.mark.covers("merge_attention_states", "adversarial_shapes")
def test_merge_attention_states_adversarial_shapes(shape):
    """One split, one head, one dimension, odd head dims, many splits of one row; empty splits."""
    B, T, splits, H, D = shape
    out_p = randn(B, T, H, splits, D, seed=sum(shape))  # [..., splits, D]
    lse_p = randn(B, T, H, splits, seed=sum(shape) + 1, scale=4.0)
    lse_p[0, 0, 0, 0] = -math.inf  # an empty split (the only one, when splits = 1)
    for dtype in (torch.float32, torch.bfloat16):
        out, lse = ops.merge_attention_states(out_p, lse_p, dtype)
        ref_out, ref_lse = reference.merge_attention_states(out_p, lse_p, dtype)
        assert out.shape == (B, T, H, D) and out.dtype == dtype and lse.shape == (B, T, H)
        torch.testing.assert_close(out.float(), ref_out.float(), **TOL[dtype], equal_nan=True)
        torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5, equal_nan=True)


def test_tree_attention_opcheck():
    q, k, v, lens, mask = make_inputs(*ATTENTION_SHAPES[1], dtype=torch.float32, seed=40)
    torch.library.opcheck(torch.ops.jakiro.tree_attention.default, (q, k, v, lens, mask, None, 2))
    torch.library.opcheck(torch.ops.jakiro.tree_attention.default, (q.bfloat16(), k.bfloat16(), v.bfloat16(), lens, mask))
    torch.library.opcheck(torch.ops.jakiro.tree_attention.default, (q, k.bfloat16(), v.bfloat16(), lens, mask))


def test_tree_attention_partial_opcheck():
    q, k, v, lens, mask = make_inputs(*ATTENTION_SHAPES[1], dtype=torch.float32, seed=41)
    torch.library.opcheck(torch.ops.jakiro.tree_attention_partial.default, (q, k, v, lens, mask, 3, None))


def test_merge_attention_states_opcheck():
    out_p, lse_p = randn(2, 3, 4, 3, 64, seed=42), randn(2, 3, 4, 3, seed=43)
    torch.library.opcheck(torch.ops.jakiro.merge_attention_states.default, (out_p, lse_p, torch.bfloat16))


def test_tree_attention_bad_input_errors():
    q, k, v, lens, mask = make_inputs(*ATTENTION_SHAPES[1], dtype=torch.float32, seed=50)
    cases = [
        (dict(q=q[0]), r"q must have 4 dimensions \[B, T, Hq, D\]"),
        (dict(k_cache=k[:, :2]), r"multiple of KV heads"),
        (dict(v_cache=v[:, :, :100]), r"v_cache must have the shape of k_cache"),
        (dict(k_cache=k.double(), v_cache=v.double()), r"k_cache must have the dtype of q"),
        (dict(q=q.bfloat16()), r"k_cache must have the dtype of q \(BFloat16\), got Float"),
        (dict(v_cache=v.bfloat16()), r"v_cache must have the dtype of k_cache \(Float\), got BFloat16"),
        (dict(q=q.half(), k_cache=k.half(), v_cache=v.half()), r"q must have dtype Float or BFloat16"),
        (dict(tree_mask=mask[..., :0]), r"tree_mask is too short: 17 tree tokens need 1 int64 words"),
        (dict(tree_mask=mask.int()), r"tree_mask must have dtype Long"),
        (dict(prefix_lens=torch.tensor([0, 112])), r"prefix_lens\[1\] \+ tree tokens = 112 \+ 17 .* capacity 128"),
        (dict(prefix_lens=torch.tensor([0, -1])), r"prefix_lens\[1\]"),
        (dict(prefix_lens=lens.int()), r"prefix_lens must have dtype Long"),
        (dict(prefix_lens=lens[:1]), r"prefix_lens.shape\[0\] \(batch\) must be 2"),
        (dict(k_cache=k.transpose(2, 3).contiguous().transpose(2, 3)), r"v_cache must have the strides of k_cache"),
        (dict(k_cache=k.transpose(2, 3).contiguous().transpose(2, 3), v_cache=v.transpose(2, 3).contiguous().transpose(2, 3)),
         r"contiguous \[S, D\] rows"),
    ]
    for change, message in cases:
        args = dict(q=q, k_cache=k, v_cache=v, prefix_lens=lens, tree_mask=mask)
        args.update(change)
        with pytest.raises(RuntimeError, match=message):
            ops.tree_attention(**args)


def test_tree_attention_partial_bad_input_errors():
    q, k, v, lens, mask = make_inputs(*ATTENTION_SHAPES[1], dtype=torch.float32, seed=51)
    with pytest.raises(RuntimeError, match="num_splits must be >= 1, got 0"):
        ops.tree_attention_partial(q, k, v, lens, mask, 0)
    with pytest.raises(RuntimeError, match=r"jakiro::tree_attention_partial: q must have 4 dimensions"):
        ops.tree_attention_partial(q[0], k, v, lens, mask, 2)


def test_merge_attention_states_bad_input_errors():
    with pytest.raises(RuntimeError, match=r"lse_partial must have shape out_partial.shape\[:4\]"):
        ops.merge_attention_states(torch.zeros(1, 2, 3, 4, 8), torch.zeros(1, 2, 3, 5))
    with pytest.raises(RuntimeError, match=r"out_partial must have dtype Float, got BFloat16"):
        ops.merge_attention_states(torch.zeros(1, 2, 3, 4, 8, dtype=torch.bfloat16), torch.zeros(1, 2, 3, 4))
    with pytest.raises(RuntimeError, match=r"there must be at least one split"):
        ops.merge_attention_states(torch.zeros(1, 2, 3, 0, 8), torch.zeros(1, 2, 3, 0))
    with pytest.raises(RuntimeError, match=r"the head dim \(out_partial.shape\[4\]\) must be >= 1"):
        ops.merge_attention_states(torch.zeros(1, 2, 3, 4, 0), torch.zeros(1, 2, 3, 4))
    with pytest.raises(RuntimeError, match=r"out_dtype must be float32 or bfloat16, got Half"):
        ops.merge_attention_states(torch.zeros(1, 2, 3, 4, 8), torch.zeros(1, 2, 3, 4), torch.float16)


@pytest.mark.parametrize("cache", [torch.float32, torch.bfloat16])
def test_a_sequences_attention_does_not_depend_on_its_batch(cache):
    # For trees of up to 64 tokens the automatic splits are fixed-length, counted from each
    # sequence's first key: a sequence gets bit-identical results alone and batched with longer
    # or shorter ones (the even split of old depended on the batch's longest sequence and size).
    g = torch.Generator().manual_seed(0)
    B, T, Hq, Hkv, D, S = 3, 5, 6, 2, 32, 2300
    q = torch.randn(B, T, Hq, D, generator=g)
    k, v = torch.randn(B, Hkv, S, D, generator=g).to(cache), torch.randn(B, Hkv, S, D, generator=g).to(cache)
    lens = torch.tensor([300, 2100, 1100])
    mask = ops.build_tree_mask(torch.tensor([[-1, 0, 0, 1, 2]] * B))
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            out, lse = ops.tree_attention(q, k, v, lens, mask)
            for b in range(B):
                alone, alone_lse = ops.tree_attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], lens[b:b + 1], mask[b:b + 1])
                assert torch.equal(alone, out[b:b + 1]) and torch.equal(alone_lse, lse[b:b + 1])
            torch.testing.assert_close(out, reference.tree_attention(q, k, v, lens, mask)[0], rtol=1e-4, atol=1e-5)
    finally:
        torch.set_num_threads(threads)


def one_token_steps(q, k, v, prefix, parents, num_splits=None):
    """Each tree token's attention as a one-token step computes it: its ancestors' keys committed
    after the prefix (root first), then its own key."""
    steps = []
    for t in range(parents.numel()):
        path = [t]
        while parents[path[0]] >= 0:
            path.insert(0, int(parents[path[0]]))
        keys = torch.tensor(path) + prefix
        k1 = torch.cat([k[:, :, :prefix], k[:, :, keys]], 2)
        v1 = torch.cat([v[:, :, :prefix], v[:, :, keys]], 2)
        out, _ = ops.tree_attention(q[:, t:t + 1], k1, v1, torch.tensor([prefix + len(path) - 1]),
                                    ops.build_tree_mask(torch.tensor([[-1]])), num_splits=num_splits)
        steps.append(out[0, 0])
    return steps


@pytest.mark.parametrize("dtype,cache,dim", [(torch.float32, torch.float32, 64), (torch.float32, torch.bfloat16, 64),
                                             (torch.bfloat16, torch.bfloat16, 64), (torch.float32, torch.float32, 40)])
def test_a_tree_tokens_attention_is_its_one_token_steps_bits(dtype, cache, dim):
    # A tree token attends to the prefix, then to its ancestors and itself: the keys a one-token
    # step of the same token sees once its ancestors are committed. It gets that step's bits,
    # whatever siblings the tree lays between them and wherever the fixed splits of 512 keys cut
    # (a quantized target's next layer re-quantizes the row: a last-bit difference there can
    # change a token). Dim 40: the products without 512-bit vectors.
    Hq, Hkv = 9, 3
    trees = [torch.tensor([-1, 0, 0]), random_parents(1, 40, seed=31, max_children=3)[0],
             random_parents(1, 64, seed=32)[0]]
    for i, parents in enumerate(trees):
        T = parents.numel()
        mask = ops.build_tree_mask(parents[None])
        for prefix in (0, 1, 100, 480, 497, 509, 511, 512, 1030):
            g = torch.Generator().manual_seed(1000 * i + prefix)
            q = torch.randn(1, T, Hq, dim, generator=g).to(dtype)
            k = torch.randn(1, Hkv, prefix + T, dim, generator=g).to(cache)
            v = torch.randn(1, Hkv, prefix + T, dim, generator=g).to(cache)
            out, _ = ops.tree_attention(q, k, v, torch.tensor([prefix]), mask)
            for t, step in enumerate(one_token_steps(q, k, v, prefix, parents)):
                assert torch.equal(out[0, t], step), (T, prefix, t)


def test_splits_the_caller_chooses_keep_the_masked_keys_in_place():
    # With num_splits given, split s is the keys [s * chunk, (s + 1) * chunk) where they lie (the
    # masked ones too: reference.tree_attention_partial); a tree token's result is then only close
    # to its one-token step's (here some rows differ in their last bits: what the fixed splits
    # above do not do).
    Hq, Hkv, D, prefix = 9, 3, 64, 140
    parents = random_parents(1, 40, seed=31, max_children=3)[0]
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 40, Hq, D, generator=g)
    k, v = torch.randn(1, Hkv, prefix + 40, D, generator=g), torch.randn(1, Hkv, prefix + 40, D, generator=g)
    mask = ops.build_tree_mask(parents[None])
    out, _ = ops.tree_attention(q, k, v, torch.tensor([prefix]), mask, num_splits=1)
    steps = one_token_steps(q, k, v, prefix, parents, num_splits=1)
    for t, step in enumerate(steps):
        torch.testing.assert_close(out[0, t], step, **TOL[torch.float32])
    assert not all(torch.equal(out[0, t], step) for t, step in enumerate(steps))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_long_run_goes_in_tiles_that_read_only_the_keys_they_see(dtype):
    # Beyond 64 tokens (a prompt's chunk) the tokens go in tiles, each reading the keys up to the
    # last one its mask rows set: a causal chunk after a prefix; tiles whose rows see no tree
    # key at all (the prefix only; with no prefix: nothing, zeros and lse -inf); a row of the
    # first tile seeing the last token; mask bits past the tree and extra mask words ignored.
    B, T, Hq, Hkv, D = 3, 150, 6, 2, 32
    q = randn(B, T, Hq, D, seed=71, dtype=dtype)
    k, v = randn(B, Hkv, 800, D, seed=72, dtype=dtype), randn(B, Hkv, 800, D, seed=73, dtype=dtype)
    bits = torch.ones(T, T).tril().bool().expand(B, T, T).clone()
    bits[1, 64:128] = False  # a whole tile sees only the prefix
    bits[2, 128:] = False    # the last tile sees nothing (no prefix)
    bits[0, 3, T - 1] = True  # the first tile reaches the last token
    lens = torch.tensor([600, 37, 0])  # 750 keys: the tiles cross a block of 512 keys
    mask = ops.pack_bits(bits)
    garbage = mask.clone()
    garbage[..., -1] |= -(1 << (T % 64))  # the last word's bits past the tree set
    garbage = torch.cat([garbage, torch.full_like(garbage[..., :1], -1)], 2)  # and an extra word of ones
    ref_out, ref_lse = reference.tree_attention(q, k, v, lens, mask)
    for m in (mask, garbage):
        out, lse = ops.tree_attention(q, k, v, lens, m)
        torch.testing.assert_close(out, ref_out, **TOL[dtype])
        torch.testing.assert_close(lse, ref_lse, **TOL[dtype])
    assert torch.all(out[2, 128:] == 0) and torch.all(lse[2, 128:] == -math.inf)
    for splits in (1, 4):
        out, lse = ops.tree_attention_partial(q, k, v, lens, garbage, num_splits=splits)
        merged, merged_lse = ops.merge_attention_states(out, lse, dtype)
        torch.testing.assert_close(merged, ref_out, **TOL[dtype])
        torch.testing.assert_close(merged_lse, ref_lse, **TOL[dtype])
