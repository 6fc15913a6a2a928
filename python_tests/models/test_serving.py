"""Heads for the serving engines, without the engines: the plain-PyTorch MoE block and draft
forward the plugins run against the head's own forward (random and shipped heads), the serving
format's round trip (through DraftHead.load and through the plugins' weight mapping into an
engine-shaped model), a MoE head whose experts are one MLP against the dense head, and the
plugins' version guard on fake engines."""
import json
import sys
import types
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

import jakiro_ext
from helpers import TREES, prompt, random_head
from jakiro_ext import ops
from jakiro_ext.engine.generate import speculative_generate
from jakiro_ext.models.heads.draft_head import DraftHead
from jakiro_ext.serving import format as serving_format
from jakiro_ext.training.head_forward import train_forward
from jakiro_ext.serving import plugins
from jakiro_ext.serving.format import blocked_tokens
from jakiro_ext.serving.layers import JakiroMoE, draft_forward, masked_logits
from jakiro_ext.serving.loading import load_draft_weights, load_serving_weights, set_up_draft



def reduced_head(target, kind, seed=1, vocab=120, renormalize=False):
    """A random head drafting over ``vocab`` of the target's tokens (every other id, then the rest)."""
    head = random_head(target, kind, seed)
    config = replace(head.config, draft_vocab_size=vocab, renormalize=renormalize)
    reduced = DraftHead(config)
    reduced.load_state_dict({**head.state_dict(), "draft_to_target": torch.zeros(vocab, dtype=torch.int64)})
    ids = torch.cat([torch.arange(0, target.config.vocab_size, 2), torch.arange(1, target.config.vocab_size, 2)])
    return reduced.set_draft_vocab(ids[:vocab]).bind(target)


def head_outputs(head, tokens, features):
    """The head's own feature and logits over the target's vocabulary (its draft tokens mapped to
    target ids; the others -inf)."""
    step = train_forward(head, tokens, features)
    logits = step.feature @ head.lm_head_weight.T
    full = torch.full((*logits.shape[:-1], head.config.vocab_size), float("-inf"))
    full[..., head.draft_to_target if head.config.draft_vocab_size else slice(None)] = logits
    return step.feature, full


@pytest.mark.parametrize("kind,vocab", [("jakiro", 120), ("jakiro", 0), ("eagle2", 120)])
def test_the_plain_pytorch_draft_forward_is_the_heads(target, kind, vocab):
    head = reduced_head(target, kind, vocab=vocab) if vocab else random_head(target, kind).bind(target)
    config, state = serving_format.serving_files(head)
    g = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, target.config.vocab_size, (2, 9), generator=g)
    features = torch.randn(2, 9, target.config.hidden_size, generator=g)
    feature, logits = draft_forward(config, state, head.embed_weight, target.lm_head.weight, tokens, features)
    want_feature, want_logits = head_outputs(head, tokens, features)
    torch.testing.assert_close(feature, want_feature, atol=1e-5, rtol=1e-5)
    assert torch.equal(logits.isinf(), want_logits.isinf())
    finite = ~want_logits.isinf()
    torch.testing.assert_close(logits[finite], want_logits[finite], atol=1e-5, rtol=1e-5)
    assert torch.equal(logits.argmax(-1), want_logits.argmax(-1))


def test_the_moe_block_is_the_heads_on_the_shipped_head():
    head = DraftHead.load(Path(jakiro_ext.__file__).parent / "heads" / "SmolLM2-135M-Instruct-jakiro").float()
    c = head.config
    block = JakiroMoE(c.hidden_size, c.intermediate_size, c.num_experts, c.renormalize)
    block.load_state_dict({n: getattr(head, n).detach() for n in serving_format.EXPERTS})
    x = torch.randn(64, c.hidden_size, generator=torch.Generator().manual_seed(5))
    _, expert_out, _, score, _ = ops.moe_top2(x, head.router, head.w_gate, head.w_up, head.w_down, c.renormalize)
    want = (score.unsqueeze(-1) * expert_out).sum(-2)
    # The outputs reach ~170 for unit-scale inputs: fp32 sums that large round at ~1e-5 absolute, and
    # the two summation orders (each 5e-5 from a float64 evaluation here) differ by that much.
    torch.testing.assert_close(block(x), want, atol=1e-6 * want.abs().max().item(), rtol=1e-5)


