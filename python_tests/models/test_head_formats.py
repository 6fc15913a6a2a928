"""Released draft heads in, serving-engine formats out (issue 16): checkpoints written here in
the exact layout their authors' code saves (names, shapes, dtypes, config keys), loaded with
DraftHead.load (the format recognised from the config and the keys), and decoded losslessly;
a checkpoint that does not match its target or its declared format is a clear error."""
import json

import pytest
import torch
from safetensors.torch import save_file

from jakiro_ext.config import TreeConfig
from jakiro_ext.engine.generate import speculative_generate
from jakiro_ext.models.heads.draft_head import DraftHead
from jakiro_ext.models.heads.head import Head
from helpers import copy_head, eagle3_reference, prompt, random_head, six_layer_target, tiny_target, write_eagle3

TREE = TreeConfig(12, 3, 4)



def llama_config(head, **extra) -> dict:
    """config.json as the released EAGLE / Jakiro heads carry it: a one-layer Llama config."""
    c = head.config
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "num_hidden_layers": 1,
            "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "rope_scaling": None,
            "vocab_size": c.vocab_size, "max_position_embeddings": 2048, "torch_dtype": "float16", **extra}


def released_state(head, target) -> dict:
    """The head's weights under the names EAGLE's / Jakiro's ``Model`` modules give them, with the
    tensors those modules hold and the released code does not use (embed_tokens, layer 0's
    input_layernorm)."""
    mine = head.state_dict()
    state = {"embed_tokens.weight": target.embed_tokens.weight.detach().clone(),
             "fc.weight": mine["fc.weight"], "fc.bias": mine["fc.bias"],
             "layers.0.input_layernorm.weight": torch.ones(head.config.hidden_size),
             "layers.0.post_attention_layernorm.weight": mine["post_attention_layernorm.weight"]}
    for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
        state[f"layers.0.self_attn.{n}.weight"] = mine[f"{n}.weight"]
    if head.config.num_experts:
        state["layers.0.mlp_moe.gate.weight"] = mine["router"]
        for i in range(head.config.num_experts):
            for n, ours in (("gate_proj", "w_gate"), ("up_proj", "w_up"), ("down_proj", "w_down")):
                state[f"layers.0.mlp_moe.experts.{i}.{n}.weight"] = mine[ours][i]
    else:
        for n in ("gate_proj", "up_proj", "down_proj"):
            state[f"layers.0.mlp.{n}.weight"] = mine[f"{n}.weight"]
    return {k: v.detach().clone() for k, v in state.items()}


def write_released(path, head, target, weights="safetensors", dtype=torch.float32, **config_extra):
    path.mkdir(parents=True, exist_ok=True)
    extra = dict(num_local_experts=head.config.num_experts, num_experts_per_tok=2) if head.config.num_experts else {}
    (path / "config.json").write_text(json.dumps(llama_config(head, **{**extra, **config_extra})))
    state = {k: v.to(dtype) for k, v in released_state(head, target).items()}
    if weights == "safetensors":
        save_file(state, str(path / "model.safetensors"))
    else:
        torch.save(state, str(path / "pytorch_model.bin"))
    return path


def full_vocabulary_head(target, kind):
    """A head whose drafts are accepted, drafting over the whole vocabulary (as released heads do)."""
    head = copy_head(target, kind)
    assert not head.config.draft_vocab_size
    return head


@pytest.mark.parametrize("kind", ["eagle2", "jakiro"])
@pytest.mark.parametrize("weights", ["safetensors", "bin"])
def test_released_heads_load_and_decode_as_the_head_they_hold(target, tmp_path, kind, weights):
    head = full_vocabulary_head(target, kind)
    path = write_released(tmp_path / "head", head, target, weights)
    loaded = DraftHead.load(path, target)
    assert loaded.config.num_experts == head.config.num_experts
    ids = prompt(15, seed=4)
    plain = speculative_generate(target, None, ids, 24)
    for method in (["eagle2"] if kind == "eagle2" else ["jakiro", "jakiro_star"]):
        ours = speculative_generate(target, head, ids, 24, method=method, tree=TREE)
        theirs = speculative_generate(target, loaded, ids, 24, method=method, tree=TREE)
        assert theirs.token_ids == plain.token_ids  # lossless
        assert theirs.stats.accept_lengths == ours.stats.accept_lengths  # and the same drafts
        assert sum(theirs.stats.accept_lengths) > 0


