"""speculative_generate on tiny random Llama models: greedy output identical to plain decoding for
every method and tree shape, the exact target distribution when sampling (chi-square, with a
negative control), stopping rules, statistics and errors."""

import pytest
import torch
import transformers

from helpers import (DYNAMIC_ONLY, HEAD_METHODS, SAMPLES, SAMPLING_CASES, TREES, chi_square_p, copy_head,
                     exact_distribution, lossy_verifier, power_at_shift, prompt, random_head, sharp_target, tiny_target,
                     verified_token_p)
from jakiro_ext.config import TreeConfig
from jakiro_ext.engine.generate import speculative_generate
from jakiro_ext.methods import METHODS, MethodName, method_for_head
from jakiro_ext.models import LlamaModel
from jakiro_ext.models.heads.config import DraftConfig
from jakiro_ext.models.heads.draft_head import DraftHead



# Every head/method with every tree, except jakiro and gumiho on a static tree (refused: tested below).
CASES = [(k, m, t) for k, m in HEAD_METHODS for t in TREES if not (m in DYNAMIC_ONLY and t == "static")]


@pytest.mark.parametrize("kind,method,tree", CASES, ids=[f"{k}-head-{m}-{t}" for k, m, t in CASES])
@pytest.mark.parametrize("head_type", ["random", "copy"])
def test_greedy_tokens_equal_plain_decoding(target, kind, method, tree, head_type):
    head = random_head(target, kind) if head_type == "random" else copy_head(target, kind)
    for seed in range(3):
        ids = prompt(seed=seed)
        plain = speculative_generate(target, None, ids, 40)
        spec = speculative_generate(target, head, ids, 40, method=method, tree=TREES[tree])
        assert spec.token_ids == plain.token_ids
        s = spec.stats
        assert s.new_tokens == 40 and s.stop_reason == "max_new_tokens"
        assert s.target_forwards == len(s.accept_lengths) + 1  # the prompt's forward, then one per round
        assert sum(s.accept_histogram) == len(s.accept_lengths)
        assert sum(s.accept_lengths) + len(s.accept_lengths) + 1 >= 40  # every round emits accepted + 1
        assert s.plain_rounds == 0 and plain.stats.plain_rounds == len(plain.stats.accept_lengths)  # a fixed tree drafts every round
    if head_type == "copy":  # the copy head's drafts are accepted: multi-token paths were exercised
        assert spec.stats.tau > 2.0, spec.stats.as_dict()


@pytest.fixture(scope="module")
def sharp():
    return sharp_target()


@pytest.mark.parametrize("kind,method,tree", CASES, ids=[f"{k}-head-{m}-{t}" for k, m, t in CASES])
def test_greedy_tokens_equal_plain_decoding_on_a_position_sensitive_target(sharp, kind, method, tree):
    head = copy_head(sharp, kind)
    accepted = 0
    for seed in range(3):
        ids = prompt(seed=seed)
        spec = speculative_generate(sharp, head, ids, 30, method=method, tree=TREES[tree])
        assert spec.token_ids == speculative_generate(sharp, None, ids, 30).token_ids
        accepted += sum(spec.stats.accept_lengths)
    assert accepted > 10  # drafts were accepted: tree positions were used


def test_a_tree_position_off_by_one_fails_on_the_position_sensitive_target(sharp, monkeypatch):
    """Negative control of the test above: the verification forward's positions one too far give
    other tokens on the position-sensitive target (on the plain tiny target they may not)."""
    forward = LlamaModel.forward

    def off_by_one(self, tokens, cache, tree_mask=None, depths=None, *args, **kwargs):
        return forward(self, tokens, cache, tree_mask, None if depths is None else depths + 1, *args, **kwargs)
    head = copy_head(sharp, "eagle2")
    plain = [speculative_generate(sharp, None, prompt(seed=seed), 30).token_ids for seed in range(3)]
    monkeypatch.setattr(LlamaModel, "forward", off_by_one)
    spec = [speculative_generate(sharp, head, prompt(seed=seed), 30, method="eagle2", tree=TREES["dynamic-small"])
            .token_ids for seed in range(3)]
    assert spec != plain