def test_the_moe_block_compiles_whole():
    block = JakiroMoE(32, 16, 4).to(torch.float32)
    for p in block.parameters():
        nn.init.normal_(p, std=0.2, generator=torch.Generator().manual_seed(0))
    x = torch.randn(3, 5, 32)
    compiled = torch.compile(block, backend="eager", fullgraph=True)  # a graph break would raise
    torch.testing.assert_close(compiled(x), block(x))
    with pytest.raises(ValueError, match="num_experts >= 2"):
        JakiroMoE(32, 16, 1)


def test_a_moe_head_whose_experts_are_one_mlp_is_the_dense_head(target):
    dense = random_head(target, "eagle2").bind(target)
    moe = DraftHead(replace(random_head(target, "jakiro").config, intermediate_size=dense.config.intermediate_size,
                            renormalize=True)).bind(target)
    with torch.no_grad():
        mine = moe.state_dict()
        for name, value in dense.state_dict().items():
            if name in mine:
                mine[name].copy_(value)
        for j in range(moe.config.num_experts):  # every expert the dense MLP; the scores sum to 1
            moe.w_gate[j].copy_(dense.gate_proj.weight)
            moe.w_up[j].copy_(dense.up_proj.weight)
            moe.w_down[j].copy_(dense.down_proj.weight)
        moe.router.normal_(0, 1.0, generator=torch.Generator().manual_seed(6))
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, target.config.vocab_size, (1, 11), generator=g)
    features = torch.randn(1, 11, target.config.hidden_size, generator=g)
    outs = [draft_forward(*serving_format.serving_files(h), h.embed_weight, target.lm_head.weight, tokens, features)
            for h in (moe, dense)]
    torch.testing.assert_close(outs[0][0], outs[1][0], atol=1e-5, rtol=1e-5)


def test_the_serving_format_reads_back_as_the_same_head(target, tmp_path):
    head = reduced_head(target, "jakiro", vocab=150)
    head.save(tmp_path / "head", format="serving")
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    assert config["architectures"] == [serving_format.ARCHITECTURE] and "num_experts" not in config
    assert "bias" not in config and config["jakiro"]["num_experts"] == head.config.num_experts
    loaded = DraftHead.load(tmp_path / "head", target)
    assert loaded.config == head.config
    for name, value in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    ids = prompt(12, seed=6)
    ours = speculative_generate(target, head, ids, 16, method="jakiro", tree=TREES["dynamic-small"])
    theirs = speculative_generate(target, loaded, ids, 16, method="jakiro", tree=TREES["dynamic-small"])
    assert theirs.token_ids == ours.token_ids and theirs.stats.accept_lengths == ours.stats.accept_lengths
    config["jakiro"]["format_version"] = 99
    (tmp_path / "head" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"format_version\": 1"):
        DraftHead.load(tmp_path / "head", target)


class StackedParameter(nn.Parameter):
    """An engine's stacked parameter: rows [q | k | v] (or [gate | up]) loaded shard by shard."""

    def __new__(cls, shards):
        cols = shards.pop("_cols")
        p = super().__new__(cls, torch.zeros(sum(shards.values()), cols))
        p.offsets, start = {}, 0
        for shard, rows in shards.items():
            p.offsets[shard], start = (start, rows), start + rows
        return p

    def weight_loader(self, param, tensor, shard):
        start, rows = self.offsets[shard]
        assert tensor.shape == (rows, param.shape[1])
        param.data[start: start + rows].copy_(tensor)


