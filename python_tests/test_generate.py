"""speculative_generate on tiny random Llama models: greedy output identical to plain decoding for
every method and tree shape, the exact target distribution when sampling (chi-square, with a
negative control), stopping rules, statistics and errors."""

import functools

import numpy as np
import pytest
import scipy.stats
import torch
import transformers

from conftest import gen
from jakiro_ext import reference
from jakiro_ext.engine import TreeConfig, speculative_generate
from jakiro_ext.models import LlamaModel
from jakiro_ext.models.draft_head import DraftConfig, DraftHead

TREES = {"dynamic-small": TreeConfig(16, 4, 4), "dynamic-60-5-10": TreeConfig(60, 5, 10),
         "static": TreeConfig(choices=[[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0]])}
HEAD_METHODS = [("eagle2", "eagle2"), ("jakiro", "eagle2"), ("jakiro", "jakiro"), ("jakiro", "jakiro_star"),
                ("gumiho", "eagle2"), ("gumiho", "gumiho"), ("jakiro_gumiho", "gumiho")]
DYNAMIC_ONLY = ("jakiro", "gumiho")  # methods refused on a static tree (tested below)


def tiny_target(vocab: int = 211, embed_std: float = 0.02, seed: int = 0) -> LlamaModel:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                                   rms_norm_eps=1e-5)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    hf.model.embed_tokens.weight.data.normal_(0, embed_std, generator=gen(seed + 1))
    return LlamaModel.from_hf(hf)


def random_head(target, kind, seed=1, std=0.2):
    config = DraftConfig.for_target(target.config, kind, num_experts=4)
    return DraftHead(config).init_weights(seed, std=std).bind(target)


def copy_head(target, kind, scale=300.0):
    """A head whose feature is scale * embed(its input token): with tied embeddings it proposes
    the token it was given, which tiny random models tend to repeat, so drafts get accepted. A
    Gumiho head's later layers run the same: its serial layers add nothing, and its MLP heads
    give SiLU of their leaf's ``fc`` output, close to it where the embedding is positive."""
    head = random_head(target, kind)
    H = target.config.hidden_size
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, :H] = torch.eye(H) * scale
        for layer in [head, *(head.layers if head.config.num_layers > 1 else ())]:
            layer.o_proj.weight.zero_()
            (layer.w_down if head.config.num_experts else layer.down_proj.weight).zero_()
        if head.config.num_mlp_heads:
            head.mlp_in_weight.zero_()
            head.mlp_in_weight[:, :, H:] = torch.eye(H)
            head.mlp_block_weight.zero_()
    return head


def prompt(n=13, vocab=211, seed=2):
    return torch.randint(0, vocab, (n,), generator=gen(seed))


def sharp_target() -> LlamaModel:
    """The tiny target with sharper attention: its logits depend on the tokens' positions (the
    plain tiny target's hardly do: shifting a tree's positions by one changes almost no argmax),
    so an engine that gets a position wrong gives other tokens."""
    model = tiny_target()
    with torch.no_grad():
        for layer in model.layers:
            layer.self_attn.qkv_proj.weight.mul_(6)
    return model


@pytest.fixture(scope="module")
def target():
    return tiny_target()


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


def test_stops_at_eos_and_includes_it(target):
    ids = prompt()
    plain = speculative_generate(target, None, ids, 40).token_ids
    eos = plain[5]
    first = plain.index(eos)
    for head, method in [(None, "ar"), (copy_head(target, "jakiro"), "jakiro")]:
        out = speculative_generate(target, head, ids, 40, method=method, eos_token_id=[eos, 10**6])
        assert out.token_ids == plain[: first + 1] and out.stats.stop_reason == "eos"


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
    from jakiro_ext.drafting import METHODS, Drafter
    drafter = Drafter(head, METHODS["jakiro_star"], tree, 1, 64)
    cache = target.new_cache(1, 64)
    _, hidden = target(ids.unsqueeze(0), cache, last_logits_only=True)
    drafter.catch_up(ids[1:].unsqueeze(0), hidden[:, :-1], [ids.numel() - 1])
    drafted = drafter.draft(ids[-1:])
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


