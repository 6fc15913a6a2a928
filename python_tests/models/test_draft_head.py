"""Draft heads: the inference forward (fused ops, KV cache, tree layers merged by log-sum-exp)
against the differentiable training forward, save/load, and refusing the wrong target."""
import pytest
import torch

from conftest import gen
from jakiro_ext import ops
from jakiro_ext.models import causal_tree_mask
from jakiro_ext.models.heads.config import DraftConfig
from jakiro_ext.models.heads.draft_head import DraftHead
from jakiro_ext.ops import quantized, reference
from jakiro_ext.kv_cache import TreeKV
from jakiro_ext.training.head_forward import train_forward
from helpers import tiny_target


def make_head(target, kind, seed=0):
    return DraftHead(DraftConfig.for_target(target.config, kind, num_experts=4)).init_weights(seed, std=0.2).bind(target)


def assert_steps_close(got, want, rows):
    for name in ("feature", "residual", "expert_out", "expert_score", "contrast_weight", "projected"):
        a, b = getattr(got, name), getattr(want, name)
        if a is None:
            assert b is None
            continue
        torch.testing.assert_close(a, b[:, rows], atol=1e-4, rtol=1e-4, msg=name)


@pytest.mark.parametrize("kind", ["eagle2", "jakiro", "gumiho", "jakiro_gumiho"])
def test_draft_tree_layers_match_the_training_forward_on_each_path(kind):
    """A chain prefix, then two tree layers: each tree node's output equals the training
    forward over the path prefix -> its ancestors -> itself (a plain causal sequence)."""
    target = tiny_target()
    head = make_head(target, kind)
    H, n = target.config.hidden_size, 9
    tokens = torch.randint(0, 211, (n + 3,), generator=gen(1))
    feats = torch.randn(n + 3, H, generator=gen(2))
    cache = head.new_cache(n + 8)
    prefix = head(tokens[:n].unsqueeze(0), feats[:n].unsqueeze(0), torch.arange(n).unsqueeze(0), cache,
                  causal_tree_mask(1, n))
    assert_steps_close(prefix, train_forward(head, tokens[:n].unsqueeze(0), feats[:n].unsqueeze(0)), slice(0, n))
    cache.commit(n)
    # Layer 1: three siblings at position n; layer 2: two nodes, children of siblings 2 and 0.
    l1_tok, l1_feat = torch.tensor([5, 17, 42]), torch.randn(3, H, generator=gen(3))
    l2_tok, l2_feat, l2_parent = torch.tensor([7, 99]), torch.randn(2, H, generator=gen(4)), [2, 0]
    itself = lambda k: ops.pack_bits(torch.eye(k, dtype=torch.bool)).unsqueeze(0)
    tree_kv = TreeKV()
    layer1 = head(l1_tok.unsqueeze(0), l1_feat.unsqueeze(0), torch.full((1, 3), n), cache, itself(3), tree_kv)
    tree_kv.append(cache, 3)
    tree_kv.visible = torch.tensor([[[False, False, True], [True, False, False]]])
    layer2 = head(l2_tok.unsqueeze(0), l2_feat.unsqueeze(0), torch.full((1, 2), n + 1), cache, itself(2), tree_kv)
    for r in range(3):
        seq_tok = torch.cat([tokens[:n], l1_tok[r:r + 1]]).unsqueeze(0)
        seq_feat = torch.cat([feats[:n], l1_feat[r:r + 1]]).unsqueeze(0)
        want = train_forward(head, seq_tok, seq_feat)
        assert_steps_close(type(layer1)(*(None if t is None else t[:, r:r + 1] for t in layer1)), want, slice(n, n + 1))
    for r, p in enumerate(l2_parent):
        seq_tok = torch.cat([tokens[:n], l1_tok[p:p + 1], l2_tok[r:r + 1]]).unsqueeze(0)
        seq_feat = torch.cat([feats[:n], l1_feat[p:p + 1], l2_feat[r:r + 1]]).unsqueeze(0)
        want = train_forward(head, seq_tok, seq_feat)
        assert_steps_close(type(layer2)(*(None if t is None else t[:, r:r + 1] for t in layer2)), want, slice(n + 1, n + 2))