def test_plain_decoding_equals_transformers_greedy(target):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    ours = LlamaModel.from_hf(hf)
    ids = prompt()
    with torch.no_grad():
        want = hf.generate(ids.unsqueeze(0), max_new_tokens=30, do_sample=False, pad_token_id=0)[0, ids.numel():]
    assert speculative_generate(ours, None, ids, 30).token_ids == want.tolist()


@pytest.mark.parametrize("kind,method", [("eagle2", "eagle2"), ("jakiro", "jakiro"), ("gumiho", "gumiho")])
def test_a_prompt_prefilled_in_chunks(monkeypatch, kind, method):
    """Prompts longer than the prefill chunk (the target's and the draft's): the tokens are plain
    decoding's, also of plain decoding with the prompt in one forward, and the draft's cache after
    its chunked prefill holds what one forward writes."""
    from jakiro_ext.engine import drafter

    target = tiny_target()
    head = copy_head(target, kind)
    ids = prompt(45, seed=4)
    whole = speculative_generate(target, None, ids, 30).token_ids
    monkeypatch.setattr(target, "prefill_chunk", 8)
    monkeypatch.setattr(drafter, "PREFILL_CHUNK", 8)
    plain = speculative_generate(target, None, ids, 30)
    spec = speculative_generate(target, head, ids, 30, method=method)
    assert spec.token_ids == plain.token_ids == whole
    assert spec.stats.tau > 2.0
    features = torch.randn(ids.numel(), target.config.hidden_size, generator=torch.Generator().manual_seed(0))
    one = drafter.Drafter(head, METHODS[method], TreeConfig(8, 3, 2))
    chunked_kv, chunked_root = one.prefill(ids, features)
    assert one.forwards == 6  # 45 tokens in chunks of 8
    monkeypatch.setattr(drafter, "PREFILL_CHUNK", 1000)
    whole_kv, whole_root = one.prefill(ids, features)
    assert one.forwards == 7
    assert chunked_kv.host_lengths == whole_kv.host_lengths == [ids.numel()]
    torch.testing.assert_close(chunked_kv.kv[..., :ids.numel(), :], whole_kv.kv[..., :ids.numel(), :], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chunked_root.feature, whole_root.feature, atol=1e-5, rtol=1e-5)


def test_stops_at_eos_and_includes_it(target):
    ids = prompt()
    plain = speculative_generate(target, None, ids, 40).token_ids
    eos = plain[5]
    first = plain.index(eos)
    for head, method in [(None, "ar"), (copy_head(target, "jakiro"), "jakiro")]:
        out = speculative_generate(target, head, ids, 40, method=method, eos_token_id=[eos, 10**6])
        assert out.token_ids == plain[: first + 1] and out.stats.stop_reason == "eos"


def test_methods_by_enum_or_string_and_by_the_heads_kind(target):
    ids = prompt()
    head = copy_head(target, "jakiro")
    by_string = speculative_generate(target, head, ids, 12, method="jakiro")
    assert speculative_generate(target, head, ids, 12, method=MethodName.JAKIRO).token_ids == by_string.token_ids
    # No method given: the one whose registry entry names the head's kind as its default.
    assert speculative_generate(target, head, ids, 12).stats.accept_lengths == by_string.stats.accept_lengths
    assert [method_for_head(k).name for k in (None, "eagle2", "eagle3", "jakiro", "gumiho", "jakiro_gumiho")] == [
        "ar", "eagle2", "eagle2", "jakiro", "gumiho", "gumiho"]
    with pytest.raises(ValueError, match="no method drafts with a 'medusa' head"):
        method_for_head("medusa")


def test_streaming_callback_sees_every_token_once(target):
    seen = []
    out = speculative_generate(target, copy_head(target, "eagle2"), prompt(), 25, on_tokens=seen.extend)
    assert seen == out.token_ids and len(seen) == 25