# ----------------------------------------------------------------------------- sampling
SAMPLED = 3  # tokens per generation: the prompt's bonus, then a round's depth-1 and depth-2 tokens
# (kind, method, tokens per generation, tree): gumiho's first MLP layer is depth 3 (after a
# serial step), so its generations run a token longer to reach it.
SAMPLING_CASES = [("eagle2", "eagle2", SAMPLED, TreeConfig(8, 2, 3)), ("jakiro", "jakiro", SAMPLED, TreeConfig(8, 2, 3)),
                  ("jakiro", "jakiro_star", SAMPLED, TreeConfig(8, 2, 3)),
                  ("gumiho", "gumiho", SAMPLED + 1, TreeConfig(24, 3, 3))]


def exact_distribution(target, ids, temperature, top_p, top_k, tokens=SAMPLED):
    """P(t1, .., t_tokens) of the target's filtered distribution, by enumeration: {tuple: prob}."""
    probs = {(): 1.0}
    for _ in range(tokens):
        nxt = {}
        for prefix, p in probs.items():
            if p < 1e-12:
                continue
            seq = torch.cat([ids, torch.tensor(prefix, dtype=torch.int64)]).unsqueeze(0)
            cache = target.new_cache(1, seq.shape[1])
            logits, _ = target(seq, cache, last_logits_only=True)
            dist = reference.filtered_distribution(logits[0, -1], temperature, top_p, top_k)
            dist = dist / dist.sum()  # top-p leaves the kept mass unnormalised
            for t in torch.nonzero(dist > 0).flatten().tolist():
                nxt[prefix + (t,)] = p * float(dist[t])
        probs = nxt
    return probs


def chi_square_p(counts, expected_probs, n):
    """p-value of observed counts against expected probabilities (bins with an expected count
    below 5 pooled; an outcome of probability 0 that was observed makes p = 0)."""
    if any(k not in expected_probs for k in counts):
        return 0.0
    stat, bins, pooled_obs, pooled_exp = 0.0, 0, 0, 0.0
    for k, p in expected_probs.items():
        e, o = n * p, counts.get(k, 0)
        if e < 5:
            pooled_obs, pooled_exp = pooled_obs + o, pooled_exp + e
        else:
            stat += (o - e) ** 2 / e
            bins += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        bins += 1
    return float(scipy.stats.chi2.sf(stat, bins - 1))


def marginal(probs_or_counts: dict, k: int) -> dict:
    """The first ``k`` tokens' distribution (or counts) of a distribution over token tuples."""
    out = {}
    for key, v in probs_or_counts.items():
        out[key[:k]] = out.get(key[:k], 0) + v
    return out


def _rank_pooled(counts: dict, pair_probs: dict):
    """Counts and probabilities of the second token's rank under p(. | first token), all first
    tokens pooled: a share that moves the same way in every context adds up in one bin."""
    by_context = {}
    for key, p in pair_probs.items():
        by_context.setdefault(key[:1], []).append((p, key))
    rank = {key: r for group in by_context.values() for r, (_, key) in enumerate(sorted(group, reverse=True))}
    pooled_counts, pooled_probs = {}, {}
    for key, c in counts.items():
        r = (rank.get(key, -1),)  # an impossible pair: a bin of probability 0, so p = 0
        pooled_counts[r] = pooled_counts.get(r, 0) + c
    for key, p in pair_probs.items():
        pooled_probs[(rank[key],)] = pooled_probs.get((rank[key],), 0) + p
    return pooled_counts, pooled_probs


def verified_token_p(counts: dict, expected: dict, n: int) -> float:
    """p-value for the first token the verification emits (a generation's second: the first is
    the prefill's own sample): chi-square over (first, second) pairs and over the second token's
    rank in its context, Bonferroni-combined."""
    pairs, observed = marginal(expected, 2), marginal(counts, 2)
    ranked = _rank_pooled(observed, pairs)
    return min(1.0, 2 * min(chi_square_p(observed, pairs, n), chi_square_p(*ranked, n)))


