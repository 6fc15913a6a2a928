"""The self-distilled token corpus on the default model: answers are the target's greedy ones,
later turns continue the conversation with the target's own answers, shards resume, the settings
and the target are checked, and the features (cached while generating or recomputed by batched
prefill) are the target's."""
import json
import pathlib

import numpy as np
import pytest
import torch

from jakiro_ext.training.corpus import CorpusSequence, CorpusWriter, generate_corpus, read_corpus, read_corpus_meta
from jakiro_ext.engine.generate import speculative_generate
from jakiro_ext.training.examples import target_features
from jakiro_ext.training.features import corpus_examples, prefill_features

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"},
     {"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": "6"},
     {"role": "user", "content": "And 4+4?"}, {"role": "assistant", "content": "8"}],
    [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "red"}],
    [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"},
     {"role": "user", "content": "Again."}, {"role": "assistant", "content": "hi"}],
]


@pytest.fixture(scope="module")
def default():
    from jakiro_ext.models.default import load_default_target

    return load_default_target()


def generate(default, path, answer_tokens, **kw):
    target, tokenizer = default
    settings = dict(max_new_tokens=24, max_turns=2, batch=2, shard_answer_tokens=20, progress=False)
    settings.update(kw)
    return generate_corpus(path, target, tokenizer, "SmolLM2", answer_tokens, conversations=CONVERSATIONS, **settings)


def test_corpus_answers_turns_shards_and_resume(tmp_path, default):
    target, tokenizer = default
    eos = tokenizer.eos_token_id
    meta = generate(default, tmp_path / "c", 10_000, feature_dir=tmp_path / "f")
    seqs = {(q.conversation, q.turn): q for q in read_corpus(tmp_path / "c")}
    assert len(meta["shards"]) >= 2 and meta["settings"]["target_sha256"]
    # Every first turn; a second turn only after an answer that ended on EOS, and not beyond max_turns.
    assert {(0, 0), (1, 0), (2, 0)} <= set(seqs) and all(t < 2 for _, t in seqs)
    assert (0, 1) in seqs, "the 2+2 answer ends on EOS within 24 tokens, so its next turn must be there"
    for (conv, turn), q in seqs.items():
        # The answer is the target's own greedy continuation of the prompt.
        want = speculative_generate(target, None, q.tokens[: q.prompt_length], 24, eos_token_id=eos).token_ids
        assert q.answer.tolist() == want
        if turn:
            before = seqs[(conv, turn - 1)].tokens
            assert before[-1] == eos and torch.equal(q.tokens[: before.numel()], before)
            text = tokenizer.decode(q.tokens[before.numel(): q.prompt_length])
            assert CONVERSATIONS[conv][2 * turn]["content"] in text
    # Resuming with a larger goal adds nothing twice; other settings are refused.
    n_before = sum(s["sequences"] for s in meta["shards"])
    meta2 = generate(default, tmp_path / "c", 20_000, feature_dir=tmp_path / "f")
    assert sum(s["sequences"] for s in meta2["shards"]) == n_before  # all conversations were done
    with pytest.raises(ValueError, match="other settings"):
        generate(default, tmp_path / "c", 20_000, max_new_tokens=25)
    # Tokens fit uint16 and are stored compressed.
    with np.load(tmp_path / "c" / meta["shards"][0]["name"]) as z:
        assert z["tokens"].dtype == np.uint16
    assert json.loads((tmp_path / "c" / "corpus.json").read_text()) == meta2


def test_interrupted_generation_resumes_with_the_same_result(tmp_path, default):
    full = generate(default, tmp_path / "full", 10_000)
    generate(default, tmp_path / "part", 25)  # stops after the first shard or two
    assert len(read_corpus_meta(tmp_path / "part")["shards"]) < len(full["shards"])
    generate(default, tmp_path / "part", 10_000)
    key = lambda q: (q.conversation, q.turn)
    got = sorted(((key(q), q.tokens.tolist()) for q in read_corpus(tmp_path / "part")))
    want = sorted(((key(q), q.tokens.tolist()) for q in read_corpus(tmp_path / "full")))
    assert got == want


