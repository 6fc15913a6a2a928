"""The command line on the default model: generate (streamed and --json) and bench (--json),
with a Spec-Bench style prompt file."""
import json
import re

import pytest

from helpers import JAKIRO_PROFILE
from jakiro_ext.cli import main


def run_json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def random_head_dir(tmp_path_factory):
    import torch

    from jakiro_ext.models import load_default_target
    from jakiro_ext.models.heads.config import DraftConfig
    from jakiro_ext.models.heads.draft_head import DraftHead

    target, _ = load_default_target(torch.float32)
    path = tmp_path_factory.mktemp("heads") / "jakiro"
    DraftHead(DraftConfig.for_target(target.config, "jakiro", num_experts=4)).init_weights(seed=1).save(path)
    return str(path)


def test_generate_json_reports_tokens_and_stats(capsys, random_head_dir):
    common = ["generate", "Name a fruit.", "--max-new-tokens", "6", "--json"]
    ar = run_json(capsys, common + ["--method", "ar"])
    jakiro = run_json(capsys, common + ["--method", "jakiro", "--jakiro-head", random_head_dir])
    for out in (ar, jakiro):
        assert {"text", "token_ids", "new_tokens", "target_forwards", "tau", "tokens_per_s"} <= set(out)
        assert out["new_tokens"] == len(out["token_ids"]) and 1 <= out["new_tokens"] <= 6
        assert out["tau"] == pytest.approx(out["new_tokens"] / out["target_forwards"])
    assert jakiro["token_ids"] == ar["token_ids"] and jakiro["text"] == ar["text"]


def test_gumiho_generates_with_its_head_and_jakiro_gumiho_heads(capsys, tmp_path):
    import torch

    from jakiro_ext.models import load_default_target
    from jakiro_ext.models.heads.config import DraftConfig
    from jakiro_ext.models.heads.draft_head import DraftHead

    target, _ = load_default_target(torch.float32)
    dirs = {}
    for kind in ("gumiho", "jakiro_gumiho"):
        config = DraftConfig.for_target(target.config, kind, num_experts=4, intermediate_size=64, num_mlp_heads=2,
                                        mlp_blocks=1)
        DraftHead(config).init_weights(seed=2).save(tmp_path / kind)
        dirs[kind] = str(tmp_path / kind)
    common = ["generate", "Name a fruit.", "--max-new-tokens", "6", "--json"]
    ar = run_json(capsys, common + ["--method", "ar"])
    for kind in dirs:
        out = run_json(capsys, common + ["--method", "gumiho", "--gumiho-head", dirs[kind]])
        assert out["token_ids"] == ar["token_ids"], kind
    assert main(common + ["--method", "jakiro", "--jakiro-head", dirs["gumiho"]]) == 2
    assert "holds a gumiho head, but a jakiro head is needed" in capsys.readouterr().err


def test_generate_streams_text_then_stats(capsys, random_head_dir):
    assert main(["generate", "Say hello.", "--max-new-tokens", "5", "--jakiro-head", random_head_dir]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].startswith("[jakiro] ") and "tau" in out[-1] and "tokens/s" in out[-1]
    assert out[0]  # the streamed answer


def test_bench_json_runs_methods_side_by_side(capsys, tmp_path, random_head_dir):
    prompts = tmp_path / "questions.jsonl"
    prompts.write_text("\n".join(json.dumps(r) for r in [
        {"question_id": 1, "category": "qa", "turns": ["What is 2 + 2?", "And 3 + 3?"]},
        {"question_id": 2, "category": "writing", "prompt": "Write one word."},
        {"question_id": 3, "category": "qa", "turns": ["Not reached (--limit 2)."]}]) + "\n")
    out = run_json(capsys, ["bench", "--prompts", str(prompts), "--limit", "2", "--method", "ar", "--method", "jakiro",
                            "--max-new-tokens", "4", "--json", "--jakiro-head", random_head_dir])
    assert set(out["methods"]) == {"ar", "jakiro"}
    for m, s in out["methods"].items():
        assert {"tokens_per_s", "tau", "new_tokens", "speedup_vs_ar"} <= set(s)
        assert set(s["per_category"]) == {"qa", "writing"}
    assert out["methods"]["ar"]["speedup_vs_ar"] == pytest.approx(1.0)
    assert out["methods"]["jakiro"]["all_same_tokens_as_ar"] is True
    assert [p["id"] for p in out["per_prompt"]] == [1, 2]
    # --batch-size: the prompts decoded as one batch; every sequence compared with ar.
    batched = run_json(capsys, ["bench", "--prompts", str(prompts), "--method", "ar", "--method", "jakiro",
                                "--max-new-tokens", "4", "--json", "--jakiro-head", random_head_dir, "--batch-size", "3"])
    assert batched["config"]["batch_size"] == 3 and [p["id"] for p in batched["per_prompt"]] == [1, 2, 3]
    assert batched["methods"]["jakiro"]["all_same_tokens_as_ar"] is True
    assert batched["methods"]["ar"]["new_tokens"] == sum(p["methods"]["ar"]["new_tokens"] for p in batched["per_prompt"])
    assert main(["bench", "--prompts", str(prompts), "--method", "ar", "--batch-size", "0"]) == 2
    assert capsys.readouterr().err == "error: --batch-size must be in [1, 1024], got 0\n"


def test_bench_rejects_a_malformed_prompt_file(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "no prompt key"}\n')
    assert main(["bench", "--prompts", str(bad), "--method", "ar"]) == 2
    assert capsys.readouterr().err == (f"error: {bad}:1: expected a 'prompt' string or a non-empty 'turns' list of "
                                       f"strings, got ['question']\n")
    bad.write_text("\n")
    assert main(["bench", "--prompts", str(bad), "--method", "ar"]) == 2
    assert capsys.readouterr().err == f"error: {bad} holds no prompts\n"


