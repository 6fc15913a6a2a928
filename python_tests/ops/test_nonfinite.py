"""Non-finite values in every op, on every backend (the CPU kernels, and the GPU kernels under
the SIMT emulator at warp widths 32 and 64 and on CUDA when there is one): the semantics of the
README's "Non-finite values" convention, the same as the references', whatever the split count.
Also the checks every op shares: one device for all inputs, a finite attention scale, valid
parents in build_tree_mask."""
import math

import pytest
import torch

import jakiro_ext as J
from conftest import randn
from jakiro_ext.ops import quantized, reference
from op_cases.decoder_layer import Layer, Layers
from op_cases.mlp_heads import make_mlp_heads
from op_cases.norm_rope import rope_case

NAN, INF = math.nan, math.inf


def assert_same(actual, expected, atol=2e-5):
    """Equal within float32 tolerance, NaN where the other is NaN (and nowhere else)."""
    torch.testing.assert_close(actual, expected, atol=atol, rtol=atol, equal_nan=True)


# ----------------------------------------------------------------------------- tree attention
B, T, HQ, HKV, D, PREFIX, S = 1, 4, 4, 2, 16, 300, 320
PARENTS = torch.tensor([[-1, 0, 0, 1]])  # node 2 does not see node 1; node 3 sees 0 and 1


def attention_inputs():
    q, k, v = randn(B, T, HQ, D, seed=1), randn(B, HKV, S, D, seed=2), randn(B, HKV, S, D, seed=3)
    return q, k, v, torch.tensor([PREFIX]), J.build_tree_mask(PARENTS)


# name -> (where the non-finite value goes, expected NaN rows of out [T, HQ] as (token, head) pairs;
# lse NaN exactly where the scores are poisoned)
ATTENTION_CASES = {
    "nan_in_q": (("q", (0, 2, 1, 5), NAN), "scores"),
    "inf_in_q": (("q", (0, 2, 1, 5), INF), "scores"),
    "nan_in_prefix_key": (("k", (0, 1, 40, 3), NAN), "scores"),
    "nan_in_masked_tree_key": (("k", (0, 1, PREFIX + 1, 3), NAN), "scores"),  # node 1: seen by 1 and 3
    "nan_in_prefix_value": (("v", (0, 0, 250, 7), NAN), "values"),
    "nan_in_masked_tree_value": (("v", (0, 0, PREFIX + 1, 7), NAN), "values"),
    "nan_beyond_the_tree": (("v", (0, 0, PREFIX + T + 2, 7), NAN), "values"),  # never read
}


def expected_nan_rows(case):
    (tensor, index, _), kind = ATTENTION_CASES[case]
    rows = torch.zeros(T, HQ, dtype=torch.bool)
    group = HQ // HKV
    if tensor == "q":
        rows[index[1], index[2]] = True
        return rows
    heads = slice(index[1] * group, (index[1] + 1) * group)
    key = index[2]
    if key < PREFIX:
        rows[:, heads] = True
    elif key < PREFIX + T:
        node = key - PREFIX
        sees = reference.unpack_tree_mask(J.build_tree_mask(PARENTS), T)[0, :, node]
        rows[sees, heads] = True
    return rows


@pytest.mark.parametrize("num_splits", [1, 2, 7, None])
@pytest.mark.parametrize("case", list(ATTENTION_CASES))
@pytest.mark.covers("tree_attention", "nonfinite")
def test_tree_attention_nonfinite_propagates_to_what_reads_it(any_backend, case, num_splits):
    q, k, v, lens, mask = attention_inputs()
    (name, index, value), kind = ATTENTION_CASES[case]
    dict(q=q, k=k, v=v)[name][index] = value
    out, lse = any_backend.run("tree_attention", q, k, v, lens, mask, num_splits=num_splits)
    rows = expected_nan_rows(case)
    assert torch.equal(out[0].isnan().any(-1), rows), case
    assert torch.equal(lse[0].isnan(), rows if kind == "scores" else torch.zeros_like(rows)), case
    ref_out, ref_lse = reference.tree_attention(q, k, v, lens, mask, num_splits=num_splits)
    assert_same(out, ref_out)
    assert_same(lse, ref_lse)