def test_corpus_features_cached_or_recomputed_are_the_targets(tmp_path, default, capsys):
    target, _ = default
    generate(default, tmp_path / "c", 10_000, feature_dir=tmp_path / "f")
    capsys.readouterr()
    cached, _ = corpus_examples(tmp_path / "c", target, tmp_path / "f")
    assert "features" not in capsys.readouterr().err  # all cached: nothing to compute, nothing said
    fresh, _ = corpus_examples(tmp_path / "c", target, tmp_path / "empty", batch_tokens=64)
    shards = read_corpus_meta(tmp_path / "c")["shards"]
    tokens = sum(s["tokens"] for s in shards)
    # Said up front: how many tokens, how much disk (bf16 rows of the hidden size), where.
    assert (f"the target's features of {len(shards)} corpus shard{'s' if len(shards) > 1 else ''} ({tokens:,} tokens, "
            f"{tokens * target.config.hidden_size * 2 / 1e9:.1f} GB in {tmp_path / 'empty'})") in capsys.readouterr().err
    assert len(cached) == len(fresh) == sum(1 for _ in read_corpus(tmp_path / "c"))
    for a, b in zip(cached, fresh):
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.loss_mask, b.loss_mask)
        want = target_features(target, a.tokens)
        # bf16 storage; the last row of a generated sequence is never computed (stored as zeros).
        for ex in (a, b):
            torch.testing.assert_close(ex.features[:-1].float(), want[:-1], atol=0.05, rtol=0.02)
        assert int(a.loss_mask.sum()) == a.tokens.numel() - int((~a.loss_mask).sum()) > 0
    # The recomputed features were cached: a second read finds them.
    assert sorted(p.name for p in (tmp_path / "empty").iterdir()) == sorted(
        s["name"].replace(".npz", ".safetensors") for s in read_corpus_meta(tmp_path / "c")["shards"])


def test_bf16_features_are_close_and_cached_apart(tmp_path, default, monkeypatch):
    from jakiro_ext.training.feature_cache import feature_cache_dir

    monkeypatch.setenv("JAKIRO_CACHE", str(tmp_path / "cache"))
    target, _ = default
    generate(default, tmp_path / "c", 10_000)
    fp32, _ = corpus_examples(tmp_path / "c", target, progress=False)
    bf16, _ = corpus_examples(tmp_path / "c", target, progress=False, dtype=torch.bfloat16)
    assert target.lm_head.weight.dtype == torch.float32  # the caller's target is not cast
    assert feature_cache_dir(tmp_path / "c", torch.bfloat16).name == feature_cache_dir(tmp_path / "c").name + "-bf16"
    names = sorted(s["name"].replace(".npz", ".safetensors") for s in read_corpus_meta(tmp_path / "c")["shards"])
    for dtype in (torch.float32, torch.bfloat16):
        assert sorted(p.name for p in feature_cache_dir(tmp_path / "c", dtype).iterdir()) == names
    differ = False
    for a, b in zip(fp32, bf16):
        assert torch.equal(a.tokens, b.tokens)
        want, got = a.features[:-1].float(), b.features[:-1].float()
        rel = (got - want).norm(dim=1) / want.norm(dim=1)
        assert rel.max() < 0.1, rel.max()  # bf16's rounding through 30 layers, not another token's row
        differ |= not torch.equal(want, got)
    assert differ, "the bf16 features are the fp32 ones: the target was not run in bf16"
    with pytest.raises(ValueError, match="float32 or bfloat16, got torch.float16"):
        feature_cache_dir(tmp_path / "c", torch.float16)


def test_training_on_the_first_shards_of_a_corpus(tmp_path, default):
    target, _ = default
    meta = generate(default, tmp_path / "c", 10_000, feature_dir=tmp_path / "f")
    shards = meta["shards"]
    assert len(shards) >= 2
    first, sub = corpus_examples(tmp_path / "c", target, tmp_path / "f", progress=False, shards=1)
    assert [s["name"] for s in sub["shards"]] == [shards[0]["name"]]
    assert len(first) == shards[0]["sequences"] and {ex.shard for ex in first} == {shards[0]["name"]}
    every, _ = corpus_examples(tmp_path / "c", target, tmp_path / "f", progress=False)
    assert len(every) == sum(s["sequences"] for s in shards)
    for bad in (0, len(shards) + 1):
        with pytest.raises(ValueError, match=rf"shards must be in \[1, {len(shards)}\]"):
            corpus_examples(tmp_path / "c", target, tmp_path / "f", progress=False, shards=bad)