def test_moe_features_follow_the_definitions():
    target = tiny_target()
    head = make_head(target, "jakiro")
    step = train_forward(head, torch.randint(0, 211, (1, 6), generator=gen(5)), torch.randn(1, 6, 64, generator=gen(6)))
    u, h, s, w = step.residual, step.expert_out, step.expert_score, step.contrast_weight
    torch.testing.assert_close(step.feature, u + s[..., :1] * h[..., 0, :] + s[..., 1:] * h[..., 1, :])
    torch.testing.assert_close(step.contrastive_feature(), u + w[..., :1] * h[..., 0, :] - w[..., 1:] * h[..., 1, :])
    branches = step.branch_features()
    torch.testing.assert_close(branches[..., 0, :], u + s.sum(-1, keepdim=True) * h[..., 0, :])
    assert bool((w[..., 0] >= w[..., 1]).all()) and bool((s[..., 0] >= s[..., 1]).all())


@pytest.mark.parametrize("kind", ["eagle2", "jakiro", "gumiho", "jakiro_gumiho"])
def test_save_load_round_trip(tmp_path, kind):
    target = tiny_target()
    head = make_head(target, kind, seed=3)
    head.save(tmp_path / "head")
    loaded = DraftHead.load(tmp_path / "head", target)
    assert loaded.config == head.config
    for (name, a), (_, b) in zip(head.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    assert sorted((tmp_path / "head").iterdir()) == [tmp_path / "head" / "config.json", tmp_path / "head" / "model.safetensors"]
    # The weights readable as the config is (safetensors alone would make them the owner's only).
    modes = {f.name: f.stat().st_mode & 0o777 for f in (tmp_path / "head").iterdir()}
    assert modes["model.safetensors"] == modes["config.json"], modes
    # The target's embedding / LM head are shared, never stored with the head.
    assert not any("embed" in k or "lm_head" in k for k in head.state_dict())


def test_gumiho_mlp_heads_follow_the_released_definition():
    # Head j: SiLU(Linear(2H -> H)), then mlp_blocks blocks x + SiLU(Linear(H -> H)(x)), each head
    # on the same input; the stacked, batched evaluation must be that, head by head.
    target = tiny_target()
    head = make_head(target, "gumiho", seed=4)
    with torch.no_grad():
        head.mlp_block_weight.normal_(0, 0.2, generator=gen(9))  # (zero at init)
        head.mlp_block_bias.normal_(0, 0.2, generator=gen(10))
    c = head.config
    assert (c.num_layers, c.num_mlp_heads, c.mlp_blocks) == (2, 2, 5) and c.kind == "gumiho"
    x = torch.randn(3, 4, 2 * c.hidden_size, generator=gen(11))
    got = head.mlp_heads(x)
    assert got.shape == (3, 4, c.num_mlp_heads, c.hidden_size)
    for j in range(c.num_mlp_heads):
        layers = [torch.nn.Linear(2 * c.hidden_size, c.hidden_size)] + [torch.nn.Linear(c.hidden_size, c.hidden_size)
                                                                         for _ in range(c.mlp_blocks)]
        with torch.no_grad():
            layers[0].weight.copy_(head.mlp_in_weight[j])
            layers[0].bias.copy_(head.mlp_in_bias[j])
            for b in range(c.mlp_blocks):
                layers[b + 1].weight.copy_(head.mlp_block_weight[j, b])
                layers[b + 1].bias.copy_(head.mlp_block_bias[j, b])
        h = torch.nn.functional.silu(layers[0](x))
        for layer in layers[1:]:
            h = h + torch.nn.functional.silu(layer(h))
        torch.testing.assert_close(got[:, :, j], h, atol=1e-5, rtol=1e-5)
    # Bad configurations are errors naming the field.
    with pytest.raises(ValueError, match=r"a Gumiho head needs num_mlp_heads >= 1, got 0"):
        DraftConfig.for_target(target.config, "gumiho", num_mlp_heads=0)


def test_gumiho_configs_are_checked(tmp_path):
    import json

    good = DraftConfig.for_target(tiny_target().config, "gumiho")
    for change, message in [(dict(num_layers=0), r"num_layers must be >= 1"),
                            (dict(num_layers=2, num_experts=4), r"and 1 with experts .*got 2 with num_experts 4"),
                            (dict(num_mlp_heads=-1), r"num_mlp_heads and mlp_blocks must be >= 0, got -1, 5")]:
        (tmp_path / "config.json").write_text(json.dumps({**good.__dict__, **change}))
        with pytest.raises(ValueError, match=message):
            DraftConfig.from_json(tmp_path / "config.json")


def test_loading_for_the_wrong_target_is_an_error(tmp_path):
    head = make_head(tiny_target(), "jakiro")
    head.config.target = "tiny-llama"
    head.save(tmp_path / "head")
    other = tiny_target(vocab=300)
    with pytest.raises(ValueError, match=r"made for a target with vocab_size 211, but this target has vocab_size 300 "
                                         r"\(the head's target: tiny-llama\)"):
        DraftHead.load(tmp_path / "head", other)
    with pytest.raises(FileNotFoundError, match=r"a draft head directory holds config.json and model.safetensors"):
        DraftHead.load(tmp_path / "nothing", other)
    with pytest.raises(ValueError, match=r"a Jakiro head needs num_experts >= 2"):
        DraftConfig.for_target(other.config, "jakiro", num_experts=1)


def test_a_head_named_for_another_model_loads_with_a_warning_naming_both(tmp_path):
    # The shapes fit, so the head works (the output is exact whatever the head), but its config
    # names another model: said once, never silent; the same model by another path is no warning.
    import warnings

    from jakiro_ext.models.llama import model_name

    target = tiny_target()
    head = make_head(target, "jakiro")
    head.config.target = "SmolLM2-360M-Instruct"
    head.save(tmp_path / "head")
    target.config.name = "SmolLM2-135M-Instruct"
    with pytest.warns(UserWarning, match=r"made for 'SmolLM2-360M-Instruct', but the target is 'SmolLM2-135M-Instruct'"):
        DraftHead.load(tmp_path / "head", target)
    for same in ("HuggingFaceTB/smollm2-360m-instruct", "/models/SmolLM2-360M-Instruct/", ""):
        target.config.name = same
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            DraftHead.load(tmp_path / "head", target)
    assert model_name("HuggingFaceTB/SmolLM2-135M") == model_name("/m/SmolLM2-135M/") == "SmolLM2-135M"


@pytest.mark.parametrize("kind", ["eagle2", "jakiro", "gumiho", "jakiro_gumiho"])
def test_training_time_test_unroll_is_what_drafting_computes(kind):
    """Step s of the unroll, row i, equals the causal forward over the sequence's first i + 1
    rows followed by the s draft rows of that anchor (their tokens and predicted features): the
    draft's view at depth s. Checked for every anchor and step, with a nontrivial mask of past steps."""
    from jakiro_ext.training.examples import Batch
    from jakiro_ext.training.loss import unroll

    target = tiny_target()
    head = make_head(target, kind, seed=5).double()  # float64: random heads' features grow step by step
    head.embed_weight = head.embed_weight.double()
    L, H, steps = 9, 64, 4
    tokens = torch.randint(0, 211, (2, L), generator=gen(7))
    feats = torch.randn(2, L, H, generator=gen(8), dtype=torch.float64)
    batch = Batch(tokens, feats, torch.ones(2, L, dtype=torch.bool))
    outs = [step for _, step in unroll(head, batch, steps)]
    for s in range(steps):
        for i in range(L - 1 - s):
            seq_tok = torch.stack([tokens[:, 1 + j] for j in range(i + 1)] + [tokens[:, i + 1 + d] for d in range(1, s + 1)], 1)
            seq_feat = torch.cat([feats[:, : i + 1]] + [outs[d - 1].feature[:, i : i + 1] for d in range(1, s + 1)], 1)
            want = train_forward(head, seq_tok, seq_feat)
            for name in ("feature", "residual") + (("expert_out",) if "jakiro" in kind else ()) + (("projected",) if "gumiho" in kind else ()):
                got = getattr(outs[s], name)[:, i]
                torch.testing.assert_close(got, getattr(want, name)[:, -1], rtol=1e-6, atol=1e-6,  # the router computes in fp32
                                           msg=f"step {s} row {i} {name}")


def _chain_and_layer(head, H):
    """A catch-up chain of 9 rows, then one tree layer of 3 rows: every output field, in order."""
    tokens = torch.randint(0, 211, (12,), generator=gen(1))
    feats = torch.randn(12, H, generator=gen(2))
    cache = head.new_cache(20)
    chain = head(tokens[:9].unsqueeze(0), feats[:9].unsqueeze(0), torch.arange(9).unsqueeze(0), cache,
                 causal_tree_mask(1, 9))
    cache.commit(9)
    layer = head(tokens[9:].unsqueeze(0), feats[9:].unsqueeze(0), torch.full((1, 3), 9), cache,
                 ops.pack_bits(torch.eye(3, dtype=torch.bool)).unsqueeze(0))
    return [t for step in (chain, layer) for t in step if t is not None]


@pytest.mark.parametrize("kind", ["eagle2", "jakiro"])
def test_a_bf16_head_in_float32_drafts_from_bf16_copies_with_the_same_bits(monkeypatch, kind):
    """A float32 head on the CPU whose fc, serial-layer projections and experts are all exactly bf16
    values (the shipped heads, stored in bf16) drafts from bf16 copies of them, [q | k | v] (and a
    dense MLP's [gate | up]) as one weight: the same bits as the float32 parameters read one by one
    (JAKIRO_CPU_BF16_WEIGHTS=0 keeps float32 copies); made once, made again when a weight changes,
    float32 while one is not exactly bf16. The LM head rows are read as Q8_0 blocks (a draft
    vocabulary of a multiple of 16 rows) or in bf16 (not a multiple), float32 with
    JAKIRO_CPU_BF16_DRAFT_LM_HEAD=0."""
    target = tiny_target()
    head = make_head(target, kind)
    for p in head.parameters():
        p.data = p.data.bfloat16().float()
    H = target.config.hidden_size
    products = head.products()
    assert head.products() is products
    mine = products.layers[id(head)]
    assert products.fc.dtype == mine.qkv.dtype == mine.o.dtype == torch.bfloat16
    assert torch.equal(mine.qkv.float(), torch.cat([head.q_proj.weight, head.k_proj.weight, head.v_proj.weight]))
    if kind == "eagle2":
        assert torch.equal(mine.gate_up.float(), torch.cat([head.gate_proj.weight, head.up_proj.weight]))
        assert torch.equal(mine.down.float(), head.down_proj.weight)
        assert products.experts is None
    else:
        assert mine.gate_up is None and mine.down is None
        assert [w.dtype for w in products.experts] == [torch.bfloat16] * 3
        assert all(torch.equal(w.float(), p) for w, p in zip(products.experts, (head.w_gate, head.w_up, head.w_down)))
    rows = head.lm_head_weight
    if rows.shape[0] % quantized.LANES == 0:
        assert torch.equal(quantized.unpack(products.lm_head), quantized.unpack(quantized.from_float(rows, "Q8_0")))
    else:
        assert products.lm_head.dtype == torch.bfloat16 and torch.equal(products.lm_head, rows.bfloat16())
    read = _chain_and_layer(head, H)
    monkeypatch.setenv("JAKIRO_CPU_BF16_WEIGHTS", "0")
    assert head.products().fc.dtype == torch.float32
    assert kind == "eagle2" or head.products().experts[0].dtype == torch.float32
    for a, b in zip(read, _chain_and_layer(head, H)):
        assert torch.equal(a, b)
    # The negative control: a float32 head's own weights are not bf16 values, and its outputs differ.
    monkeypatch.delenv("JAKIRO_CPU_BF16_WEIGHTS")
    with torch.no_grad():  # a changed weight: copies made again
        head.o_proj.weight.mul_(2)
    again = head.products()
    assert again is not products and torch.equal(again.layers[id(head)].o.float(), head.o_proj.weight)
    assert not torch.equal(_chain_and_layer(head, H)[0], read[0])
    with torch.no_grad():  # a weight beyond bf16's precision: float32 products
        head.fc.weight[0, 0] += 2.0 ** -20
    assert head.products().fc.dtype == torch.float32 and head.products().layers[id(head)].qkv.dtype == torch.float32
    monkeypatch.setenv("JAKIRO_CPU_BF16_DRAFT_LM_HEAD", "0")
    assert head.products().lm_head is head.lm_head_weight


def test_a_float32_draft_reads_its_draft_vocabulary_rows_as_q8_0_blocks(monkeypatch):
    """A float32 draft on the CPU whose draft vocabulary is a multiple of 16 rows reads them as Q8_0
    blocks quantized from the target's rows (as GGML quantizes), and drafts with them: its top-k is
    the op's over those blocks, the features quantized per row; JAKIRO_CPU_BF16_DRAFT_LM_HEAD=0
    reads float32 rows."""
    from dataclasses import replace
    target = tiny_target()
    base = make_head(target, "jakiro")
    ids = torch.randperm(target.config.vocab_size, generator=gen(4))[:64].sort().values
    head = DraftHead(replace(base.config, draft_vocab_size=64)).init_weights(0, std=0.2).set_draft_vocab(ids).bind(target)
    rows = target.lm_head.weight.detach()[ids]
    lm_head = head.products().lm_head
    assert quantized.format_of(lm_head) == "Q8_0"
    assert torch.equal(quantized.unpack(lm_head), quantized.unpack(quantized.from_float(rows, "Q8_0")))
    features = torch.randn(1, 3, target.config.hidden_size, generator=gen(5))
    lp, top = ops.contrastive_topk(features, None, None, lm_head, 4)
    want_lp, want_top = reference.contrastive_topk(features, None, None, lm_head, 4)
    assert torch.equal(top, want_top)
    torch.testing.assert_close(lp, want_lp, atol=1e-5, rtol=1e-5)
    monkeypatch.setenv("JAKIRO_CPU_BF16_DRAFT_LM_HEAD", "0")
    assert head.products().lm_head is head.lm_head_weight and head.lm_head_weight.dtype == torch.float32
    monkeypatch.delenv("JAKIRO_CPU_BF16_DRAFT_LM_HEAD")
    with torch.no_grad():  # a row that is not finite: bf16 rows, which keep it (drafting reports it)
        target.lm_head.weight[ids[5], 3] = float("inf")
    head.bind(target)
    assert head.products().lm_head.dtype == torch.bfloat16 and torch.isinf(head.products().lm_head[5, 3])


def test_a_new_head_is_initialised_and_a_head_that_is_not_finite_is_never_saved(tmp_path):
    # DraftHead(config) draws its weights (never torch.empty's leftovers); save refuses a head
    # whose weights are not finite, and writes nothing.
    target = tiny_target()
    head = DraftHead(DraftConfig.for_target(target.config, "jakiro"))
    assert all(bool(torch.isfinite(p).all()) for p in head.parameters())
    assert 0 < float(head.w_gate.detach().std()) < 0.05 and torch.equal(head.fc.bias, torch.zeros_like(head.fc.bias))
    again = DraftHead(DraftConfig.for_target(target.config, "jakiro"))
    assert all(torch.equal(a, b) for a, b in zip(head.parameters(), again.parameters()))  # seed 0: reproducible
    head.bind(target).save(tmp_path / "good")
    with torch.no_grad():
        head.w_up[1, 2, 3] = float("nan")
    with pytest.raises(ValueError, match=r"not saving the head to .*bad: w_up holds non-finite values \(nothing was "
                                         r"written\)"):
        head.save(tmp_path / "bad")
    assert not (tmp_path / "bad").exists()
    with torch.no_grad():
        head.w_up[1, 2, 3] = 7e4  # finite in float32, inf in float16
    with pytest.raises(ValueError, match=r"w_up holds non-finite values in torch.float16"):
        head.save(tmp_path / "good", dtype=torch.float16)
    assert DraftHead.load(tmp_path / "good", target) is not None  # the earlier save untouched


def test_a_head_is_shaped_for_a_transformers_model_or_its_config():
    import transformers

    from jakiro_ext.models.heads.config import target_config

    target = tiny_target()
    hf_config = transformers.LlamaConfig(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                         name_or_path="/models/tiny-llama")
    for given in (target, target.config, hf_config, transformers.LlamaForCausalLM(hf_config)):
        config = DraftConfig.for_target(given, "jakiro")
        assert (config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim) == (64, 4, 2, 16)
    assert DraftConfig.for_target(hf_config, "eagle2").target == "tiny-llama"  # named after the model
    assert DraftConfig.for_target(hf_config, "eagle2", target_name="mine").target == "mine"
    with pytest.raises(TypeError, match=r"target must be a LlamaConfig, a LlamaModel, a transformers model or its "
                                        r"config, got str"):
        target_config("tiny-llama")