def shifted(expected: dict, rank: int, shift: float) -> dict:
    """(first, second)-pair probabilities with the second token's rank-``rank`` share moved by
    ``shift`` in every context (the other shares rescaled): what a biased verifier would emit."""
    pairs, out = marginal(expected, 2), {}
    for context, pc in marginal(expected, 1).items():
        cond = sorted(((pairs[k] / pc, k) for k in pairs if k[:1] == context), reverse=True)
        s0, k0 = cond[min(rank, len(cond) - 1)]
        s1 = min(max(s0 + shift, 0.0), 1.0)
        for s, k in cond:
            out[k] = pc * (s1 if k == k0 else (s * (1 - s1) / (1 - s0) if s0 < 1 else 0.0))
    return out


@functools.lru_cache(maxsize=None)
def power_at_shift(expected_items: tuple, n: int, shift: float = 0.05, alpha: float = 1e-3, sims: int = 200) -> float:
    """The smallest probability, over the verified token's three largest shares moved up or down
    by ``shift``, that :func:`verified_token_p` falls below ``alpha`` on ``n`` samples (by
    simulation): the power the test has against such a bias."""
    expected = dict(expected_items)
    rng = np.random.default_rng(0)
    worst = 1.0
    for rank in range(3):
        for sign in (1, -1):
            q = shifted(expected, rank, sign * shift)
            keys = list(q)
            probs = np.array([q[k] for k in keys])
            hits = 0
            for _ in range(sims):
                draw = rng.multinomial(n, probs / probs.sum())
                hits += verified_token_p({k: int(c) for k, c in zip(keys, draw) if c}, expected, n) < alpha
            worst = min(worst, hits / sims)
    return worst


def lossy_verifier(monkeypatch, scale: float = 0.7):
    """Patch the engine's verification to accept a drafted token with probability
    min(1, p / (scale q)) instead of p / q (draws scaled): a lossy sampler, for negative controls."""
    from jakiro_ext import ops

    exact = ops.verify_tree

    def lossy(parents, tokens, logits, uniforms=None, *args):
        if uniforms is not None:
            uniforms = torch.cat([uniforms[:, :-1] * scale, uniforms[:, -1:]], 1)
        return exact(parents, tokens, logits, uniforms, *args)

    monkeypatch.setattr(ops, "verify_tree", lossy)


# The sampling tests' size: 4000 samples detect a 0.05 shift of a share of the verified token
# with >= 95% power (asserted by power_at_shift in each test).
SAMPLES = 4000


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


def test_gumiho_pairs_each_leaf_with_its_own_parent(target):
    # The MLP heads' input of a leaf is cat(x_parent, x_leaf): x_parent the fc output of the leaf's
    # own parent as its serial step ran it. (The released code pairs the r-th best leaf with the
    # r-th frontier node, usually another node's parent; here that pairing differs, so the test
    # tells them apart.)
    from jakiro_ext.drafting import METHODS, Drafter

    head = random_head(target, "gumiho", seed=5)
    drafter = Drafter(head, METHODS["gumiho"], TreeConfig(40, 3, 3), 1, 64)
    ids = prompt(seed=6)
    cache = target.new_cache(1, 64)
    _, hidden = target(ids.unsqueeze(0), cache, last_logits_only=True)
    drafter.catch_up(ids[1:].unsqueeze(0), hidden[:, :-1], [ids.numel() - 1])
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
    drafted = drafter.draft(ids[-1:])
    del head.mlp_heads
    tree, H = seen["tree"], target.config.hidden_size
    leaves = seen["layer"].gather(1, tree.frontier(seen["layer"], 3))  # [1, 3]: depth-2 nodes
    parents = tree.parents.gather(1, leaves)  # depth-1 nodes, fed the root step's feature
    feature = drafter.root_step.feature.expand(1, 3, H)
    want = head.project_input(tree.tokens.gather(1, parents), feature)
    torch.testing.assert_close(seen["x"][..., :H], want)
    ranked = 1 + tree.frontier(torch.arange(1, 4).unsqueeze(0), 3)  # the depth-1 nodes, best first
    by_rank = head.project_input(tree.tokens.gather(1, ranked), feature)
    assert not torch.allclose(by_rank, want)  # the released pairing would be another input
    assert drafted.tokens.shape[1] == 1 + 3 + 3 * 9  # the root, 3 children, 9 candidates in each later layer