def test_max_cache_len_bounds(target):
    ids = prompt(n=30)
    with pytest.raises(ValueError, match=r"the prompt has 30 tokens; with a 16-node tree it needs a KV cache of at least "
                                         r"46 positions, but the cache holds 40"):
        speculative_generate(target, random_head(target, "jakiro"), ids, 10, tree=TREES["dynamic-small"], max_cache_len=40)
    out = speculative_generate(target, None, ids, 50, max_cache_len=40)  # room for 10 more tokens only
    assert out.stats.stop_reason == "cache_full" and out.token_ids == speculative_generate(target, None, ids, 50).token_ids[:len(out.token_ids)]


def test_static_decoupled_tree_ranks_distinct_tokens(target):
    # Both experts of a copy head propose the same tokens: after dropping the repeats, child
    # rank 1 must be the second distinct token, not a hole (which used to drop the node).
    head = copy_head(target, "jakiro")
    ids = prompt()
    tree = TreeConfig(choices=[[0], [1], [1, 0], [0, 0]])
    out = speculative_generate(target, head, ids, 30, method="jakiro_star", tree=tree)
    assert out.token_ids == speculative_generate(target, None, ids, 30).token_ids
    from jakiro_ext.methods import METHODS
    from jakiro_ext.engine.drafter import Drafter
    drafter = Drafter(head, METHODS["jakiro_star"], tree)
    cache = target.new_cache(1, 64)
    _, hidden = target(ids.unsqueeze(0), cache, last_logits_only=True)
    drafted = drafter.draft(ids[-1:], *drafter.prefill(ids[1:], hidden[0, :-1]))
    tokens, parents = drafted.tokens[0], drafted.parents[0]
    assert tokens.numel() == 5 and parents.tolist() == [-1, 0, 0, 1, 2]
    assert len(set(tokens[1:3].tolist())) == 2  # the root's two children are distinct tokens


def test_draft_scratch_fits_a_frontier_wider_than_the_tree(target):
    # top_k > total_tokens: a tree layer runs more rows than the verified tree holds.
    ids = prompt()
    out = speculative_generate(target, copy_head(target, "eagle2"), ids, 40, tree=TreeConfig(4, 2, 8))
    assert out.token_ids == speculative_generate(target, None, ids, 40).token_ids