def every_weight_matters(target, kind, seed=7):
    """A random head whose every tensor changes its output (norms away from 1, no zeroed
    projection as in copy heads), drafting over the whole vocabulary as released heads do."""
    head = random_head(target, kind, seed=seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(seed))
    return head


def draft_outputs(head, target, seed=3):
    """The head's feature, residual and (MoE) experts' outputs for one 6-row chain."""
    from jakiro_ext.ops.masks import causal_tree_mask

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, target.config.vocab_size, (1, 6), generator=g)
    features = torch.randn(1, 6, target.config.hidden_size, generator=g)
    step = head(tokens, features, torch.arange(6)[None], head.new_cache(8), causal_tree_mask(1, 6))
    return [t for t in (step.feature, step.residual, step.expert_out, step.expert_score, step.contrast_weight)
            if t is not None]


@pytest.mark.parametrize("kind", ["eagle2", "jakiro"])
@pytest.mark.parametrize("weights", ["safetensors", "bin"])
def test_released_heads_load_every_tensor_into_its_place(target, tmp_path, kind, weights):
    """Tensor by tensor against the head written, and the same draft outputs: a loader that swaps
    gate and up, scales a projection, flips experts or router rows, or drops a norm fails here
    (copy heads, whose o_proj and down projections are zero, hide all of these)."""
    head = every_weight_matters(target, kind)
    loaded = DraftHead.load(write_released(tmp_path / "head", head, target, weights), target)
    mine = head.state_dict()
    assert set(loaded.state_dict()) == set(mine)
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, mine[name]), name
    with torch.no_grad():
        for a, b in zip(draft_outputs(head, target), draft_outputs(loaded, target)):
            assert torch.equal(a, b)


def released_gumiho_state(head, target) -> dict:
    """A Gumiho head under the names of the released ``Model`` (cnets.py): layers.{i} with every
    layer's input_layernorm (layer 0's unused), and ParallelMLPs' ``mlp.mlp.{j}.{b}.linear``."""
    mine, c = head.state_dict(), head.config
    state = {"embed_tokens.weight": target.embed_tokens.weight.detach().clone(),
             "fc.weight": mine["fc.weight"], "fc.bias": mine["fc.bias"],
             "layers.0.input_layernorm.weight": torch.ones(c.hidden_size),
             "layers.0.post_attention_layernorm.weight": mine["post_attention_layernorm.weight"]}
    for i in range(c.num_layers):
        prefix = "" if i == 0 else f"layers.{i - 1}."
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            state[f"layers.{i}.self_attn.{n}.weight"] = mine[f"{prefix}{n}.weight"]
        for n in ("gate_proj", "up_proj", "down_proj"):
            state[f"layers.{i}.mlp.{n}.weight"] = mine[f"{prefix}{n}.weight"]
        if i:
            for n in ("input_layernorm", "post_attention_layernorm"):
                state[f"layers.{i}.{n}.weight"] = mine[f"{prefix}{n}.weight"]
    for j in range(c.num_mlp_heads):
        state[f"mlp.mlp.{j}.0.linear.weight"] = mine["mlp_in_weight"][j]
        state[f"mlp.mlp.{j}.0.linear.bias"] = mine["mlp_in_bias"][j]
        for b in range(c.mlp_blocks):
            state[f"mlp.mlp.{j}.{b + 1}.linear.weight"] = mine["mlp_block_weight"][j, b]
            state[f"mlp.mlp.{j}.{b + 1}.linear.bias"] = mine["mlp_block_bias"][j, b]
    return {k: v.detach().clone() for k, v in state.items()}