def test_batched_prefill_matches_one_sequence_at_a_time(default):
    target, _ = default
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 1000, (n,), generator=g) for n in (5, 17, 3, 30, 12)]
    for got, seq in zip(prefill_features(target, seqs, batch_tokens=40), seqs):
        # Other row counts take other kernel paths: equal up to float32 rounding, which 30 layers
        # amplify (up to 2e-3 on an AVX2-only EPYC); a row read from another sequence or from
        # padding would be off by O(1).
        torch.testing.assert_close(got, target_features(target, seq), atol=1e-2, rtol=1e-3)


def test_corpus_of_another_target_and_bad_tokens_are_errors(tmp_path, default):
    target, _ = default
    w = CorpusWriter(tmp_path / "c", dict(vocab_size=100, target_sha256="0" * 64), shard_answer_tokens=1)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 100\)"):
        w.add(CorpusSequence(0, 0, torch.tensor([1, 2, 300]), 2))
    w = CorpusWriter(tmp_path / "d", dict(vocab_size=100, target_sha256="0" * 64), shard_answer_tokens=1)
    w.add(CorpusSequence(0, 0, torch.tensor([1, 2, 3]), 2))
    with pytest.raises(ValueError, match="generated by another target"):
        corpus_examples(tmp_path / "d", target, tmp_path / "f", progress=False)
    with pytest.raises(FileNotFoundError, match="not a token corpus"):
        read_corpus_meta(tmp_path / "nothing")