@pytest.mark.parametrize("case", list(ATTENTION_CASES))
@pytest.mark.covers("tree_attention", "nonfinite")
def test_tree_attention_nonfinite_in_a_bf16_cache_beside_float32_queries(case):
    # The CPU kernel's bf16 cache: a non-finite bf16 key or value reaches exactly the rows that read it.
    q, k, v, lens, mask = attention_inputs()
    k, v = k.bfloat16(), v.bfloat16()
    (name, index, value), kind = ATTENTION_CASES[case]
    dict(q=q, k=k, v=v)[name][index] = value
    out, lse = J.tree_attention(q, k, v, lens, mask)
    rows = expected_nan_rows(case)
    assert torch.equal(out[0].isnan().any(-1), rows), case
    assert torch.equal(lse[0].isnan(), rows if kind == "scores" else torch.zeros_like(rows)), case
    ref_out, ref_lse = reference.tree_attention(q, k, v, lens, mask)
    assert_same(out, ref_out)
    assert_same(lse, ref_lse)


@pytest.mark.covers("merge_attention_states", "nonfinite")
def test_merge_attention_states_nonfinite(any_backend):
    out_p = randn(1, 2, 3, 4, 8, seed=5)
    lse_p = randn(1, 2, 3, 4, seed=6)
    lse_p[0, 0, 0, 1] = NAN  # poisons its row
    lse_p[0, 0, 1, 2] = INF  # poisons its row
    lse_p[0, 1, 0, 3] = -INF  # an empty split: its NaN output is not read
    out_p[0, 1, 0, 3] = NAN
    out_p[0, 1, 1, 0, 2] = NAN  # a split that counts: propagates to that dimension
    out, lse = any_backend.run("merge_attention_states", out_p, lse_p)
    assert torch.equal(lse.isnan(), torch.tensor([[[True, True, False], [False, False, False]]]))
    assert out[0, 0, :2].isnan().all() and not out[0, 1, 0].isnan().any()
    assert torch.equal(out[0, 1, 1].isnan(), torch.arange(8) == 2)
    ref_out, ref_lse = reference.merge_attention_states(out_p, lse_p)
    assert_same(out, ref_out)
    assert_same(lse, ref_lse)


@pytest.mark.parametrize("case", list(ATTENTION_CASES))
@pytest.mark.covers("tree_attention_partial", "nonfinite")
def test_tree_attention_partial_nonfinite_matches_reference(any_backend, case):
    """The split half alone: each split's partial state carries the non-finite values as the
    reference's does (a split whose keys hold the NaN, the rows that see it)."""
    q, k, v, lens, mask = attention_inputs()
    (name, index, value), _ = ATTENTION_CASES[case]
    dict(q=q, k=k, v=v)[name][index] = value
    out, lse = any_backend.run("tree_attention_partial", q, k, v, lens, mask, 3)
    ref_out, ref_lse = reference.tree_attention_partial(q, k, v, lens, mask, 3)
    assert_same(out, ref_out)
    assert_same(lse, ref_lse)
    if expected_nan_rows(case).any():  # a value some row reads: some split's state carries it
        assert (~out.isfinite()).any() or (~lse.isfinite()).any()


@pytest.mark.parametrize("scale", [NAN, INF, -INF, 1e39])
@pytest.mark.parametrize("op", ["tree_attention", "tree_attention_partial"])
def test_tree_attention_rejects_a_scale_that_is_not_finite(any_backend, op, scale):
    q, k, v, lens, mask = attention_inputs()
    args = (q, k, v, lens, mask) + ((2,) if op == "tree_attention_partial" else ())
    with pytest.raises(RuntimeError, match=r"scale must be a finite float32 number"):
        any_backend.run(op, *args, scale=scale)


