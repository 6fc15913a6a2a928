"""``attn_implementation="jakiro_tree"``: a transformers Llama's tree-verification forward with our
attention equals the same forward with ``sdpa`` and the same mask (bool, additive float, or packed
as a keyword), each node's logits the causal chain of its ancestors'; ``verify_tree`` then
``commit`` leaves the cache a recompute would hold; what our op cannot compute falls back to sdpa
with a warning."""
import warnings

import pytest
import torch
import transformers
from transformers import DynamicCache

from jakiro_ext import ops
from jakiro_ext.integrations import transformers as jt
from jakiro_ext.ops.reference import unpack_tree_mask

PARENTS = torch.tensor([[-1, 0, 0, 1, 1, 2, 3]])
DEPTHS = torch.tensor([[0, 1, 1, 2, 2, 2, 3]])


@pytest.fixture(scope="module")
def model():
    jt.register()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                      rope_theta=100000.0)
    return transformers.LlamaForCausalLM(config).eval()


def greedy_tree(model, ids):
    """A tree whose chain 0 -> 1 -> 3 -> 6 is the target's greedy one (3 drafts accepted), its
    other nodes other tokens."""
    tree = torch.randint(0, 97, (1, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        seq = torch.cat([ids, tree[:, :1]], 1)
        for node in (1, 3, 6):
            tree[0, node] = model(seq).logits[0, -1].argmax()
            seq = torch.cat([seq, tree[:, node: node + 1]], 1)
    for node, twin in ((2, 1), (4, 3), (5, 3)):
        if tree[0, node] == tree[0, twin]:
            tree[0, node] = (tree[0, twin] + 1) % 97
    return tree


def tree_step(model, impl, ids, tree, mask, **kw):
    model.set_attn_implementation(impl)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, cache=cache)
        logits = model(tree, attention_mask=mask, position_ids=ids.shape[1] + DEPTHS, cache=cache, **kw).logits
    return logits, cache


def masks(prefix):
    sees = unpack_tree_mask(ops.build_tree_mask(PARENTS), 7)
    as_bool = torch.cat([torch.ones(1, 7, prefix, dtype=torch.bool), sees], -1)[:, None]
    return as_bool, torch.zeros(as_bool.shape).masked_fill(~as_bool, torch.finfo(torch.float32).min)


@pytest.mark.parametrize("prefix", [5, 70])
def test_a_tree_step_equals_sdpas_with_the_same_mask(model, prefix):
    ids = torch.randint(0, 97, (1, prefix), generator=torch.Generator().manual_seed(prefix))
    tree = greedy_tree(model, ids)
    as_bool, as_float = masks(prefix)
    want, _ = tree_step(model, "sdpa", ids, tree, as_bool)
    for mask, kw in ((as_bool, {}), (as_float, {}), (None, {"jakiro_tree_mask": ops.build_tree_mask(PARENTS)})):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # (no fallback on these)
            got, _ = tree_step(model, jt.NAME, ids, tree, mask, **kw)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    with torch.no_grad():  # node 6: the causal chain of its ancestors
        chain = model(torch.cat([ids, tree[:, [0, 1, 3, 6]]], 1)).logits
    torch.testing.assert_close(got[0, 6], chain[0, -1], atol=2e-5, rtol=2e-5)
    # The packed keyword reaches the attention: a mask where every node sees itself only differs.
    alone = ops.pack_bits(torch.eye(7, dtype=torch.bool)).unsqueeze(0)
    other, _ = tree_step(model, jt.NAME, ids, tree, None, jakiro_tree_mask=alone)
    assert (other - want).abs().max() > 1e-3


def test_verify_then_commit_leaves_the_cache_a_recompute_holds(model):
    ids = torch.randint(0, 97, (1, 20), generator=torch.Generator().manual_seed(2))
    tree = greedy_tree(model, ids)
    as_bool, _ = masks(20)
    logits, cache = tree_step(model, jt.NAME, ids, tree, as_bool)
    path, accepted, bonus = ops.verify_tree(PARENTS, tree, logits)
    n = int(accepted[0])
    assert n == 3 and path[0, :4].tolist() == [0, 1, 3, 6]
    jt.commit(cache, 20, path, n, 7)
    assert cache.get_seq_length() == 20 + n + 1
    with torch.no_grad():
        after = model(bonus[:, None], cache=cache).logits[0, -1]
        whole = model(torch.cat([ids, tree[:, path[0, : n + 1]], bonus[:, None]], 1)).logits[0, -1]
    torch.testing.assert_close(after, whole, atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError, match=r"not prefix \+ tree = 27"):
        jt.commit(cache, 20, path, n, 7)
    with pytest.raises(ValueError, match=r"path must be \[1, >= accepted \+ 1 = 4\]"):
        jt.commit(cache, 20, path[:, :2], n, 7)


def left_padded(model, impl, ids, padding):
    """A left-padded prompt, then one token after it, with ``impl``: (prompt logits, next logits)."""
    model.set_attn_implementation(impl)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        prompt = model(ids, attention_mask=padding, cache=cache).logits
        step = model(ids[:, :1], attention_mask=torch.cat([padding, torch.ones(1, 1, dtype=torch.long)], 1),
                     cache=cache).logits
    return prompt, step


def test_what_our_op_cannot_compute_runs_sdpa_and_says_so(model):
    """A left-padded prompt: its padding is within the rows' own mask (our op computes it); the
    token after it sees a prefix with holes, which our op's prefix cannot express: sdpa, warned."""
    ids = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(3))
    padding = torch.ones(1, 12, dtype=torch.long)
    padding[0, :3] = 0
    want_prompt, want_step = left_padded(model, "sdpa", ids, padding)
    jt._WARNED.clear()
    with pytest.warns(UserWarning, match="a prefix not wholly visible .* ran transformers' sdpa instead"):
        prompt, step = left_padded(model, jt.NAME, ids, padding)
    torch.testing.assert_close(prompt[0, 3:], want_prompt[0, 3:], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(step, want_step, atol=2e-5, rtol=2e-5)
    bias = torch.zeros(1, 1, 4, 4)
    bias[..., 0] = -1.5
    assert jt.packed_from_4d(bias, 4)[1].startswith("an additive bias")
    static = torch.ones(1, 1, 2, 6, dtype=torch.bool)  # new tokens at slots 2, 3 of a 6-slot cache: 4, 5 unfilled
    static[..., 4:] = False
    assert jt.packed_from_4d(static, 2)[1].startswith("new tokens that are not the cache's last")
    q, k = torch.randn(1, 4, 2, 16), torch.randn(1, 2, 6, 16)
    with pytest.raises(ValueError, match="uses softcap, which tree_attention does not compute"):
        jt.jakiro_tree_attention(model.model.layers[0].self_attn, q, k, k, None, scaling=0.25, softcap=30.0)
    half = model.to(torch.float16)
    try:
        with pytest.warns(UserWarning, match="torch.float16 .* ran transformers' sdpa instead"):
            with torch.no_grad():
                half(ids)
    finally:
        model.to(torch.float32)