def engine_shaped_model(head):
    """A module with an engine's parameter names and stacking for ``head`` (what the plugins'
    classes hold): model.fc, model.layers.0.{self_attn.qkv_proj, o_proj, norms, mlp}, and the
    shared embedding."""
    c = head.config
    H, q, kv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    root = nn.Module()
    root.model = nn.Module()
    root.model.embed_tokens = nn.Embedding(c.vocab_size, H)  # the target's: not loaded
    root.model.fc = nn.Linear(2 * H, H)
    layer = nn.Module()
    layer.self_attn = nn.Module()
    layer.self_attn.qkv_proj = nn.Module()
    layer.self_attn.qkv_proj.weight = StackedParameter({"q": q, "k": kv, "v": kv, "_cols": H})
    layer.self_attn.o_proj = nn.Linear(q, H, bias=False)
    layer.post_attention_layernorm = nn.Module()
    layer.post_attention_layernorm.weight = nn.Parameter(torch.zeros(H))
    if c.num_experts:
        layer.mlp = JakiroMoE(H, c.intermediate_size, c.num_experts, c.renormalize)
    else:
        layer.mlp = nn.Module()
        layer.mlp.gate_up_proj = nn.Module()
        layer.mlp.gate_up_proj.weight = StackedParameter({0: c.intermediate_size, 1: c.intermediate_size, "_cols": H})
        layer.mlp.down_proj = nn.Linear(c.intermediate_size, H, bias=False)
    root.model.layers = nn.ModuleList([layer])
    return root


def copy_loader(param, tensor):
    assert param.shape == tensor.shape
    param.data.copy_(tensor)


@pytest.mark.parametrize("kind", ["jakiro", "eagle2"])
def test_the_plugins_weight_mapping_loads_every_parameter(target, kind):
    head = reduced_head(target, kind, vocab=100)
    _, state = serving_format.serving_files(head)
    model = engine_shaped_model(head)
    draft_to_target = load_serving_weights(model, state.items(), copy_loader)
    assert torch.equal(draft_to_target, head.draft_to_target)
    layer = model.model.layers[0]
    assert torch.equal(layer.self_attn.qkv_proj.weight,
                       torch.cat([head.q_proj.weight, head.k_proj.weight, head.v_proj.weight]))
    assert torch.equal(model.model.fc.bias, head.fc.bias)
    if kind == "jakiro":
        assert torch.equal(layer.mlp.w_down, head.w_down)
    else:
        assert torch.equal(layer.mlp.gate_up_proj.weight, torch.cat([head.gate_proj.weight, head.up_proj.weight]))
    with pytest.raises(ValueError, match=r"leave parameters of Module unloaded: \['model.fc.bias'\]"):
        load_serving_weights(engine_shaped_model(head), [(k, v) for k, v in state.items() if k != "fc.bias"],
                             copy_loader)
    with pytest.raises(ValueError, match=r"unloaded: \['model.layers.0.self_attn.qkv_proj.weight \(shard k\)'\]"):
        load_serving_weights(engine_shaped_model(head), [(k, v) for k, v in state.items() if "k_proj" not in k],
                             copy_loader)
    with pytest.raises(ValueError, match=r"'layers.0.input_layernorm.weight' has no parameter"):
        load_serving_weights(engine_shaped_model(head), [*state.items(), ("layers.0.input_layernorm.weight",
                                                                          torch.ones(4))], copy_loader)


@pytest.mark.parametrize("kind", ["jakiro", "eagle2"])
def test_the_plugins_set_up_and_load_a_draft(target, kind):
    # What both engines' classes do with their EAGLE draft: the MLP replaced by the MoE block (a
    # MoE head), the weights loaded, the tokens outside the draft vocabulary blocked.
    head = reduced_head(target, kind, vocab=100)
    config, state = serving_format.serving_files(head)
    model = engine_shaped_model(head)
    dense_mlp = model.model.layers[0].mlp
    model.config = types.SimpleNamespace(**config)
    assert set_up_draft(model, model.config, model.model.layers, torch.float32) == (kind == "jakiro")
    layer = model.model.layers[0]
    if kind == "jakiro":
        assert isinstance(layer.mlp, JakiroMoE) and layer.mlp is not dense_mlp
    else:
        assert layer.mlp is dense_mlp
    assert not model.blocked.any()
    assert load_draft_weights(model, state.items(), copy_loader)
    assert torch.equal(model.blocked, blocked_tokens(head.draft_to_target, head.config.vocab_size))
    if kind == "jakiro":
        assert torch.equal(layer.mlp.w_down, head.w_down)


