"""Bad input never gives garbage, a hang or a traceback (issue 11), on the engine, model and CLI
side: the API's argument checks (a TypeError / ValueError naming the argument, before anything
is allocated or run), the context limit, KV caches sized by what can happen and grown on demand,
packed causal masks, non-finite logits, and the CLI's one-line errors (exit status 2).

Names added for the issue are imported inside the tests, so that this file also runs (and fails
test by test) on the code before it."""
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import jakiro_ext.cli as cli_module
import jakiro_ext.cli.common as cli_common
from jakiro_ext import ops
from jakiro_ext.methods import METHODS as METHOD_SPECS
from jakiro_ext.engine import draft_lag
from jakiro_ext.engine.drafter import Drafter
from jakiro_ext.config import TreeConfig
from jakiro_ext.engine.generate import speculative_generate
from jakiro_ext.models.heads.config import DraftConfig
from jakiro_ext.models.heads.draft_head import DraftHead
from jakiro_ext.kv_cache import BufferPool, KVCache
from jakiro_ext.ops.masks import causal_tree_mask
from jakiro_ext.models.llama import LlamaModel
from helpers import copy_head, prompt, random_head, tiny_target

REPO = Path(__file__).resolve().parents[2]
SHORT_ANSWER = "What is 2 + 2? Answer with a number only."  # SmolLM2: "2 + 2 = 4" and EOS
SHIPPED_HEAD = REPO / "jakiro_ext" / "heads" / "SmolLM2-135M-Instruct-jakiro"



@pytest.fixture
def no_allocation(monkeypatch):
    """Fails a test that allocates a KV cache or runs the target (the checks must come first)."""
    def refuse(*args, **kwargs):
        raise AssertionError("allocated or ran before checking the arguments")
    monkeypatch.setattr(KVCache, "__init__", refuse)
    monkeypatch.setattr(LlamaModel, "forward", refuse)


# ----------------------------------------------------------------------------- API arguments
IDS = prompt()  # 13 tokens of the tiny vocabulary (211)
BAD_ARGUMENTS = [
    (dict(input_ids=[1.0, 2.0]), TypeError, r"input_ids must be ints \(token ids\), got float 1.0"),
    (dict(input_ids=[1, True]), TypeError, r"input_ids must be ints \(token ids\), got bool True"),
    (dict(input_ids=torch.tensor([True, False])), TypeError, r"input_ids must be an integer tensor, got dtype torch.bool"),
    (dict(input_ids=IDS.double()), TypeError, r"input_ids must be an integer tensor, got dtype torch.float64"),
    (dict(input_ids="hello"), TypeError, r"input_ids must be a list of ints or an integer tensor, got str"),
    (dict(input_ids=[]), ValueError, r"input_ids must not be empty"),
    (dict(input_ids=IDS[:0]), ValueError, r"input_ids must not be empty"),
    (dict(input_ids=[[1, 2], []]), ValueError, r"input_ids\[1\] must not be empty"),
    (dict(input_ids=[[1, 2], [3, 4.0]]), TypeError, r"input_ids\[1\] must be ints \(token ids\), got float 4.0"),
    (dict(input_ids=IDS.view(1, 1, -1)), ValueError, r"input_ids must be \[n\] \(a prompt\) or \[B, n\] \(a batch of "
                                                    r"prompts\), got shape \(1, 1, 13\)"),
    (dict(input_ids=IDS.view(1, -1), lengths=[14]), ValueError, r"lengths\[0\] must be in \[1, 13\], got 14"),
    (dict(max_new_tokens=[5]), TypeError, r"max_new_tokens must be an int, one value for every sequence of a batch"),
    (dict(input_ids=[5, 2**70]), ValueError, r"input_ids must be token ids in \[0, 211\) \(the target's vocabulary\), "
                                             r"got values in \[5, 1180591620717411303424\]"),
    (dict(input_ids=[-1, 3]), ValueError, r"input_ids must be token ids in \[0, 211\)"),
    (dict(max_new_tokens=2.5), TypeError, r"max_new_tokens must be an int, got float 2.5"),
    (dict(max_new_tokens=True), TypeError, r"max_new_tokens must be an int, got bool True"),
    (dict(max_new_tokens=torch.tensor(3)), TypeError, r"max_new_tokens must be an int, got Tensor tensor\(3\)"),
    (dict(max_new_tokens=-1), ValueError, r"max_new_tokens must be >= 1, got -1"),
    (dict(temperature=float("nan")), ValueError, r"temperature must be finite, got nan"),
    (dict(temperature=float("inf")), ValueError, r"temperature must be finite, got inf"),
    (dict(temperature="0.5"), TypeError, r"temperature must be a real number, got str '0.5'"),
    (dict(temperature=-0.5), ValueError, r"temperature must be >= 0 \(0: greedy\), got -0.5"),
    (dict(top_p=float("nan")), ValueError, r"top_p must be finite, got nan"),
    (dict(top_p=float("-inf")), ValueError, r"top_p must be finite, got -inf"),
    (dict(top_p=1.5), ValueError, r"top_p must be in \(0, 1\], got 1.5"),
    (dict(top_k=-1), ValueError, r"top_k must be >= 0, got -1"),
    (dict(top_k=2.0), TypeError, r"top_k must be an int, got float 2.0"),
    (dict(eos_token_id="2"), TypeError, r"eos_token_id must be None, an int or a list of ints, got str '2'"),
    (dict(eos_token_id=2.0), TypeError, r"eos_token_id must be None, an int or a list of ints, got float 2.0"),
    (dict(eos_token_id=True), TypeError, r"eos_token_id must be None, an int or a list of ints, got bool True"),
    (dict(eos_token_id=torch.tensor(2)), TypeError, r"eos_token_id must be None, an int or a list of ints, got Tensor"),
    (dict(eos_token_id=[2, "3"]), TypeError, r"eos_token_id must be None, an int or a list of ints, got list \[2, '3'\]"),
    (dict(seed=2**70), ValueError, r"seed must be in \[0, 9223372036854775807\], got 1180591620717411303424"),
    (dict(seed=-1), ValueError, r"seed must be in \[0, 9223372036854775807\], got -1"),
    (dict(seed=1.5), TypeError, r"seed must be an int, got float 1.5"),
    (dict(max_cache_len=0), ValueError, r"max_cache_len must be >= 1, got 0"),
    (dict(max_cache_len=40.0), TypeError, r"max_cache_len must be an int, got float 40.0"),
    (dict(method=5), TypeError, r"method must be a str \(one of \('ar', 'eagle2', 'jakiro', 'jakiro_star', 'gumiho'\)\), got int 5"),
    (dict(method=""), ValueError, r"method must be one of \('ar', 'eagle2', 'jakiro', 'jakiro_star', 'gumiho'\), got ''"),
    (dict(tree="cpu"), TypeError, r"tree must be a TreeConfig, got str 'cpu'"),
    (dict(on_tokens=5), TypeError, r"on_tokens must be None or a callable, got int"),
]