# ----------------------------------------------------------------------------- LM head, MoE, linear
@pytest.mark.parametrize("vocab", [300, 5000])  # 5000: the GPU's split top-k
@pytest.mark.parametrize("where", ["nan_feature", "inf_feature", "nan_lm_head_row", "contrastive_nan_h_b"])
@pytest.mark.covers("contrastive_topk", "nonfinite")
def test_contrastive_topk_row_without_distribution_gives_nan_and_no_token(any_backend, vocab, where):
    h_a, h_b, lm_head = randn(3, 32, seed=7), randn(3, 32, seed=8), randn(vocab, 32, seed=9)
    w = torch.tensor([[0.7, 0.3]] * 3)
    contrastive = where.startswith("contrastive")
    if where == "nan_feature":
        h_a[1, 4] = NAN
    elif where == "inf_feature":
        h_a[1, 4] = INF
    elif where == "nan_lm_head_row":
        lm_head[vocab // 2, 0] = NAN  # every row's logits hold a NaN
    else:
        h_b[1, 4] = NAN
    args = (h_a, h_b, w) if contrastive else (h_a, None, None)
    lp, ids = any_backend.run("contrastive_topk", *args, lm_head, 5)
    bad = torch.tensor([True] * 3) if where == "nan_lm_head_row" else torch.tensor([False, True, False])
    assert lp[bad].isnan().all() and (ids[bad] == -1).all()
    assert lp[~bad].isfinite().all() and (ids[~bad] >= 0).all()
    ref_lp, ref_ids = reference.contrastive_topk(*args, lm_head, 5)
    assert torch.equal(ids, ref_ids)
    assert_same(lp, ref_lp)


@pytest.mark.parametrize("value", [NAN, INF])
@pytest.mark.covers("moe_top2", "nonfinite")
def test_moe_top2_token_with_nonfinite_router_logits_has_no_experts(any_backend, value):
    x = randn(4, 16, seed=10)
    x[2, 3] = value
    weights = (randn(6, 16, seed=11), randn(4, 8, 16, seed=12), randn(4, 8, 16, seed=13), randn(4, 16, 8, seed=14))
    out, expert_out, idx, score, contrast = any_backend.run("moe_top2", x, *weights)
    assert torch.equal(idx[2], torch.tensor([-1, -1])) and (idx[[0, 1, 3]] >= 0).all()
    for t in (out[2], expert_out[2], score[2], contrast[2]):
        assert t.isnan().all()
    assert out[[0, 1, 3]].isfinite().all()
    ref = reference.moe_top2(x, *weights)
    assert torch.equal(idx, ref[2])
    for got, want in zip((out, expert_out, score, contrast), (ref[0], ref[1], ref[3], ref[4])):
        assert_same(got, want, atol=1e-4)


@pytest.mark.covers("linear", "nonfinite")
@pytest.mark.covers("compact_kv", "nonfinite")
def test_linear_and_compact_kv_carry_nan(any_backend):
    x, w = randn(3, 24, seed=15), randn(10, 24, seed=16)
    x[1, 5] = NAN
    y = any_backend.run("linear", x, w)
    assert y[1].isnan().all() and y[[0, 2]].isfinite().all()
    cache = randn(2, 2, 1, 12, 4, seed=17)  # [L * 2, B, H, S, D]
    cache[0, 1, 0, 7, 2] = NAN  # sequence 1's node 3, moved to slot 6
    path = torch.tensor([[0, 1, -1], [0, 1, 3]])
    moved = any_backend.to_device(cache.clone())
    any_backend.ops.compact_kv(moved, *(any_backend.to_device(t) for t in
                                        (torch.tensor([5, 4]), path, torch.tensor([2, 3]))))
    expected = cache.clone()
    reference.compact_kv(expected, torch.tensor([5, 4]), path, torch.tensor([2, 3]))
    assert torch.equal(moved.cpu().view(torch.int32), expected.view(torch.int32))  # bit for bit, NaN moved
    assert moved[0, 1, 0, 6, 2].isnan()


@pytest.mark.parametrize("where", ["x_row", "w_in_head", "block_bias_head"])
@pytest.mark.covers("mlp_heads", "nonfinite")
def test_mlp_heads_nonfinite_stays_in_the_rows_and_heads_that_read_it(any_backend, where):
    """A NaN in a row's input spoils that row (every head), an inf in head j's weights head j
    (every row); nothing else, and the non-finite values are the reference's."""
    x, w_in, b_in, w_blocks, b_blocks = make_mlp_heads(((3,), 20, 3, 8, 2), torch.float32, seed=3)
    if where == "x_row":
        x[1, 4] = NAN
    elif where == "w_in_head":
        w_in[2, 5, 7] = INF
    else:
        b_blocks[0, 1, 3] = -INF
    got = any_backend.run("mlp_heads", x, w_in, b_in, w_blocks, b_blocks)  # [3 rows, 3 heads, 8]
    assert_same(got, reference.mlp_heads(x, w_in, b_in, w_blocks, b_blocks), atol=1e-4)
    bad = torch.zeros(3, 3, dtype=torch.bool)
    bad[{"x_row": (1, slice(None)), "w_in_head": (slice(None), 2), "block_bias_head": (slice(None), 0)}[where]] = True
    assert (~got.isfinite()).any(-1).equal(bad)


def assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    """Every value bit for bit, NaN where the reference has NaN: a NaN's payload is the device's
    (a GPU's arithmetic makes 0x7FFFFFFF where the CPU's keeps 0x7FC00000)."""
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))