def test_corpus_train_calibrate_commands(tmp_path):
    """The CLI end to end: a corpus from a conversations file, a Jakiro head trained on it with
    the training-time test (held out by conversation), saved with its acceptance profile, which
    ``calibrate`` records again; the head decodes losslessly with the tree chosen for it."""
    from jakiro_ext.cli import main
    from jakiro_ext.models.default import load_default_target
    from jakiro_ext.models.heads.draft_head import DraftHead

    convs = [{"id": str(i), "conversations": [
        {"from": "human", "value": c[0]["content"]}, {"from": "gpt", "value": "ok"}] + (
        [{"from": "human", "value": c[2]["content"]}, {"from": "gpt", "value": "ok"}] if len(c) > 2 else [])}
        for i, c in enumerate(CONVERSATIONS)]
    (tmp_path / "convs.json").write_text(json.dumps(convs))
    corpus, head_dir = tmp_path / "corpus", tmp_path / "head"
    assert main(["corpus", "--out", str(corpus), "--answer-tokens", "10000", "--max-new-tokens", "24",
                 "--generation-batch", "2", "--conversations", str(tmp_path / "convs.json")]) == 0
    meta = read_corpus_meta(corpus)
    assert meta["settings"]["source"] == "convs.json" and meta["settings"]["max_turns"] == 3
    assert main(["train", "--kind", "jakiro", "--out", str(head_dir), "--data", str(corpus), "--steps", "3",
                 "--warmup-steps", "1", "--batch", "2", "--draft-vocab", "256", "--eval-every-nth", "2",
                 "--ttt-steps", "2", "--checkpoint-every", "0"]) == 0
    summary = json.loads((head_dir / "training.json").read_text())
    assert summary["train"]["ttt_steps"] == 2 and summary["data"]["target_sha256"] == meta["settings"]["target_sha256"]
    # The same training on 2 processes under torchrun (gloo): rank 0 saves the same head (up to
    # float rounding; test_train_distributed.py compares the trajectories closely).
    import os
    import subprocess
    import sys

    import jakiro_ext

    home = pathlib.Path(jakiro_ext.__file__).resolve().parent.parent  # (installed, or a checkout's in-place build)
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                          "-m", "jakiro_ext", "train", "--kind", "jakiro", "--out", str(tmp_path / "two"),
                          "--data", str(corpus), "--steps", "3", "--warmup-steps", "1", "--batch", "2",
                          "--draft-vocab", "256", "--eval-every-nth", "2", "--ttt-steps", "2", "--checkpoint-every", "0",
                          "--threads", "1"], env=dict(os.environ, PYTHONPATH=str(home)), capture_output=True, text=True,
                         timeout=900, cwd=tmp_path)  # (-m puts the working directory first on the path)
    assert run.returncode == 0, run.stderr[-8000:]
    two = json.loads((tmp_path / "two" / "training.json").read_text())
    assert two["train"]["processes"] == 2 and two["data"] == summary["data"]
    for key, value in summary["final_eval"].items():
        assert abs(two["final_eval"][key] - value) <= 0.05, key
    from safetensors.torch import load_file
    one, both = load_file(str(head_dir / "model.safetensors")), load_file(str(tmp_path / "two" / "model.safetensors"))
    for name, value in one.items():
        torch.testing.assert_close(both[name].float(), value.float(), atol=2e-2, rtol=2e-2)
    # Conversations 0 and 2 held out (every 2nd), with their later turns.
    assert summary["data"]["held_out_sequences"] == sum(1 for q in read_corpus(corpus) if q.conversation % 2 == 0)
    target, tokenizer = load_default_target()
    head = DraftHead.load(head_dir, target)
    assert len(head.acceptance["depth_rank"]) == 6 and head.acceptance["positions"] > 0
    (head_dir / "acceptance.json").unlink()
    assert main(["calibrate", "--head", str(head_dir), "--data", str(corpus), "--eval-every-nth", "2"]) == 0
    again = DraftHead.load(head_dir, target).acceptance  # of the saved (bf16) weights: close, not equal
    assert again["positions"] == head.acceptance["positions"] and len(again["depth_rank"]) == 6
    ids = torch.tensor(tokenizer.encode("Hello there"))
    assert speculative_generate(target, head, ids, 12).token_ids == speculative_generate(target, None, ids, 12).token_ids
    assert main(["calibrate", "--head", str(head_dir), "--data", str(corpus), "--eval-every-nth", "0"]) == 2
    # A second phase continues from the trained head (same data and widths); another kind is refused.
    common = ["--data", str(corpus), "--steps", "2", "--warmup-steps", "1", "--batch", "2", "--draft-vocab", "256",
              "--eval-every-nth", "2", "--checkpoint-every", "0", "--init-from", str(head_dir)]
    assert main(["train", "--kind", "jakiro", "--out", str(tmp_path / "phase2"), "--ttt-steps", "3", *common]) == 0
    assert json.loads((tmp_path / "phase2" / "training.json").read_text())["init_from"] == str(head_dir)
    assert main(["train", "--kind", "eagle2", "--out", str(tmp_path / "other"), *common]) == 2
    # Continuing with features computed in bf16 keeps the head's draft vocabulary.
    assert main(["train", "--kind", "jakiro", "--out", str(tmp_path / "phase3"), "--feature-dtype", "bfloat16",
                 *common]) == 0
    assert json.loads((tmp_path / "phase3" / "training.json").read_text())["data"]["feature_dtype"] == "bfloat16"
    assert torch.equal(DraftHead.load(tmp_path / "phase3").draft_to_target, DraftHead.load(head_dir).draft_to_target)
    # An EAGLE-3 head on the same corpus: the target's layers 2, 15 and 27 read (their features
    # cached apart), the token loss over 2 unrolled steps, saved in EAGLE-3's released format
    # with its acceptance profile, read back, lossless.
    from jakiro_ext.models.heads.eagle3 import Eagle3Head
    from jakiro_ext.training.feature_cache import feature_cache_dir

    e3 = tmp_path / "eagle3"
    assert main(["train", "--kind", "eagle3", "--out", str(e3), "--data", str(corpus), "--steps", "3",
                 "--warmup-steps", "1", "--batch", "2", "--draft-vocab", "256", "--eval-every-nth", "2",
                 "--checkpoint-every", "0"]) == 0
    config = json.loads((e3 / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 256
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    assert config["max_position_embeddings"] == target.config.max_position_embeddings
    trained = json.loads((e3 / "training.json").read_text())
    assert trained["train"]["ttt_steps"] == 2 and set(trained["final_eval"]) == {f"eval_acc{s}" for s in range(1, 5)}
    assert (feature_cache_dir(corpus, torch.float32, (2, 15, 27)) / "shard-00000.safetensors").is_file()
    head3 = DraftHead.load(e3, target)
    assert isinstance(head3, Eagle3Head) and head3.feature_layers == (2, 15, 27)
    assert len(head3.acceptance["depth_rank"]) == 6 and head3.acceptance["positions"] > 0
    assert speculative_generate(target, head3, ids, 12).token_ids == speculative_generate(target, None, ids, 12).token_ids
    assert main(["train", "--kind", "eagle3", "--out", str(tmp_path / "no"), "--data", str(corpus), "--steps", "1",
                 "--init-from", str(e3)]) == 2
    # Jakiro's layer on the same features (--fused): their cache read, not made again; the token
    # loss with its contrastive branch, unrolled; this package's format; lossless.
    fused = tmp_path / "fused"
    assert main(["train", "--kind", "jakiro", "--fused", "--experts", "2", "--intermediate-size", "64", "--out",
                 str(fused), "--data", str(corpus), "--steps", "3", "--warmup-steps", "1", "--batch", "2",
                 "--draft-vocab", "256", "--eval-every-nth", "2", "--checkpoint-every", "0"]) == 0
    trained = json.loads((fused / "training.json").read_text())
    assert trained["train"]["ttt_steps"] == 2 and "eval_acc2_contrastive" in trained["final_eval"]
    assert {k: trained["train"][k] for k in ("w_feature", "w_token", "w_feature2", "w_token2", "noise")} == dict(
        w_feature=0.0, w_token=1.0, w_feature2=0.0, w_token2=0.5, noise=0.0)  # (what the loss used)
    head4 = DraftHead.load(fused, target)
    assert head4.config.kind == "jakiro" and head4.feature_layers == (2, 15, 27)
    assert speculative_generate(target, head4, ids, 12, method="jakiro").token_ids == \
        speculative_generate(target, None, ids, 12).token_ids
    for bad in (["--kind", "gumiho", "--fused"], ["--kind", "jakiro", "--feature-layers", "2", "3", "4"],
                ["--kind", "jakiro", "--fused", "--init-from-target"], ["--kind", "eagle3", "--w-token", "0"]):
        assert main(["train", *bad, "--out", str(tmp_path / "no"), "--data", str(corpus), "--steps", "1"]) == 2


def test_continuing_a_head_on_other_data_keeps_its_draft_vocabulary(tmp_path, default):
    from jakiro_ext.training.examples import Example
    from jakiro_ext.training.run import new_head

    target, _ = default

    def examples(low):  # learned tokens low..low+99, prompts elsewhere
        tokens = torch.cat([torch.arange(500, 520), torch.arange(low, low + 100)])
        return [Example(tokens, torch.zeros(120, 576), torch.arange(120) >= 20, 0, "")]

    first, _ = new_head(target, "SmolLM2", "jakiro", examples(1000), draft_vocab=64)
    first.save(tmp_path / "h", torch.float32)
    fresh, _ = new_head(target, "SmolLM2", "jakiro", examples(3000), draft_vocab=64)
    kept, coverage = new_head(target, "SmolLM2", "jakiro", examples(3000), draft_vocab=64, init_from=str(tmp_path / "h"))
    assert not torch.equal(fresh.draft_to_target, first.draft_to_target)
    assert torch.equal(kept.draft_to_target, first.draft_to_target) and coverage == 0.0
    torch.testing.assert_close(kept.lm_head_weight, first.lm_head_weight)
    for name, value in first.state_dict().items():
        assert torch.equal(kept.state_dict()[name], value), name
    with pytest.raises(ValueError, match="its config differs"):
        new_head(target, "SmolLM2", "jakiro", examples(3000), draft_vocab=32, init_from=str(tmp_path / "h"))