@pytest.mark.parametrize("kwargs,error,message", BAD_ARGUMENTS, ids=[f"{i}-{next(iter(k))}" for i, (k, _, _) in
                                                                   enumerate(BAD_ARGUMENTS)])
def test_bad_api_arguments_are_clear_errors_before_any_allocation(target, no_allocation, kwargs, error, message):
    kwargs = {"input_ids": IDS, "max_new_tokens": 5, **kwargs}
    with pytest.raises(error, match=message):
        speculative_generate(target, None, **kwargs)


def test_integral_and_list_arguments_are_accepted(target):
    plain = speculative_generate(target, None, IDS, 12).token_ids
    eos = plain[6]
    want = plain[: plain.index(eos) + 1]
    for kwargs in (dict(input_ids=IDS.tolist()), dict(input_ids=[IDS.tolist()]), dict(input_ids=IDS.int()),
                   dict(input_ids=IDS.unsqueeze(0), max_new_tokens=np.int64(12), seed=np.uint8(3), top_k=np.int32(0))):
        kwargs = {"max_new_tokens": 12, **kwargs}
        assert speculative_generate(target, None, **kwargs).token_ids == plain
    for eos_ids in (eos, np.int64(eos), [eos], (eos, 10**6)):
        assert speculative_generate(target, None, IDS, 12, eos_token_id=eos_ids).token_ids == want


def test_tree_config_sizes_must_be_ints():
    for args, message in [((2.5, 2, 2), r"tree total_tokens must be an int, got float 2.5"),
                          ((6, True, 2), r"tree depth must be an int, got bool True"),
                          ((6, 2, 2.0), r"tree top_k must be an int, got float 2.0")]:
        with pytest.raises(TypeError, match=message):
            TreeConfig(*args)
    with pytest.raises(ValueError, match=r"static tree choices must be a list of lists of child ranks, got \[\[0.5\]\]"):
        TreeConfig(choices=[[0.5]])
    with pytest.raises(ValueError, match=r"static tree choices must be a list of lists of child ranks, got '01'"):
        TreeConfig(choices="01")


def test_tree_top_k_beyond_the_draft_vocabulary_is_refused_before_any_allocation(target, no_allocation):
    config = DraftConfig.for_target(target.config, "jakiro", num_experts=4)
    config.draft_vocab_size = 50
    head = DraftHead(config).init_weights(1, std=0.2).set_draft_vocab(torch.arange(50) * 4).bind(target)
    for tree, what in [(TreeConfig(6, 2, 51), r"children drafted per node"),
                       (TreeConfig(choices=[[0], [50]]), r"a static tree's widest child rank \+ 1")]:
        with pytest.raises(ValueError, match=rf"the tree's top_k \({what}\) is 51, more than the draft vocabulary of "
                                             r"the head \(50 tokens\)"):
            speculative_generate(target, head, IDS, 5, method="jakiro_star", tree=tree)


