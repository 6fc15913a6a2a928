"""Released draft heads in, serving-engine formats out (issue 16): checkpoints written here in
the exact layout their authors' code saves (names, shapes, dtypes, config keys), loaded with
DraftHead.load (the format recognised from the config and the keys), and decoded losslessly;
a checkpoint that does not match its target or its declared format is a clear error."""
import json

import pytest
import torch
from safetensors.torch import save_file

from jakiro_ext.engine import TreeConfig, speculative_generate
from jakiro_ext.models.draft_head import DraftHead
from test_generate import copy_head, prompt, tiny_target

TREE = TreeConfig(12, 3, 4)


@pytest.fixture(scope="module")
def target():
    return tiny_target()


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


def test_released_fp16_heads_load_with_format_forced(target, tmp_path):
    head = full_vocabulary_head(target, "jakiro")
    path = write_released(tmp_path / "head", head, target, "bin", torch.float16)
    loaded = DraftHead.load(path, target, format="jakiro")
    ids = prompt(9, seed=5)
    assert (speculative_generate(target, loaded, ids, 20, method="jakiro", tree=TREE).token_ids
            == speculative_generate(target, None, ids, 20).token_ids)
    with pytest.raises(ValueError, match=r"a eagle head needs the tensor 'layers.0.mlp.gate_proj.weight', which is missing"):
        DraftHead.load(path, target, format="eagle")
    with pytest.raises(ValueError, match=r"format must be one of \('jakiro_ext', 'eagle', 'jakiro'\), got 'medusa'"):
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
         r"tensors a eagle head does not have: \['layers.1.mlp.gate_proj.weight'\]"),
        (variant("bias", lambda s: s.update({"layers.0.self_attn.q_proj.bias": torch.zeros(64)})),
         r"layers.0.self_attn.q_proj.bias: attention biases are not supported"),
        (variant("shape", lambda s: s.update({"layers.0.mlp.down_proj.weight": torch.zeros(64, 10)})),
         r"down_proj.weight has shape \[64, 10\], expected \[64, 96\]"),
        (variant("eagle3", lambda s: s.update({"midlayer.hidden_norm.weight": torch.ones(64)})),
         r"an EAGLE-3 head \(midlayer\.\*\).*not implemented yet"),
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
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 1
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
    with pytest.raises(ValueError, match=r"the eagle format holds dense heads: a Jakiro \(MoE\) head"):
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