@pytest.mark.parametrize("where", ["q", "k", "v", "cos"])
@pytest.mark.covers("rope_kv_write", "nonfinite")
def test_rope_kv_write_nonfinite_goes_where_the_value_goes(any_backend, where):
    """A NaN in one token's q, k, v or rotation reaches that token's q output or cache slot only;
    every other slot of the cache is left as it was (bit for bit, as the reference writes)."""
    B, T, Hq, Hkv, D, S = 2, 3, 4, 2, 8, 12
    qkv, cos, sin, cache, lengths = rope_case(B, T, Hq, Hkv, D, S, torch.float32, seed=9)
    column = {"q": 1, "k": Hq + 1, "v": Hq + Hkv + 1}
    if where == "cos":
        cos[1, 2, 3] = NAN
    else:
        qkv[1, 2, column[where], 3] = NAN
    want_cache = cache.clone()
    want_q = reference.rope_kv_write(qkv, cos, sin, want_cache, lengths)
    got_cache = any_backend.to_device(cache.clone())
    got_q = any_backend.ops.rope_kv_write(*(any_backend.to_device(t) for t in (qkv, cos, sin)), got_cache,
                                          any_backend.to_device(lengths))
    assert_same_bits(got_q.cpu(), want_q)
    assert_same_bits(got_cache.cpu(), want_cache)
    slot = int(lengths[1]) + 2
    spoiled_q = got_q.cpu().isnan().any(-1)  # [B, T, Hq]
    assert spoiled_q[1, 2].any() == (where in ("q", "cos")) and not spoiled_q[0].any() and not spoiled_q[1, :2].any()
    spoiled_cache = got_cache.cpu().isnan().any(-1)  # [2, B, Hkv, S]
    assert spoiled_cache.sum() == (0 if where == "q" else 1 if where in ("k", "v") else Hkv)
    if where != "q":
        assert spoiled_cache[:, 1, :, slot].any() and not spoiled_cache[:, 0].any()


# ----------------------------------------------------------------------------- verification
VERIFY_PARENTS = torch.tensor([[-1, 0, 0, 1, 1]])