def test_bad_options_are_clear_errors(capsys):
    assert main(["generate", "Hi", "--static-tree", "[[0], [1, 0]]", "--method", "eagle2"]) == 2
    assert "static tree choices must contain every node's parent" in capsys.readouterr().err
    assert main(["generate", "Hi", "--total-tokens", "0"]) == 2
    assert "dynamic tree needs total_tokens in [2, 1024]" in capsys.readouterr().err
    assert main(["demo", "--temperature", "0.5"]) == 2
    assert "demo compares greedy decodings" in capsys.readouterr().err


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A transformers model directory: a tiny random Llama with the default model's tokenizer."""
    import torch
    import transformers

    from jakiro_ext.models.default import load_default_hf

    _, tokenizer = load_default_hf(torch.float32)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id)
    path = tmp_path_factory.mktemp("target") / "tiny"
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_generate_and_bench_take_a_local_transformers_target(capsys, tmp_path, tiny_dir):
    # --target DIR: a transformers model directory (here a tiny random Llama with the default
    # model's tokenizer), nothing fetched; the tokens are the engine's on that model.
    import transformers

    from jakiro_ext.engine.generate import speculative_generate
    from jakiro_ext.models.llama import LlamaModel

    hf = transformers.LlamaForCausalLM.from_pretrained(tiny_dir).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    out = run_json(capsys, ["generate", "Name a fruit.", "--target", str(tiny_dir), "--method", "ar",
                            "--max-new-tokens", "8", "--json"])
    from jakiro_ext.cli.common import chat_ids

    ids = chat_ids(tokenizer, "Name a fruit.")
    expected = speculative_generate(LlamaModel.from_hf(hf), None, ids, 8, eos_token_id=tokenizer.eos_token_id)
    assert out["token_ids"] == expected.token_ids
    bench = run_json(capsys, ["bench", "--target", str(tiny_dir), "--method", "ar", "--method", "eagle2",
                              "--limit", "1", "--max-new-tokens", "4", "--json"])
    assert bench["methods"]["eagle2"]["all_same_tokens_as_ar"] is True  # (a random head: the warning says so)
    assert main(["generate", "x", "--target", str(tmp_path / "nothing")]) == 2
    assert "not a transformers model directory (no config.json)" in capsys.readouterr().err


def test_tree_auto_is_the_engines_live_choice_and_tree_cost_the_measured_best(capsys, tmp_path, monkeypatch, tiny_dir):
    # A head with an acceptance profile: --tree auto (the default) leaves the tree to the engine,
    # which chooses it round by round from live timing (as the API's default does); --tree cost
    # runs the tree the measured costs rank best, fixed for the run. The tokens are ar's either way.
    import transformers

    from jakiro_ext.engine import generate as engine
    from jakiro_ext.engine.policy import FixedTree, LiveTree
    from jakiro_ext.models.heads.config import DraftConfig
    from jakiro_ext.models.heads.draft_head import DraftHead

    monkeypatch.setenv("JAKIRO_CACHE", str(tmp_path / "cache"))
    made, policy_of = [], engine.tree_policy
    monkeypatch.setattr(engine, "tree_policy", lambda *a, **k: made.append(policy_of(*a, **k)) or made[-1])
    config = DraftConfig.for_target(transformers.AutoConfig.from_pretrained(tiny_dir), "jakiro", num_experts=4)
    head = DraftHead(config).init_weights(seed=3)
    head.acceptance = JAKIRO_PROFILE
    head.save(tmp_path / "head")
    common = ["bench", "--target", str(tiny_dir), "--method", "ar", "--method", "jakiro", "--limit", "2",
              "--max-new-tokens", "12", "--json", "--jakiro-head", str(tmp_path / "head")]
    live = run_json(capsys, common)
    assert live["config"]["tree"] == {"jakiro": "live"} and live["methods"]["jakiro"]["all_same_tokens_as_ar"]
    assert any(isinstance(p, LiveTree) for p in made)
    made.clear()
    fixed = run_json(capsys, common + ["--tree", "cost"])
    assert set(fixed["config"]["tree"]["jakiro"]) == {"total_tokens", "depth", "top_k"}
    assert fixed["methods"]["jakiro"]["all_same_tokens_as_ar"]
    assert made and all(isinstance(p, FixedTree) for p in made)


def test_the_training_summary_is_a_sentence():
    from jakiro_ext.cli.train import held_out_summary

    final = {"eval_acc1": 0.6123, "eval_acc2": 0.41, "eval_acc2_contrastive": 0.3, "eval_loss": 1.2, "eval_acc3_mlp": 0.2}
    assert held_out_summary(final, 12) == (
        "held out (12 sequences): its draft token is right 0.61 (1 ahead), 0.41 (2 ahead) of the time; the full "
        "record is in training.json, the acceptance profile the tree choice reads in acceptance.json")
    assert "no held-out evaluation" in held_out_summary({}, 0)


def test_demo_answers_and_times_the_methods_on_ten_prompts(capsys):
    assert main(["demo", "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "then 9 packaged prompts (one of each category), timed" in out
    assert re.search(r"identical tokens on all 10 prompts; Jakiro decodes \d+\.\d\dx as fast as plain decoding over "
                     r"them \(\d+\.\d against \d+\.\d tokens/s; tau \d\.\d\d\)", out), out
    assert "tau: tokens per target forward" in out