def test_blocked_tokens():
    blocked = blocked_tokens(torch.tensor([3, 0]), 5)
    assert blocked.tolist() == [False, True, True, False, True]
    assert masked_logits(torch.zeros(2, 5), torch.tensor([3, 0]))[1].tolist() == [0, float("-inf"), float("-inf"), 0,
                                                                                     float("-inf")]
    with pytest.raises(ValueError, match=r"outside \[0, 5\)"):
        blocked_tokens(torch.tensor([5]), 5)


def fake_vllm(monkeypatch, forward_params=("input_ids", "positions", "hidden_states", "inputs_embeds")):
    """A fake vLLM with the hooks the plugin checks (``forward_params``: its EAGLE forward's)."""
    registered = []
    calls = {"vllm": types.ModuleType("vllm")}
    calls["vllm"].ModelRegistry = types.SimpleNamespace(register_model=lambda arch, cls: registered.append((arch, cls)))

    def module(name, **attrs):
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        calls[name] = m

    eagle = type("EagleLlamaForCausalLM", (), {
        "__init__": lambda self, *, vllm_config, prefix="": None,
        "forward": eval(f"lambda self, {', '.join(forward_params)}: None"),
        "compute_logits": lambda self, hidden_states: None})
    layer = type("LlamaDecoderLayer", (), {"forward": lambda self, positions, hidden_states, residual: None})
    linear = type("ReplicatedLinear", (), {
        "__init__": lambda self, input_size, output_size, bias=True, skip_bias_add=False, params_dtype=None,
        quant_config=None, prefix="", *, return_bias=True: None})
    module("vllm.model_executor.models.llama_eagle", EagleLlamaForCausalLM=eagle)
    module("vllm.model_executor.models.llama", LlamaDecoderLayer=layer)
    module("vllm.model_executor.layers.linear", ReplicatedLinear=linear)
    module("vllm.model_executor.model_loader.weight_utils", default_weight_loader=lambda param, loaded_weight: None)
    module("vllm.model_executor.models.utils", maybe_prefix=lambda prefix, name: name)
    for name, m in calls.items():
        monkeypatch.setitem(sys.modules, name, m)
    return registered


def test_the_vllm_plugin_registers_the_serving_architecture(monkeypatch):
    registered = fake_vllm(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every hook there: no warning
        plugins.register_vllm()
    assert registered == [(serving_format.ARCHITECTURE, plugins.VLLM_CLASS)]
    plugins.require("vllm")


def test_the_vllm_plugin_names_a_missing_hook(monkeypatch):
    registered = fake_vllm(monkeypatch, forward_params=("input_ids", "positions", "hidden_states"))
    with pytest.warns(RuntimeWarning, match=r"EagleLlamaForCausalLM.forward without the parameters \['inputs_embeds'\].*"
                                            r"Supported: vllm 0.32.0"):
        plugins.register_vllm()
    assert registered  # still registered: loading a serving-format head raises the same message
    with pytest.raises(RuntimeError, match=r"does not fit vllm .*inputs_embeds"):
        plugins.require("vllm")
    monkeypatch.delitem(sys.modules, "vllm.model_executor.models.llama_eagle")
    monkeypatch.setitem(sys.modules, "vllm.model_executor.models.llama_eagle", None)  # gone in this version
    assert any("llama_eagle:EagleLlamaForCausalLM (ModuleNotFoundError" in m for m in plugins.missing_hooks("vllm"))


def test_the_sglang_plugin_without_sglang_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", None)
    with pytest.warns(RuntimeWarning, match=r"sglang.srt.models.registry:ModelRegistry \(ModuleNotFoundError"):
        plugins.register_sglang()  # warns; registers nothing (no registry)