def greedy_chain_logits(vocab=64, seed=18):
    """Logits under which the target accepts nodes 0 -> 1 -> 3 (greedy)."""
    logits = randn(1, 5, vocab, seed=seed)
    tokens = torch.tensor([[0, 10, 11, 12, 13]])
    logits[0, 0, 10] = logits[0, 1, 12] = 50.0
    return tokens, logits


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("poison", ["nan", "inf", "all_neg_inf"])
@pytest.mark.parametrize("node", [0, 1, 3])  # the root, an inner and a leaf node of the accepted path
@pytest.mark.covers("verify_tree", "nonfinite")
def test_verify_tree_never_returns_a_token_from_logits_without_distribution(any_backend, temperature, poison, node):
    tokens, logits = greedy_chain_logits()
    if poison == "all_neg_inf":
        logits[0, node] = -INF
    else:
        logits[0, node, 7] = NAN if poison == "nan" else INF
    uniforms = torch.full((1, 6), 1e-9, dtype=torch.float64)  # accept every child that has mass
    args = (VERIFY_PARENTS, tokens, logits, uniforms, temperature)
    if any_backend.name != "cpu":  # on a GPU (and its emulation) no host read inside the op: the row says it
        path, accept_len, bonus = any_backend.run("verify_tree", *args)
        assert accept_len.tolist() == [-1] and bonus.tolist() == [-1] and (path == -1).all()
    else:
        with pytest.raises(RuntimeError, match=rf"target_logits\[0, {node}\] give no distribution"):
            any_backend.run("verify_tree", *args)
    with pytest.raises(RuntimeError, match=rf"target_logits\[0, {node}\] give no distribution"):
        reference.verify_tree(*args)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_verify_tree_ignores_logits_of_nodes_it_does_not_visit(any_backend, temperature):
    tokens, logits = greedy_chain_logits()
    logits[0, 2] = NAN  # node 2 is rejected at the root: never read
    logits[0, 4] = -INF
    uniforms = torch.full((1, 6), 1e-9, dtype=torch.float64)
    got = any_backend.run("verify_tree", VERIFY_PARENTS, tokens, logits, uniforms, temperature)
    assert got[1].tolist() == [2]
    for a, b in zip(got, reference.verify_tree(VERIFY_PARENTS, tokens, logits, uniforms, temperature)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("temperature", [1e-310, 1e-300, 1e-45])
def test_verify_tree_tiny_temperature_is_the_greedy_limit(any_backend, temperature):
    tokens = torch.tensor([[0, 5, 9, 2, 7, 7, 3, 4]])
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2, 3, 6]])
    logits = randn(1, 8, 500, seed=19, scale=30.0)
    logits[0, :, 3] = logits[0].max(-1).values + 1.0  # token 3 is everyone's argmax ...
    logits[0, 0, 5] = logits[0, 0, 3] + 0.5  # ... but the root's (5: node 1)
    logits[0, 1, 2] = logits[0, 1, 3] + 0.5  # and node 1's (2: node 3)
    for seed in range(3):
        uniforms = torch.rand(1, 9, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
        path, accept_len, bonus = any_backend.run("verify_tree", parents, tokens, logits, uniforms, temperature)
        greedy = any_backend.run("verify_tree", parents, tokens, logits)
        assert torch.equal(path, greedy[0]) and torch.equal(accept_len, greedy[1]) and torch.equal(bonus, greedy[2])
        assert accept_len.tolist() == [3] and bonus.tolist() == [3]  # root -> 1 -> 3 -> 6, then token 3
        ref = reference.verify_tree(parents, tokens, logits, uniforms, temperature)
        assert all(torch.equal(a, b) for a, b in zip((path, accept_len, bonus), ref))


# ----------------------------------------------------------------------------- devices, parents
def _op_calls():
    q, k, v, lens, mask = attention_inputs()
    x = randn(2, 16, seed=20)
    moe = (randn(6, 16, seed=21), randn(4, 8, 16, seed=22), randn(4, 8, 16, seed=23), randn(4, 16, 8, seed=24))
    logits = randn(1, 5, 64, seed=25)
    return {
        "tree_attention": (q, k, v, lens, mask),
        "tree_attention_partial": (q, k, v, lens, mask, 2),
        "merge_attention_states": (randn(1, 2, 3, 4, 8, seed=26), randn(1, 2, 3, 4, seed=27)),
        "moe_top2": (x,) + moe,
        "contrastive_topk": (x, None, None, randn(50, 16, seed=28), 3),
        "linear": (x, randn(10, 16, seed=29)),
        "dequantize_rows": (quantized.from_float(randn(32, 64, seed=41), "Q4_1"), torch.tensor([1, 2])),
        "mlp_heads": (x, randn(2, 8, 16, seed=37), randn(2, 8, seed=38), randn(2, 1, 8, 8, seed=39),
                      randn(2, 1, 8, seed=40)),
        "rms_norm": (x, randn(16, seed=31), 1e-6, randn(2, 16, seed=32)),
        "rope_kv_write": (randn(1, 2, 4, 8, seed=33), randn(1, 2, 8, seed=34), randn(1, 2, 8, seed=35),
                          randn(2, 1, 1, 6, 8, seed=36), torch.tensor([1])),
        "verify_tree": (VERIFY_PARENTS, torch.tensor([[0, 1, 2, 3, 4]]), logits),
        "compact_kv": (randn(2, 2, 1, 12, 4, seed=30), torch.tensor([5, 4]), torch.tensor([[0, 1], [0, 1]]),
                       torch.tensor([2, 2])),
        "decoder_layer": Layer(B=1, T=2).args(),
        "decoder_layers": Layers(2, B=1, T=2).args(),
    }


@pytest.mark.parametrize("op", [name for name in J.ops.OP_NAMES if name not in ("device_errors", "silu_mul")])  # (one tensor)
def test_every_op_refuses_inputs_on_different_devices(op):
    args = list(_op_calls()[op])
    tensor_positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    for i in (tensor_positions[0], tensor_positions[-1]):  # the first or the last input on meta
        moved = list(args)
        moved[i] = args[i].to("meta")
        with pytest.raises(RuntimeError, match=r"device"):
            getattr(torch.ops.jakiro, op)(*moved)


@pytest.mark.parametrize("parents", [[[-1, 2, 0]], [[-1, 1, 1]], [[-1, -5, 0]], [[0, 0, 0]], [[-1, 0, 3]]])
def test_build_tree_mask_refuses_invalid_parents(parents):
    with pytest.raises(ValueError, match=r"build_tree_mask: parents\[0, \d\] must be"):
        J.build_tree_mask(torch.tensor(parents))


def test_build_tree_mask_refuses_wrong_types_and_empty_trees():
    for bad in (torch.tensor([[-1.0, 0.0]]), torch.tensor([-1, 0]), torch.zeros(1, 0, dtype=torch.int64)):
        with pytest.raises(ValueError, match=r"build_tree_mask"):
            J.build_tree_mask(bad)
