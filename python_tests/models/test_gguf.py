"""A GGUF file as the target, its blocks as they are (jakiro_ext.models.gguf): the default model's
Q4_1 file read into packed weights equal to transformers' dequantization of the same file, in
about the file's size of memory; speculation on it gives exactly its plain decoding's tokens at
temperature 0 and its distribution above (lossless relative to the quantized model)."""
import pytest
import torch

from helpers import (SAMPLED, chi_square_p, copy_head, exact_distribution, power_at_shift, tiny_target,
                     verified_token_p)
from jakiro_ext.config import TreeConfig
from jakiro_ext.engine.generate import speculative_generate
from jakiro_ext.models.default import DEFAULT_MODEL, default_model_dir, gguf_path, load_default_target
from jakiro_ext.models.gguf import load_gguf
from jakiro_ext.models.weights import weight_format
from jakiro_ext.ops import quantized


@pytest.fixture(scope="module")
def gguf_target():
    return load_default_target("gguf")


def test_the_files_blocks_are_transformers_dequantization(gguf_target):
    from safetensors.torch import load_file

    model, _ = gguf_target
    assert weight_format(model) == "Q4_1-Q8_0" and model.config.name == DEFAULT_MODEL
    dense = LlamaModelOf(load_file(str(default_model_dir() / "model.safetensors")))
    for name, p in model.named_parameters():
        got = quantized.dequantize(p) if quantized.is_packed(p) else p
        assert torch.equal(got, dense(name)), name
    kept = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}  # (tied once)
    assert sum(kept.values()) <= 1.3 * gguf_path().stat().st_size  # (the embedding's rows are read, not kept)


def LlamaModelOf(state):
    """Our parameter names read from a transformers checkpoint's (q, k, v and gate, up fused)."""
    def weight(name):
        if name in ("lm_head.weight", "embed_tokens.weight"):
            return state["model.embed_tokens.weight"]
        if name == "norm.weight":
            return state["model.norm.weight"]
        _, i, local = name.split(".", 2)
        p = f"model.layers.{i}."
        parts = {"self_attn.qkv_proj.weight": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
                 "gate_up_proj.weight": ["mlp.gate_proj", "mlp.up_proj"], "down_proj.weight": ["mlp.down_proj"],
                 "self_attn.o_proj.weight": ["self_attn.o_proj"]}.get(local)
        if parts is None:
            return state[p + local]
        return torch.cat([state[p + part + ".weight"] for part in parts])
    return weight


def test_dequantized_loads_and_bad_options():
    model = load_gguf(gguf_path(), "bfloat16")
    assert weight_format(model) == "bfloat16" and model.activation_dtype == torch.bfloat16
    assert model.config.name == "SmolLM2-135M-Instruct"  # the file's name up to its first dot
    with pytest.raises(ValueError, match=r"weights must be one of \('file', 'float32', 'bfloat16'\), got 'int4'"):
        load_gguf(gguf_path(), "int4")
    with pytest.raises(ValueError, match="dtype must be torch.float32, torch.bfloat16 or 'gguf', got 'q4'"):
        load_default_target("q4")


@pytest.mark.parametrize("method,kind,prompts,trees", [
    ("jakiro", "jakiro", 16, [TreeConfig(3, 1, 5), TreeConfig(8, 3, 2)]),
    ("eagle2", "eagle2", 4, [TreeConfig(8, 3, 2), TreeConfig(16, 4, 4)])])
def test_speculation_on_the_file_gives_its_plain_decodings_tokens(gguf_target, method, kind, prompts, trees):
    # Branching trees (siblings between a token and its ancestors) over the packaged prompts: a
    # token's attention in a tree must be its one-token step's bits, as the next layer quantizes
    # its row again (summed in another order, 7 of 48 such Jakiro runs once gave other tokens).
    from jakiro_ext.cli.bench import read_prompts
    from jakiro_ext.cli.common import PROMPTS_FILE, chat_ids, load_head

    model, tokenizer = gguf_target
    head = load_head(kind, None, model, DEFAULT_MODEL)
    accepted = []
    for row in read_prompts(PROMPTS_FILE, prompts):
        ids = chat_ids(tokenizer, row["prompt"], True)
        plain = speculative_generate(model, None, ids, 64, method="ar").token_ids
        for tree in trees:
            spec = speculative_generate(model, head, ids, 64, method=method, tree=tree)
            assert spec.token_ids == plain, (row["prompt"][:40], tree)
            accepted.append(max(spec.stats.accept_lengths))
    assert max(accepted) >= 3  # drafts were accepted: the trees ran


def test_a_head_drafts_from_the_files_own_lm_head_rows(gguf_target):
    # Its draft vocabulary's rows of the target's Q8_0 LM head, as they are (0.27x the bytes of
    # float32): what the draft's top-k reads; the float32 rows (training, scoring) are theirs.
    from jakiro_ext.cli.common import load_head

    model, _ = gguf_target
    head = load_head("jakiro", None, model, DEFAULT_MODEL)
    rows = head.products().lm_head
    assert rows is head.packed_lm_head and quantized.format_of(rows) == "Q8_0"
    assert torch.equal(quantized.unpack(rows), quantized.unpack(model.lm_head.weight)[head.draft_to_target])
    assert torch.equal(quantized.dequantize(rows), head.lm_head_weight)


SAMPLES = 4000


def test_sampling_on_packed_weights_follows_their_distribution():
    """The sampling test of the engine on a tiny target whose layers are Q8_0 blocks: the tokens'
    distribution is the packed model's (by enumeration)."""
    target = tiny_target(vocab=12, embed_std=0.03, seed=3)
    head = copy_head(target, "jakiro", scale=5.0)
    with torch.no_grad():
        for layer in target.layers:
            for module in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.gate_up_proj, layer.down_proj):
                module._parameters["weight"] = torch.nn.Parameter(
                    quantized.from_float(module.weight, "Q8_0"), requires_grad=False)
    ids = torch.tensor([3, 7, 7, 1, 7, 7])
    temperature, top_p, top_k = 0.8, 0.9, 6
    expected = exact_distribution(target, ids, temperature, top_p, top_k, SAMPLED)
    assert power_at_shift(tuple(expected.items()), SAMPLES) >= 0.95
    counts, accepted = {}, 0
    for seed in range(SAMPLES):
        out = speculative_generate(target, head, ids, SAMPLED, method="jakiro", tree=TreeConfig(8, 2, 3),
                                   temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        counts[tuple(out.token_ids)] = counts.get(tuple(out.token_ids), 0) + 1
        accepted += sum(out.stats.accept_lengths)
    assert 0.5 < accepted / SAMPLES < SAMPLED - 0.5
    assert verified_token_p(counts, expected, SAMPLES) > 1e-3
    assert chi_square_p(counts, expected, SAMPLES) > 1e-3
    # The negative control: the distribution without the top-p / top-k filter is rejected.
    unfiltered = exact_distribution(target, ids, temperature, 1.0, 0, SAMPLED)
    assert chi_square_p(counts, unfiltered, SAMPLES) < 1e-6