def test_released_gumiho_heads_load_and_decode_as_the_head_they_hold(target, tmp_path):
    head = full_vocabulary_head(target, "gumiho")
    with torch.no_grad():  # (blocks that do something: zero at init)
        head.mlp_block_weight.normal_(0, 0.05, generator=torch.Generator().manual_seed(3))
    path = tmp_path / "gumiho"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(llama_config(head, num_hidden_layers=2)))
    torch.save({k: v.half() for k, v in released_gumiho_state(head, target).items()}, str(path / "pytorch_model.bin"))
    loaded = DraftHead.load(path, target)
    c = loaded.config
    assert (c.kind, c.num_layers, c.num_mlp_heads, c.mlp_blocks) == ("gumiho", 2, 2, 5)
    for name, tensor in head.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor.half().float(), msg=name)
    ids = prompt(15, seed=4)
    ours = speculative_generate(target, head.half().float().bind(target), ids, 24, method="gumiho", tree=TREE)
    theirs = speculative_generate(target, loaded, ids, 24, method="gumiho", tree=TREE)
    assert theirs.token_ids == speculative_generate(target, None, ids, 24).token_ids
    assert theirs.stats.accept_lengths == ours.stats.accept_lengths and max(theirs.stats.accept_lengths) >= 3
    # A missing block is an error naming it.
    state = released_gumiho_state(head, target)
    state.pop("mlp.mlp.1.3.linear.bias")
    torch.save(state, str(path / "pytorch_model.bin"))
    with pytest.raises(ValueError, match=r"a gumiho head needs the tensor 'mlp.mlp.1.3.linear.bias', which is missing"):
        DraftHead.load(path, target)


def test_released_fp16_heads_load_with_format_forced(target, tmp_path):
    head = full_vocabulary_head(target, "jakiro")
    path = write_released(tmp_path / "head", head, target, "bin", torch.float16)
    loaded = DraftHead.load(path, target, format="jakiro")
    ids = prompt(9, seed=5)
    assert (speculative_generate(target, loaded, ids, 20, method="jakiro", tree=TREE).token_ids
            == speculative_generate(target, None, ids, 20).token_ids)
    with pytest.raises(ValueError, match=r"an eagle head needs the tensor 'layers.0.mlp.gate_proj.weight', which is missing"):
        DraftHead.load(path, target, format="eagle")
    with pytest.raises(ValueError, match=r"format must be one of \('jakiro_ext', 'eagle', 'jakiro', 'gumiho', 'eagle3', 'serving'\), got 'medusa'"):
        DraftHead.load(path, target, format="medusa")


def test_released_heads_that_do_not_fit_are_clear_errors(target, tmp_path):
    head = full_vocabulary_head(target, "eagle2")

    def variant(name, change_state=None, **config_extra):
        path = write_released(tmp_path / name, head, target, **config_extra)
        if change_state:
            from safetensors.torch import load_file
            state = load_file(str(path / "model.safetensors"))
            change_state(state)
            save_file(state, str(path / "model.safetensors"))
        return path

    cases = [
        (variant("hidden", hidden_size=96), r"does not fit|hidden_size 96"),
        (variant("vocab", vocab_size=500), r"made for a target with vocab_size 500, but this target has vocab_size 211"),
        (variant("rope", rope_scaling={"rope_type": "dynamic", "factor": 2.0}), r"rope_scaling .* not supported"),
        (variant("act", hidden_act="gelu"), r"hidden_act must be 'silu'"),
        (variant("missing", lambda s: s.pop("layers.0.self_attn.k_proj.weight")),
         r"needs the tensor 'layers.0.self_attn.k_proj.weight', which is missing"),
        (variant("extra", lambda s: s.update({"layers.1.mlp.gate_proj.weight": torch.zeros(2, 2)})),
         r"tensors an eagle head does not have: \['layers.1.mlp.gate_proj.weight'\]"),
        (variant("bias", lambda s: s.update({"layers.0.self_attn.q_proj.bias": torch.zeros(64)})),
         r"layers.0.self_attn.q_proj.bias: attention biases are not supported"),
        (variant("shape", lambda s: s.update({"layers.0.mlp.down_proj.weight": torch.zeros(64, 10)})),
         r"down_proj.weight has shape \[64, 10\], expected \[64, 96\]"),
        (variant("eagle3", lambda s: s.update({"midlayer.hidden_norm.weight": torch.ones(64)})),
         r"an eagle3 head needs the tensor 'lm_head.weight', which is missing"),
    ]
    for path, message in cases:
        with pytest.raises(ValueError, match=message):
            DraftHead.load(path, target)
    moe = full_vocabulary_head(target, "jakiro")
    path = write_released(tmp_path / "experts", moe, target, num_local_experts=3)
    with pytest.raises(ValueError, match=r"has 6 rows: N \+ 2 for N = 4 experts, but config.json says num_local_experts 3"):
        DraftHead.load(path, target)
    (tmp_path / "nothing").mkdir()
    (tmp_path / "nothing" / "config.json").write_text(json.dumps(llama_config(head)))
    with pytest.raises(FileNotFoundError, match=r"no weights in .*nothing: expected model.safetensors or pytorch_model.bin"):
        DraftHead.load(tmp_path / "nothing", target)