def test_bad_arguments_are_clear_errors(target):
    ids = prompt()
    dense, moe, gumiho = random_head(target, "eagle2"), random_head(target, "jakiro"), random_head(target, "gumiho")
    cases = [
        (dict(draft=moe, method="gumiho"), r"method 'gumiho' needs a Gumiho draft head \(MLP heads: gumiho or jakiro_gumiho\); this head is 'jakiro'"),
        (dict(draft=gumiho, method="gumiho", tree=TREES["static"]), r"parallel MLP heads\) builds the dynamic tree"),
        (dict(draft=gumiho, method="gumiho", tree=TreeConfig(8, 2, 3)), r"method 'gumiho' drafts at least one serial "
                                                                      r"step before the head's 2 MLP heads and needs "
                                                                      r"depth >= 3, got 2"),
        (dict(draft=None, method="jakiro"), r"method 'jakiro' needs a draft head"),
        (dict(draft=dense, method="jakiro"), r"method 'jakiro' needs a Jakiro \(MoE\) draft head; this head is 'eagle2'"),
        (dict(draft=moe, method="medusa"), r"method must be one of \('ar', 'eagle2', 'jakiro', 'jakiro_star', 'gumiho'\), got 'medusa'"),
        (dict(draft=moe, method="jakiro", tree=TREES["static"]), r"with a static tree use 'eagle2' or 'jakiro_star'"),
        (dict(draft=None, input_ids=ids.repeat(2, 1), lengths=[13]), r"lengths must give one length per row of "
                                                                     r"input_ids \(2\), got \[13\]"),
        (dict(draft=None, max_new_tokens=0), r"max_new_tokens must be >= 1, got 0"),
        (dict(draft=None, temperature=-1.0), r"temperature must be >= 0 \(0: greedy\), got -1.0"),
        (dict(draft=None, top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
        (dict(draft=None, input_ids=torch.tensor([1, 211])), r"input_ids must be token ids in \[0, 211\) \(the target's "
                                                          r"vocabulary\), got values in \[1, 211\]"),
    ]
    for kwargs, message in cases:
        kwargs = {"input_ids": ids, "max_new_tokens": 5, **kwargs}
        with pytest.raises(ValueError, match=message):
            speculative_generate(target, **kwargs)
    with pytest.raises(TypeError, match=r"input_ids must be an integer tensor, got dtype torch.float32"):
        speculative_generate(target, None, ids.float(), 5)
    with pytest.raises(ValueError, match=r"static tree choices must contain every node's parent"):
        TreeConfig(choices=[[0], [1, 0]])
    with pytest.raises(ValueError, match=r"static tree choices must be a list of lists of child ranks"):
        TreeConfig(choices=[0, 1])
    unbound = DraftHead(DraftConfig.for_target(target.config, "jakiro", num_experts=4))
    with pytest.raises(ValueError, match=r"not bound to a target: call head.bind\(target\)"):
        speculative_generate(target, unbound, ids, 5)




@pytest.mark.parametrize("kind,method,tokens,tree", SAMPLING_CASES, ids=[c[1] for c in SAMPLING_CASES])
def test_sampling_follows_the_target_distribution(kind, method, tokens, tree):
    """Batch 1: the verified token is tested with 95% power against a 0.05 shift of any of its
    three largest shares (power_at_shift); the whole generation (the deeper tokens too) by one
    chi-square over every outcome, with less power. Negative controls: the sampler without its
    top-p / top-k filter is rejected here, a lossy verifier in the next test."""
    vocab = 12
    target = tiny_target(vocab=vocab, embed_std=0.03, seed=3)  # ~130 likely continuations (3 tokens)
    head = copy_head(target, kind, scale=5.0)
    ids = torch.tensor([3, 7, 7, 1, 7, 7])
    temperature, top_p, top_k = 0.8, 0.9, 6
    expected = exact_distribution(target, ids, temperature, top_p, top_k, tokens)
    assert power_at_shift(tuple(expected.items()), SAMPLES) >= 0.95
    n, counts, accepted, deepest = SAMPLES, {}, 0, 0
    for seed in range(n):
        out = speculative_generate(target, head, ids, tokens, method=method, tree=tree, temperature=temperature,
                                   top_p=top_p, top_k=top_k, seed=seed)
        key = tuple(out.token_ids)
        counts[key] = counts.get(key, 0) + 1
        accepted += sum(out.stats.accept_lengths)
        deepest = max(deepest, *out.stats.accept_lengths)
    # Of at most tokens - 1 drafted tokens per generation, some were accepted and some rejected,
    # and the deepest layer sampled (gumiho's: an MLP head's) was accepted at times.
    assert 0.5 < accepted / n < tokens - 0.5, accepted / n
    assert deepest >= tokens - 1
    assert verified_token_p(counts, expected, n) > 1e-3
    assert chi_square_p(counts, expected, n) > 1e-3
    unfiltered = exact_distribution(target, ids, temperature, 1.0, 0, tokens)
    assert chi_square_p(counts, unfiltered, n) < 1e-6


def test_a_lossy_verifier_fails_the_sampling_statistic_at_its_size(monkeypatch):
    """The negative control of the sampling tests: the same setting with a lossy verifier patched
    into the engine, SAMPLES generations (drawn in batches of copies: each sequence samples with
    seed + its index, as alone; test_batch checks that), is rejected at p < 1e-6."""
    kind, method, tokens, tree = SAMPLING_CASES[0]
    target = tiny_target(vocab=12, embed_std=0.03, seed=3)
    head = copy_head(target, kind, scale=5.0)
    ids = torch.tensor([3, 7, 7, 1, 7, 7])
    expected = exact_distribution(target, ids, 0.8, 0.9, 6, tokens)
    lossy_verifier(monkeypatch)
    counts = {}
    for call in range(SAMPLES // 500):
        for out in speculative_generate(target, head, [ids] * 500, tokens, method=method, tree=tree, temperature=0.8,
                                        top_p=0.9, top_k=6, seed=call * 500):
            counts[tuple(out.token_ids)] = counts.get(tuple(out.token_ids), 0) + 1
    assert verified_token_p(counts, expected, SAMPLES) < 1e-6


def test_gumiho_pairs_each_leaf_with_its_own_parent(target, monkeypatch):
    # The MLP heads' input of a leaf is cat(x_parent, x_leaf): x_parent the fc output of the leaf's
    # own parent as its serial step ran it. (The released code pairs the r-th best leaf with the
    # r-th frontier node, usually another node's parent; here that pairing differs, so the test
    # tells them apart: in this tree, drafted with the LM head in float32.)
    from jakiro_ext.methods import METHODS
    from jakiro_ext.engine.drafter import Drafter

    monkeypatch.setenv("JAKIRO_CPU_BF16_DRAFT_LM_HEAD", "0")

    head = random_head(target, "gumiho", seed=5)
    drafter = Drafter(head, METHODS["gumiho"], TreeConfig(40, 3, 3))
    ids = prompt(seed=6)
    cache = target.new_cache(1, 64)
    _, hidden = target(ids.unsqueeze(0), cache, last_logits_only=True)
    draft_kv, root_step = drafter.prefill(ids[1:], hidden[0, :-1])
    seen = {}
    original = drafter._draft_parallel

    def spy(tree, layer, step, rows):
        seen.update(tree=tree, layer=layer)
        return original(tree, layer, step, rows)
    drafter._draft_parallel = spy
    mlp_heads = head.mlp_heads

    def seen_input(x, **kwargs):
        seen["x"] = x
        return mlp_heads(x, **kwargs)
    head.mlp_heads = seen_input
    drafted = drafter.draft(ids[-1:], draft_kv, root_step)
    del head.mlp_heads
    tree, H = seen["tree"], target.config.hidden_size
    leaves = seen["layer"].gather(1, tree.frontier(seen["layer"], 3))  # [1, 3]: depth-2 nodes
    parents = tree.parents.gather(1, leaves)  # depth-1 nodes, fed the root step's feature
    feature = root_step.feature.expand(1, 3, H)
    want = head.project_input(tree.tokens.gather(1, parents), feature)
    torch.testing.assert_close(seen["x"][..., :H], want)
    ranked = 1 + tree.frontier(torch.arange(1, 4).unsqueeze(0), 3)  # the depth-1 nodes, best first
    by_rank = head.project_input(tree.tokens.gather(1, ranked), feature)
    assert not torch.allclose(by_rank, want)  # the released pairing would be another input
    assert drafted.tokens.shape[1] == 1 + 3 + 3 * 9  # the root, 3 children, 9 candidates in each later layer


def test_generate_many_checks_every_listed_request_before_choosing_a_tree(monkeypatch):
    # A bad request among good ones is refused before the tree policy measures anything (the
    # live choice's first call measures the machine's costs: minutes, before any request ran).
    from jakiro_ext.engine import generate as generate_module

    target = tiny_target()

    def no_policy(*args, **kwargs):
        raise AssertionError("the tree policy was asked before the requests were checked")

    monkeypatch.setattr(generate_module, "tree_policy", no_policy)
    good = prompt(5)
    with pytest.raises(ValueError, match=r"request 1 must not be empty"):
        generate_module.generate_many(target, None, [good, [], good])
    with pytest.raises(TypeError, match=r"request 2 must be ints"):
        generate_module.generate_many(target, None, (good, good, ["a"]))
    long = [1] * target.config.max_position_embeddings
    with pytest.raises(ValueError, match=r"prompt 1 has .* no room for a new token"):
        generate_module.generate_many(target, None, [good, long])


@pytest.mark.parametrize("method,tree", [("jakiro", TreeConfig(3, 1, 1)), ("jakiro", TreeConfig(5, 1, 2)),
                                         ("jakiro", TreeConfig(4, 1, 2)), ("jakiro_star", TreeConfig(5, 1, 2))])
def test_a_tree_of_the_root_step_alone_is_the_grown_trees(target, monkeypatch, method, tree):
    # Jakiro's depth-1 trees (no draft forward after the root's step): kept whole, made from the
    # shape's fixed parts, the same nodes, parents, depths and mask as growing the tree and keeping
    # it gives; larger than the total (4/1/2: 5 nodes) or a forward after the root's step
    # (jakiro_star's depth 1 is EXPERTS then a serial layer), the tree is grown.
    from jakiro_ext.engine.drafter import Drafter

    head = copy_head(target, "jakiro")
    ids = torch.cat([prompt(seed=s) for s in (2, 3)]).view(2, -1)[:, :9]
    hidden = target(ids, target.new_cache(2, 40), last_logits_only=False)[1]
    drafter = Drafter(head, METHODS[method], tree)
    roots, kv, step = ids[:, -1], drafter.new_cache(2, 20), None
    step = drafter.catch_up(kv, ids[:, 1:], hidden[:, :-1])
    kv.commit(8)
    step = step.rows(torch.full((2, 1), 7))
    fast = drafter.draft(roots, kv, step)
    used = bool(drafter._fixed_trees)
    monkeypatch.setattr(drafter, "_from_root_step", lambda *args: None)
    grown = drafter.draft(roots, kv, step)
    assert used == (method == "jakiro" and tree.total_tokens != 4)
    for name in ("tokens", "parents", "depths", "mask", "counts"):
        assert torch.equal(getattr(fast, name), getattr(grown, name)), name
    assert torch.equal(fast.errors, grown.errors)
    assert fast.tokens.shape[1] == (3 if tree.total_tokens == 3 else 4 if tree.total_tokens == 4 else 5)


@pytest.mark.parametrize("kind,method,tree", [("eagle2", "eagle2", TreeConfig(2, 1, 1)), ("eagle2", "eagle2", TreeConfig(2, 3, 2)),
                                              ("jakiro", "jakiro", TreeConfig(2, 1, 1)), ("jakiro", "jakiro_star", TreeConfig(2, 2, 2)),
                                              ("gumiho", "gumiho", TreeConfig(2, 3, 2))])
def test_a_two_node_tree_drafts_the_root_step_alone(target, monkeypatch, kind, method, tree):
    # A round that keeps one drafted node runs no draft forward after the root's step, and keeps
    # the node drafting every layer would keep; the tokens are plain decoding's.
    from jakiro_ext.engine.drafter import Drafter

    head = copy_head(target, kind)
    ids = prompt(seed=3)
    hidden = target(ids.view(1, -1), target.new_cache(1, 40), last_logits_only=False)[1]
    drafter = Drafter(head, METHODS[method], tree)
    kv, step = drafter.prefill(ids[1:], hidden[0, :-1])
    forwards = drafter.forwards
    alone = drafter.draft(ids[-1:], kv, step)
    assert drafter.forwards == forwards
    monkeypatch.setattr(drafter, "_kinds_drafted", lambda: drafter.schedule)
    every = drafter.draft(ids[-1:], kv, step)
    assert drafter.forwards > forwards or len(drafter.schedule) == 1 or method == "jakiro"
    for name in ("tokens", "parents", "depths", "mask", "counts"):
        assert torch.equal(getattr(alone, name), getattr(every, name)), name
    monkeypatch.undo()
    plain = speculative_generate(target, None, ids, 30)
    assert speculative_generate(target, head, ids, 30, method=method, tree=tree).token_ids == plain.token_ids