# ----------------------------------------------------------------------------- context limit
@pytest.fixture(scope="module")
def short_target():
    """The tiny target with a 40-position context."""
    model = tiny_target()
    model.config.max_position_embeddings = 40
    return model


def test_context_limit_is_read_from_transformers():
    import transformers

    from jakiro_ext.models.llama import LlamaConfig

    cfg = transformers.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=123)
    assert LlamaConfig.from_hf(cfg).max_position_embeddings == 123


def test_a_prompt_that_fills_the_context_is_refused_up_front(short_target, no_allocation):
    for n in (40, 41, 1000):
        with pytest.raises(ValueError, match=rf"the prompt has {n} tokens, but the target's context holds 40 positions "
                                             r"\(max_position_embeddings\): no room for a new token"):
            speculative_generate(short_target, None, torch.arange(n) % 211, 5)


@pytest.mark.parametrize("method", ["ar", "jakiro"])
def test_generation_stops_at_the_context_limit(short_target, method):
    head = copy_head(short_target, "jakiro") if method != "ar" else None
    ids = prompt(n=30)
    out = speculative_generate(short_target, head, ids, 100, method=method, tree=TreeConfig(16, 4, 4))
    assert len(out.token_ids) == 10 and out.stats.stop_reason == "context_limit"  # positions 30..39
    exact = speculative_generate(short_target, None, ids, 10)
    assert out.token_ids == exact.token_ids and exact.stats.stop_reason == "max_new_tokens"
    last = speculative_generate(short_target, head, prompt(n=39), 5, method=method)
    assert len(last.token_ids) == 1 and last.stats.stop_reason == "context_limit"


# ----------------------------------------------------------------------------- KV cache sizing
def test_tree_node_bound_is_what_the_drafting_can_produce(target):
    huge = TreeConfig(1024, 2, 2)
    assert [huge.max_nodes_for(m) for m in ("ar", "eagle2", "jakiro", "jakiro_star")] == [1, 11, 11, 21]
    assert TreeConfig(60, 5, 10).max_nodes_for("jakiro_star") == 60
    assert TreeConfig(choices=[[0], [1], [0, 0], [0]]).max_nodes_for("eagle2") == 4
    # With a random head every candidate is a distinct token: the trees reach the bound.
    ids = prompt()
    for kind, method in [("eagle2", "eagle2"), ("jakiro", "jakiro"), ("jakiro", "jakiro_star")]:
        for tree in (TreeConfig(1024, 2, 2), TreeConfig(1024, 3, 3)):
            drafter = Drafter(random_head(target, kind), METHOD_SPECS[method], tree)
            cache = target.new_cache(1, 64)
            _, hidden = target(ids.unsqueeze(0), cache, last_logits_only=True)
            tokens = drafter.draft(ids[-1:], *drafter.prefill(ids[1:], hidden[0, :-1])).tokens[0]
            bound = tree.max_nodes_for(method)
            assert tokens.numel() <= bound
            if method != "jakiro_star":  # (the two experts' proposals can repeat a token)
                assert tokens.numel() == bound, (method, tree)


def test_kv_cache_grows_on_demand_and_keeps_committed_entries(target):
    cache = target.new_cache(1, 4, 20)
    assert cache.capacity == 4 and cache.max_capacity == 20
    cache.kv.normal_()
    cache.commit(3)
    committed = cache.kv[..., :3, :].clone()
    cache.reserve(4)
    assert cache.capacity == 4
    cache.reserve(5)
    assert cache.capacity == 8 and torch.equal(cache.kv[..., :3, :], committed)
    cache.reserve(17)
    assert cache.capacity == 17 and torch.equal(cache.kv[..., :3, :], committed)
    cache.reserve(18)
    assert cache.capacity == 20  # twice 17, capped by the bound
    with pytest.raises(ValueError, match=r"21 cache positions needed, beyond the cache capacity 20"):
        cache.reserve(21)
    # The forward grows the cache: a 30-token prompt in a cache that starts at 4.
    cache = target.new_cache(1, 4, 64)
    ids = prompt(n=30)
    logits, _ = target(ids.unsqueeze(0), cache)
    want, _ = target(ids.unsqueeze(0), target.new_cache(1, 30))
    assert cache.capacity == 30 and torch.equal(logits, want)