def test_dense_heads_export_to_the_eagle_format_and_read_back(target, tmp_path):
    head = full_vocabulary_head(target, "eagle2")
    head.save(tmp_path / "eagle", format="eagle")
    config = json.loads((tmp_path / "eagle" / "config.json").read_text())
    # Each engine takes the first architecture it knows (vLLM's EAGLE class, SGLang's); no "bias"
    # key, which would give vLLM attention biases that nothing loads.
    assert config["architectures"] == ["EagleLlamaForCausalLM", "LlamaForCausalLMEagle"]
    assert config["num_hidden_layers"] == 1 and "bias" not in config and config["attention_bias"] is False
    from safetensors.torch import load_file
    assert set(load_file(str(tmp_path / "eagle" / "model.safetensors"))) == {
        "fc.weight", "fc.bias", "layers.0.post_attention_layernorm.weight",
        *(f"layers.0.self_attn.{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj")),
        *(f"layers.0.mlp.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj"))}
    loaded = DraftHead.load(tmp_path / "eagle", target)
    ids = prompt(12, seed=6)
    ours = speculative_generate(target, head, ids, 24, method="eagle2", tree=TREE)
    theirs = speculative_generate(target, loaded, ids, 24, method="eagle2", tree=TREE)
    assert theirs.token_ids == ours.token_ids and theirs.stats.accept_lengths == ours.stats.accept_lengths
    with pytest.raises(ValueError, match=r"the eagle format holds dense heads: save a Jakiro \(MoE\) head with format='serving'"):
        copy_head(target, "jakiro").save(tmp_path / "moe", format="eagle")
    reduced = DraftHead(head.config.__class__(**{**head.config.__dict__, "draft_vocab_size": 50}))
    reduced.init_weights(0).set_draft_vocab(torch.arange(50) * 4)
    with pytest.raises(ValueError, match=r"drafts over 50 of the target's tokens.*full_vocabulary=True"):
        reduced.save(tmp_path / "reduced", format="eagle")
    reduced.save(tmp_path / "reduced", format="eagle", full_vocabulary=True)
    assert DraftHead.load(tmp_path / "reduced", target).config.draft_vocab_size == 0


def test_a_transformers_model_is_a_target(tmp_path):
    # speculative_generate and DraftHead.load take the transformers model itself: converted once
    # (cached while the model lives), its heads bound to that conversion.
    import transformers

    from jakiro_ext.models.llama import LlamaModel, as_target

    torch.manual_seed(3)
    cfg = transformers.LlamaConfig(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    converted = as_target(hf)
    assert isinstance(converted, LlamaModel) and as_target(hf) is converted and as_target(converted) is converted
    assert converted.config.name == ""  # a model made in memory has no name
    head = full_vocabulary_head(converted, "eagle2")
    write_released(tmp_path / "head", head, converted)
    loaded = DraftHead.load(tmp_path / "head", hf)
    ids = prompt(10, seed=7)
    out = speculative_generate(hf, loaded, ids, 16, method="eagle2", tree=TREE)
    with torch.no_grad():
        greedy = hf.generate(ids.unsqueeze(0), attention_mask=torch.ones(1, ids.numel(), dtype=torch.int64),
                             max_new_tokens=16, do_sample=False, pad_token_id=0)[0, ids.numel():].tolist()
    assert out.token_ids == greedy  # transformers' own greedy decoding of the same model
    assert out.token_ids == speculative_generate(converted, None, ids, 16).token_ids
    with pytest.raises(TypeError, match=r"target must be a LlamaModel or a transformers \*ForCausalLM .* got Linear"):
        speculative_generate(torch.nn.Linear(2, 2), None, ids, 4)


# ----------------------------------------------------------------------------- EAGLE-3
def test_eagle3_heads_load_read_three_target_layers_and_decode_losslessly(tmp_path):
    from jakiro_ext.models.heads.eagle3 import Eagle3Head
    from jakiro_ext.models.llama import as_target

    hf = six_layer_target()
    target = as_target(hf)
    ids = prompt(14, seed=8)
    # The target's three layers: the residual streams entering layers 2, 3, 3 (transformers'
    # hidden_states[i] is the input of layer i).
    _, aux = target(ids.unsqueeze(0), target.new_cache(1, 16), feature_layers=(2, 3, 3))
    with torch.no_grad():
        streams = hf(ids.unsqueeze(0), output_hidden_states=True).hidden_states
    torch.testing.assert_close(aux[0], torch.cat([streams[2][0], streams[3][0], streams[3][0]], -1), atol=1e-5, rtol=1e-5)
    state = write_eagle3(tmp_path / "e3")
    head = DraftHead.load(tmp_path / "e3", hf)  # (the transformers model itself as the target)
    assert isinstance(head, Eagle3Head) and head.feature_layers == (2, 3, 3)
    # Beside DraftHead, not a kind of it: both are the engine's Head.
    assert isinstance(head, Head) and not isinstance(head, DraftHead) and isinstance(random_head(target, "eagle2"), Head)
    assert isinstance(Eagle3Head.load(tmp_path / "e3", target), Eagle3Head)
    # The head over the prompt = EAGLE-3's layer computed from the checkpoint's own tensors.
    n = ids.numel() - 1
    cache = head.new_cache(n + 1)
    from jakiro_ext.ops.masks import causal_tree_mask
    step = head(ids[1:].unsqueeze(0), aux[:, :n], torch.arange(n).unsqueeze(0), cache, causal_tree_mask(1, n))
    out, logits = eagle3_reference(state, target.embed_tokens.weight.detach(), ids[1:], aux[0, :n])
    torch.testing.assert_close(step.feature[0], out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(step.for_lm_head[0] @ head.lm_head_weight.T, logits, atol=1e-4, rtol=1e-4)
    assert torch.equal(head.target_ids(torch.arange(5)), torch.arange(0, 15, 3))  # d + d2t[d]
    plain = speculative_generate(target, None, ids, 20).token_ids
    for tree in (TREE, TreeConfig(choices=[[0], [1], [0, 0], [0, 1]])):
        out = speculative_generate(hf, head, ids, 20, tree=tree)
        assert out.token_ids == plain and out.stats.draft_forwards > 0
    # Written back in the same format (what vLLM / SGLang load for "eagle3"), read back the same.
    head.save(tmp_path / "again")
    again = DraftHead.load(tmp_path / "again", target)
    config = json.loads((tmp_path / "again" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 71
    for name, value in head.state_dict().items():
        assert torch.equal(again.state_dict()[name], value), name
    with pytest.raises(ValueError, match=r"the eagle3 format holds EAGLE-3 heads"):
        copy_head(tiny_target(), "eagle2").save(tmp_path / "no", format="eagle3")


def test_eagle3_tree_drafts_are_the_layers_top_candidates(tmp_path):
    """The tree an EAGLE-3 head drafts, against its layer in plain PyTorch: the depth-1 nodes are
    the top-k of the prompt's last row, and every depth-2 node is among the top-k of the layer
    run on its parent's token with the parent row's own output as the hidden state (the decode
    test above accepts nothing, so it cannot see the drafts)."""
    from jakiro_ext.methods import METHODS
    from jakiro_ext.engine.drafter import Drafter
    from jakiro_ext.models.llama import as_target

    hf = six_layer_target()
    target = as_target(hf)
    state = write_eagle3(tmp_path / "e3", layers=[2, 3, 5], seed=4)
    head = DraftHead.load(tmp_path / "e3", hf)
    ids, k = prompt(12, seed=9), 3
    n = ids.numel()
    _, aux = target(ids.unsqueeze(0), target.new_cache(1, 16), feature_layers=head.feature_layers)
    drafter = Drafter(head, METHODS["eagle2"], TreeConfig(1 + k + k * k, 2, k))
    tree = drafter.draft(ids[-1:], *drafter.prefill(ids[1:], aux[0, :-1]))
    embed = target.embed_tokens.weight.detach()
    to_target = lambda d: d + state["d2t"][d]  # noqa: E731
    out, logits = eagle3_reference(state, embed, ids[1:], aux[0, :n - 1])
    tokens, parents, depths = tree.tokens[0].tolist(), tree.parents[0].tolist(), tree.depths[0].tolist()
    first = [i for i, d in enumerate(depths) if d == 1]
    assert [tokens[i] for i in first] == to_target(logits[-1].topk(k).indices).tolist()
    second = [i for i, d in enumerate(depths) if d == 2]
    assert len(second) == k * k
    for i in second:
        parent = tokens[parents[i]]
        _, child_logits = eagle3_reference(state, embed, torch.cat([ids[1:], torch.tensor([parent])]), aux[0, :n - 1],
                                           own=out[-1:])
        assert tokens[i] in to_target(child_logits[-1].topk(k).indices).tolist(), (i, parent)


def test_eagle3_heads_that_do_not_fit_are_clear_errors(tmp_path):
    hf = six_layer_target()
    write_eagle3(tmp_path / "layers", layers=[2, 3, 9])
    with pytest.raises(ValueError, match=r"entering three of the target's 6 layers \(0..6, 6: after the last\), got "
                                         r"feature layers \[2, 3, 9\]"):
        DraftHead.load(tmp_path / "layers", hf)
    write_eagle3(tmp_path / "d2t", draft_ids=torch.tensor([0, 5, 300]))
    with pytest.raises(ValueError, match=r"d2t maps draft tokens outside the target's vocabulary \[0, 211\)"):
        DraftHead.load(tmp_path / "d2t", hf)
    write_eagle3(tmp_path / "shallow")  # default layers 2, 1, -1 of a 2-layer target
    with pytest.raises(ValueError, match=r"entering three of the target's 2 layers"):
        DraftHead.load(tmp_path / "shallow", tiny_target())


@pytest.mark.parametrize("name,dtype", [("fc.weight", torch.int32), ("fc.weight", torch.bool),
                                        ("draft_to_target", torch.float32)])
def test_a_tensor_of_the_wrong_kind_of_dtype_is_refused_naming_it(target, tmp_path, name, dtype):
    # A head's weights are floating point and its draft vocabulary integers: an int32 weight (or a
    # float vocabulary) is refused by name, never converted silently.
    from safetensors.torch import load_file
    from dataclasses import replace
    head = DraftHead(replace(random_head(target, "jakiro").config, draft_vocab_size=100)).init_weights(1)
    head.set_draft_vocab(torch.arange(100) * 2)
    head.save(tmp_path / "head")
    assert DraftHead.load(tmp_path / "head", target).config.draft_vocab_size == 100  # (whole, it loads)
    state = load_file(str(tmp_path / "head" / "model.safetensors"))
    state[name] = state[name].to(dtype)
    save_file(state, str(tmp_path / "head" / "model.safetensors"))
    kind = "an integer" if name == "draft_to_target" else "a floating-point"
    with pytest.raises(ValueError, match=rf"{name} has dtype {dtype}, expected {kind} tensor"):
        DraftHead.load(tmp_path / "head", target)