def test_sliding_window_bounds_a_growing_cache():
    import transformers

    from jakiro_ext.models.llama import LlamaConfig

    mistral = transformers.MistralConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, sliding_window=16)
    model = LlamaModel(LlamaConfig.from_hf(mistral))
    with pytest.raises(ValueError, match=r"cache capacity 32 exceeds the model's sliding window 16"):
        model.new_cache(1, 4, 32)
    cache = model.new_cache(1, 4, 16)
    cache.reserve(9)
    assert cache.capacity == 9
    cache.reserve(10)
    assert cache.capacity == 16  # twice 9, capped by the window
    with pytest.raises(ValueError, match=r"17 cache positions needed, beyond the cache capacity 16"):
        cache.reserve(17)


def test_a_failed_allocation_says_how_many_bytes(target):
    with pytest.raises(MemoryError, match=r"a KV cache of 10000000000000 positions \(\[2, 2, 1, 2, 10000000000000, "
                                          r"16\], torch.float32\), which needs 5120000000000000 bytes \(4768371.58 GiB\)"):
        target.new_cache(1, 10**13)


def test_caches_start_small_whatever_max_new_tokens_and_total_tokens_say(target, monkeypatch):
    """max_new_tokens=10**9 and total_tokens=1024 used to ask for terabytes up front; now the
    caches start at prompt + a few hundred tokens + the real tree, bounded by the context."""
    made = []
    original = KVCache.__init__

    def spy(self, config, batch, capacity, *args, **kwargs):
        original(self, config, batch, capacity, *args, **kwargs)
        made.append((config.num_layers, capacity, self.max_capacity))
    monkeypatch.setattr(KVCache, "__init__", spy)
    ids = prompt()
    plain = speculative_generate(target, None, ids, 12).token_ids
    made.clear()
    out = speculative_generate(target, copy_head(target, "jakiro"), ids, 10**9, method="jakiro",
                               tree=TreeConfig(1024, 2, 2))
    assert out.token_ids[:12] == plain and out.stats.stop_reason == "context_limit"
    limit = target.config.max_position_embeddings  # 2048: transformers' default
    # The prompt runs alone in caches of its own size (target, then draft, with the drafting
    # scratch: an 11-node tree, or the pairs a catch-up after plain rounds runs at once), then the
    # generation's growing caches (target, draft) take it.
    scratch = max(11, draft_lag.window(1))  # (one prompt: a batch of one row)
    assert [(layers, start) for layers, start, bound in made if start == bound] == [(2, 13), (1, 13 + scratch)]
    (target_layers, target_start, target_bound), (draft_layers, draft_start, draft_bound) = [
        m for m in made if m[1] < m[2]]
    assert (draft_layers, target_layers) == (1, 2)
    # prompt + budget + an 11-node tree; the bound rounded up as a batch's caches are (to 256 positions)
    quantum = BufferPool().quantum
    assert target_start == 13 + 256 + 11 and target_bound == -(-(limit + 11) // quantum) * quantum
    assert draft_start <= target_start + scratch and draft_bound <= target_bound + scratch


def test_dedupe_of_expert_proposals_is_not_quadratic():
    """jakiro_star's repeated-token removal matches the pairwise definition, without a [R, C, C] tensor."""
    from jakiro_ext.engine.drafter import dedupe as _dedupe

    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        C = int(torch.randint(1, 30, (1,), generator=g))
        lp = torch.randint(-5, 0, (4, C), generator=g).float()
        ids = torch.randint(0, 8, (4, C), generator=g)
        s_lp, order = lp.sort(dim=-1, descending=True, stable=True)
        s_ids = ids.gather(-1, order)
        repeated = (s_ids.unsqueeze(-1) == s_ids.unsqueeze(-2)).tril(-1).any(-1)
        want_lp, order = s_lp.masked_fill(repeated, float("-inf")).sort(dim=-1, descending=True, stable=True)
        got_lp, got_ids = _dedupe(lp, ids)
        assert torch.equal(got_lp, want_lp) and torch.equal(got_ids, s_ids.gather(-1, order))
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # peak so far
    _dedupe(torch.randn(8, 20000), torch.randint(0, 100, (8, 20000)))  # pairwise: [8, 20000, 20000], 3.2 GB
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before < 2**30


# ----------------------------------------------------------------------------- packed masks
def dense_causal(batch, T):
    return ops.pack_bits(torch.ones(T, T, dtype=torch.bool).tril()).unsqueeze(0).expand(batch, -1, -1)


@pytest.mark.parametrize("T", [1, 63, 64, 65, 130])
def test_packed_masks_are_bit_identical_to_the_dense_construction(T):
    assert torch.equal(causal_tree_mask(2, T), dense_causal(2, T))
    from jakiro_ext.ops.masks import packed_bit_ranges

    rows = torch.arange(T)
    assert torch.equal(packed_bit_ranges(rows, rows, T), ops.pack_bits(torch.eye(T, dtype=torch.bool)))
    first = torch.randint(0, T, (T,), generator=torch.Generator().manual_seed(T))
    last = (first + torch.randint(-1, 70, (T,), generator=torch.Generator().manual_seed(T + 1))).clamp(max=T - 1)
    cols = torch.arange(T)
    dense = (cols >= first.unsqueeze(1)) & (cols <= last.unsqueeze(1))
    assert torch.equal(packed_bit_ranges(first, last, T), ops.pack_bits(dense))


def test_long_prompt_masks_are_built_packed(target, monkeypatch):
    """An 8,000-token prompt's mask used to go through a dense [T, T] int64 tensor (1.1 GB, 2.5 s)."""
    pack_bits = ops.pack_bits

    def small_only(bits):
        assert bits.shape[-1] <= 256, f"a dense mask of {tuple(bits.shape)}"
        return pack_bits(bits)
    monkeypatch.setattr(ops, "pack_bits", small_only)
    t0 = time.perf_counter()
    mask = causal_tree_mask(1, 8000)
    assert time.perf_counter() - t0 < 2.0 and mask.shape == (1, 8000, 125)
    assert mask[0, 6399, 99] == -1 and mask[0, 6399, 100] == 0 and mask[0, 6400, 100] == 1
    # A long prompt through the engine, with a head (its catch-up runs the prompt too).
    ids = torch.arange(1500) % 211
    out = speculative_generate(target, copy_head(target, "jakiro"), ids, 6, method="jakiro_star",
                               tree=TreeConfig(100, 3, 100))  # a draft layer of 100 rows
    assert out.token_ids == speculative_generate(target, None, ids, 6).token_ids


# ----------------------------------------------------------------------------- non-finite logits
def test_non_finite_target_logits_are_an_error_never_a_token(target, monkeypatch):
    """On a GPU verify_tree marks an unusable logit row with accept_len = bonus = -1."""
    verify_tree, calls = ops.verify_tree, []

    def marks_second_call(*args):
        path, accepted, bonus = verify_tree(*args)
        calls.append(1)
        if len(calls) == 2:
            accepted, bonus = torch.full_like(accepted, -1), torch.full_like(bonus, -1)
        return path, accepted, bonus
    monkeypatch.setattr(ops, "verify_tree", marks_second_call)
    seen = []
    with pytest.raises(RuntimeError, match=r"the target's logits are not finite \(NaN or inf\)"):
        speculative_generate(target, copy_head(target, "jakiro"), IDS, 20, on_tokens=seen.extend)
    assert len(seen) == 1 and seen[0] >= 0  # the prompt's token, then nothing


def test_nan_target_weights_raise_on_the_cpu(monkeypatch):
    model = tiny_target()
    with torch.no_grad():
        model.norm.weight[3] = float("nan")
    seen = []
    with pytest.raises(RuntimeError, match=r"finite"):
        speculative_generate(model, None, IDS, 5, on_tokens=seen.extend)
    assert seen == []


def test_non_finite_draft_logits_are_an_error_never_a_draft(target, monkeypatch):
    config = DraftConfig.for_target(target.config, "jakiro", num_experts=4)
    config.draft_vocab_size = 50
    head = DraftHead(config).init_weights(1, std=0.2).set_draft_vocab(torch.arange(50) * 4).bind(target)
    contrastive_topk = ops.contrastive_topk

    def marked(*args):  # the op's mark of a row whose logits are not finite
        lp, ids = contrastive_topk(*args)
        return torch.full_like(lp, float("nan")), torch.full_like(ids, -1)
    monkeypatch.setattr(ops, "contrastive_topk", marked)
    with pytest.raises(RuntimeError, match=r"the draft head produced non-finite logits \(NaN or inf\)"):
        speculative_generate(target, head, IDS, 5, method="jakiro")
    monkeypatch.setattr(ops, "contrastive_topk", contrastive_topk)
    with torch.no_grad():
        head.fc.weight[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match=r"the draft head produced non-finite logits \(NaN or inf\)"):
        speculative_generate(target, head, IDS, 5, method="jakiro")


# ----------------------------------------------------------------------------- head files
def test_head_files_are_checked_with_their_name(target, tmp_path):
    good = tmp_path / "good"
    random_head(target, "jakiro").save(good)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"draft head directory .*nowhere not found"):
        DraftHead.load(tmp_path / "nowhere", target)
    with pytest.raises(FileNotFoundError, match=r"empty/config.json not found"):
        DraftHead.load(tmp_path / "empty", target)

    def variant(name, config=None, weights=None):
        path = tmp_path / name
        shutil.copytree(good, path)
        if config is not None:
            (path / "config.json").write_bytes(config if isinstance(config, bytes) else json.dumps(config).encode())
        if weights is not None:
            (path / "model.safetensors").write_bytes(weights)
        return path
    raw = json.loads((good / "config.json").read_text())
    data = (good / "model.safetensors").read_bytes()
    cases = [
        (variant("truncated", weights=data[: len(data) // 2]), r"truncated/model.safetensors: not a readable safetensors file"),
        (variant("garbage", weights=os.urandom(1000)), r"garbage/model.safetensors: not a readable safetensors file"),
        (variant("malformed", config=b'{"hidden_size": 64,'), r"malformed/config.json: not a JSON config"),
        (variant("latin1", config=b'{"target": "caf\xe9"}'), r"latin1/config.json: not a JSON config"),
        (variant("list", config=[1, 2]), r"list/config.json: expected a JSON object, got list"),
        (variant("missing", config={k: v for k, v in raw.items() if k != "head_dim"}), r"missing/config.json: missing keys \['head_dim'\]"),
        (variant("typed", config={**raw, "num_heads": "4"}), r"typed/config.json: num_heads must be a JSON int, got '4'"),
        (variant("experts", config={**raw, "num_experts": 1}), r"experts/config.json: num_experts must be 0 \(dense\) or >= 2"),
        # Another hidden size: refused from the config, before the (here unreadable) weights.
        (variant("hidden", config={**raw, "hidden_size": 32}, weights=b"x"),
         r"hidden/config.json: the draft head was made for a target with hidden_size 32, but this target has hidden_size 64"),
        (variant("shapes", config={**raw, "intermediate_size": 8}), r"shapes/model.safetensors does not fit its config.json: "
                                                                     r".*w_gate has shape \[4, 64, 64\], expected \[4, 8, 64\]"),
    ]
    for path, message in cases:
        with pytest.raises(ValueError, match=message):
            DraftHead.load(path, target)
    from safetensors.torch import load_file, save_file

    random_head(target, "jakiro").save(tmp_path / "nan")  # (save refuses a NaN: the file is damaged after)
    state = load_file(str(tmp_path / "nan" / "model.safetensors"))
    state["router"][0, 0] = float("nan")
    save_file(state, str(tmp_path / "nan" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"nan/model.safetensors does not fit its config.json: router holds non-finite values"):
        DraftHead.load(tmp_path / "nan", target)


# ----------------------------------------------------------------------------- the CLI
@pytest.fixture(scope="module")
def default_target():
    from jakiro_ext.models import load_default_target

    return load_default_target(torch.float32)


@pytest.fixture
def cli(monkeypatch, capsys, default_target):
    """main(argv) in-process, the default model loaded once: returns (status, stdout, stderr
    lines, whether the model was asked for)."""
    loads = []

    def load_target(dtype_name, device="cpu", directory=None):
        from jakiro_ext.models.default import DEFAULT_MODEL

        loads.append(dtype_name)
        return (*default_target, DEFAULT_MODEL)
    monkeypatch.setattr(cli_common, "load_target", load_target)

    def run(*argv):
        loads.clear()
        try:
            status = cli_module.main(list(argv))
        except SystemExit as exc:
            status = exc.code
        out, err = capsys.readouterr()
        return status, out, err.splitlines(), bool(loads)
    return run


OPTION_ERRORS = [
    (["--threads", "-2"], r"--threads must be in \[0, \d+\] \(0: torch's default\), got -2"),
    (["--threads", "100000"], r"--threads must be in \[0, \d+\]"),
    (["--temperature", "nan"], r"temperature must be finite, got nan"),
    (["--temperature", "inf"], r"temperature must be finite, got inf"),
    (["--temperature", "-1"], r"temperature must be >= 0"),
    (["--top-p", "-0.5"], r"top_p must be in \(0, 1\], got -0.5"),
    (["--top-p", "nan"], r"top_p must be finite, got nan"),
    (["--top-k", "-1"], r"top_k must be >= 0, got -1"),
    (["--max-new-tokens", "0"], r"max_new_tokens must be >= 1, got 0"),
    (["--max-new-tokens", "2.5"], r"argument --max-new-tokens: invalid int value: '2.5'"),
    (["--seed", str(2**70)], r"seed must be in \[0, 9223372036854775807\]"),
    (["--total-tokens", "1"], r"a dynamic tree needs total_tokens in \[2, 1024\]"),
    (["--total-tokens", "1000000"], r"a dynamic tree needs total_tokens in \[2, 1024\]"),
    (["--top-k-draft", "8000"], r"top_k in \[1, 128\]"),
    (["--depth", "100000"], r"depth in \[1, 64\]"),
    (["--static-tree", "[[0], [0, 0], [0, 200]]"], r"ranks below 128"),
    (["--static-tree", "[[0.5]]"], r"static tree choices must be a list of lists of child ranks"),
    (["--graphs", "cuda"], r"--graphs cuda needs --device cuda, got --device cpu"),
    (["--graphs", "fast"], r"argument --graphs: invalid choice: 'fast'"),
] + ([] if torch.cuda.is_available() else [
    (["--device", "cuda"], r"--device cuda: no CUDA device is available")])


@pytest.mark.parametrize("options,message", OPTION_ERRORS, ids=[" ".join(o) for o, _ in OPTION_ERRORS])
def test_cli_bad_options_are_one_line_before_loading_the_model(cli, options, message):
    status, out, err, loaded = cli("generate", "Name a fruit.", "--max-new-tokens", "3", *options)
    assert status == 2 and len(err) == 1 and err[0].startswith("error: "), err
    assert re.search(message, err[0]), err[0]
    assert not loaded


def test_cli_train_from_elsewhere_on_the_readmes_corpus_path_is_refused_before_the_model_loads(cli, tmp_path,
                                                                                              monkeypatch):
    monkeypatch.chdir(tmp_path)  # not the clone's root: corpus/ is not here
    status, _, err, loaded = cli("train", "--data", "corpus/SmolLM2-135M-Instruct", "--shards", "1", "--out",
                                 str(tmp_path / "head"))
    assert status == 2 and not loaded and len(err) == 1, err
    assert err[0].startswith(f"error: --data corpus/SmolLM2-135M-Instruct: no token corpus there (seen from {tmp_path})")


def test_a_packaged_corpus_is_found_by_its_name():
    """`train --data SmolLM2-135M-Instruct` (the README's line) reads the committed corpus from
    anywhere: installed with the package, or beside the source tree; a path is never taken for a name."""
    from jakiro_ext.paths import packaged_corpus

    found = packaged_corpus("SmolLM2-135M-Instruct")
    assert found is not None and (found / "corpus.json").is_file() and found.name == "SmolLM2-135M-Instruct"
    for name in ("corpus/SmolLM2-135M-Instruct", "..", "", "no-such-model"):
        assert packaged_corpus(name) is None


@pytest.mark.parametrize("limit", ["0", "-1"])
def test_cli_bench_limit_must_be_positive(cli, limit):
    status, _, err, loaded = cli("bench", "--limit", limit, "--method", "ar", "--max-new-tokens", "2")
    assert (status, err, loaded) == (2, [f"error: --limit must be >= 1, got {limit}"], False)


def test_cli_non_utf8_prompt_is_one_line(tmp_path):
    # cwd outside the repository: `-m` runs the installed package, as every test uses.
    run = subprocess.run([sys.executable, "-m", "jakiro_ext", "generate", b"caf\xe9 \xff\xfe"], capture_output=True,
                         cwd=tmp_path, timeout=300)
    assert run.returncode == 2 and run.stderr.decode().splitlines() == ["error: the prompt is not valid UTF-8 text"]


def test_cli_runs_from_the_clones_root():
    # There `-m jakiro_ext` imports the source tree, which uses the installed build of its kernels.
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, "-m", "jakiro_ext", "show-config"], capture_output=True, text=True,
                         cwd=root, timeout=300)
    assert run.returncode == 0 and "compiled ops: loaded" in run.stdout, run.stdout + run.stderr
    run = subprocess.run([sys.executable, "-m", "jakiro_ext", "generate", "Hi", "--method", "ar", "--max-new-tokens",
                          "3"], capture_output=True, text=True, cwd=root, timeout=300)
    assert run.returncode == 0 and "[ar] 3 tokens" in run.stdout, run.stdout + run.stderr


def test_cli_without_the_compiled_library_is_one_line(cli, monkeypatch):
    monkeypatch.setattr(ops, "compiled_available", lambda: False)
    monkeypatch.setattr(ops, "LOAD_ERROR", "the compiled library jakiro_ext._C could not be loaded: (the reason)")
    monkeypatch.setattr(ops, "USE_REFERENCE", False)
    status, _, err, loaded = cli("generate", "Hi", "--max-new-tokens", "2")
    assert status == 2 and not loaded and err == [
        "error: the compiled library jakiro_ext._C could not be loaded: (the reason) (JAKIRO_USE_REFERENCE=1 runs the "
        "slow pure-PyTorch reference ops instead)"]


def test_cli_bad_head_directories_are_one_line(cli, tmp_path):
    (tmp_path / "empty").mkdir()
    heads = {}
    for name in ("truncated", "garbage", "hidden", "malformed", "nan"):
        heads[name] = tmp_path / name
        shutil.copytree(SHIPPED_HEAD, heads[name])
    weights = (SHIPPED_HEAD / "model.safetensors").read_bytes()
    (heads["truncated"] / "model.safetensors").write_bytes(weights[: len(weights) // 3])
    (heads["garbage"] / "model.safetensors").write_bytes(os.urandom(4096))
    config = json.loads((SHIPPED_HEAD / "config.json").read_text())
    (heads["hidden"] / "config.json").write_text(json.dumps({**config, "hidden_size": 512}))
    (heads["malformed"] / "config.json").write_text('{"hidden_size": 576,\n')
    from safetensors.torch import load_file, save_file

    state = load_file(str(SHIPPED_HEAD / "model.safetensors"))
    state["fc.weight"][0, 0] = float("nan")
    save_file(state, str(heads["nan"] / "model.safetensors"))
    cases = [
        ("/nonexistent/head", r"draft head directory /nonexistent/head not found"),
        (tmp_path / "empty", r"empty/config.json not found"),
        (heads["truncated"], r"truncated/model.safetensors: not a readable safetensors file"),
        (heads["garbage"], r"garbage/model.safetensors: not a readable safetensors file"),
        (heads["hidden"], r"hidden/config.json: the draft head was made for a target with hidden_size 512, but this "
                          r"target has hidden_size 576"),
        (heads["malformed"], r"malformed/config.json: not a JSON config \(Expecting"),
        (heads["nan"], r"nan/model.safetensors does not fit its config.json: fc.weight holds non-finite values"),
        (SHIPPED_HEAD.parent / "SmolLM2-135M-Instruct-eagle2", r"holds an eagle2 head, but a jakiro head is needed"),
    ]
    for path, message in cases:
        status, _, err, loaded = cli("generate", "Hi", "--max-new-tokens", "2", "--jakiro-head", str(path))
        assert status == 2 and len(err) == 1 and err[0].startswith("error: "), (path, err)
        assert re.search(message, err[0]), err[0]
        if path in ("/nonexistent/head", tmp_path / "empty", heads["malformed"]):
            assert not loaded, path  # refused before the model loads


def test_cli_tree_wider_than_the_draft_vocabulary_is_one_line(cli):
    # 9000 > 8192 draft tokens: refused by the tree's own bound first (top_k <= 128); the draft
    # vocabulary check is test_tree_top_k_beyond_the_draft_vocabulary_is_refused_before_any_allocation's.
    status, _, err, _ = cli("generate", "Hi", "--max-new-tokens", "2", "--top-k-draft", "9000")
    assert status == 2 and len(err) == 1 and "top_k in [1, 128]" in err[0], err


def test_cli_bad_prompt_files_are_one_line(cli, tmp_path):
    files = {"turns5.jsonl": b'{"turns": [5]}\n', "number.jsonl": b"5\n", "list.jsonl": b'["a prompt"]\n',
             "category.jsonl": b'{"prompt": "Hi", "category": 7}\n', "latin1.jsonl": b'{"prompt": "caf\xe9"}\n'}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    cases = [
        (tmp_path / "missing.jsonl", r"No such file or directory: '.*missing.jsonl'"),
        (tmp_path, r"Is a directory"),
        (tmp_path / "turns5.jsonl", r"turns5.jsonl:1: expected a 'prompt' string or a non-empty 'turns' list of strings, "
                                    r"got \['turns'\]"),
        (tmp_path / "number.jsonl", r"number.jsonl:1: expected .*, got int"),
        (tmp_path / "list.jsonl", r"list.jsonl:1: expected .*, got list"),
        (tmp_path / "category.jsonl", r"category.jsonl:1: 'category' must be a string, got 7"),
        (tmp_path / "latin1.jsonl", r"latin1.jsonl: not UTF-8 text \(invalid continuation byte at byte \d+\)"),
    ]
    for path, message in cases:
        status, _, err, loaded = cli("bench", "--prompts", str(path), "--method", "ar", "--max-new-tokens", "2")
        assert status == 2 and len(err) == 1 and err[0].startswith("error: "), (path, err)
        assert re.search(message, err[0]), err[0]
        assert not loaded


def test_cli_huge_requests_are_bounded_by_what_can_happen(cli, default_target):
    """--max-new-tokens 1000000000 used to ask for 46 TB (and --total-tokens 1000000 for 46 GB: now
    refused, trees hold at most 1024 nodes)."""
    from jakiro_ext.cli.common import chat_ids

    model, tokenizer = default_target
    want = speculative_generate(model, None, chat_ids(tokenizer, SHORT_ANSWER), 64,
                                eos_token_id=tokenizer.eos_token_id).token_ids
    assert want[-1] == tokenizer.eos_token_id  # the answer ends by itself
    for options in (["--method", "ar", "--max-new-tokens", "1000000000"],
                    ["--method", "jakiro", "--max-new-tokens", "1000000000", "--total-tokens", "1024"]):
        status, out, err, _ = cli("generate", SHORT_ANSWER, "--json", *options)
        assert status == 0, err
        result = json.loads(out)
        assert result["token_ids"] == want and result["stop_reason"] == "eos"


def test_cli_prompt_beyond_the_context_is_one_line(cli):
    status, _, err, _ = cli("generate", "word " * 9000, "--max-new-tokens", "2", "--method", "ar")
    assert status == 2 and len(err) == 1
    assert re.fullmatch(r"error: the prompt has \d+ tokens, but the target's context holds 8192 "
                                      r"positions \(max_position_embeddings\): no room for a new token", err[0]), err
