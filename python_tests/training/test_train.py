"""The training pipeline: self-distilled data by batched greedy generation, the on-disk training
set (resume, settings check), the draft vocabulary, reduced-vocabulary heads in the engine,
training (loss falls, checkpoints resume bit-exactly) and the ``train`` command."""
import json

import pytest
import torch

from conftest import gen
from jakiro_ext.config import TreeConfig
from jakiro_ext.engine.generate import speculative_generate
from jakiro_ext.models.heads.config import DraftConfig
from jakiro_ext.models.heads.draft_head import DraftHead
from jakiro_ext.training.examples import Example, target_features
from jakiro_ext.training.settings import TrainConfig
from jakiro_ext.training.loss import evaluate
from jakiro_ext.training.train import train_head
from jakiro_ext.training.trainset import TrainSetWriter, load_trainset, select_draft_vocab
from jakiro_ext.training.corpus import generate_greedy_batched
from helpers import copy_head, make_examples, prompt



def test_batched_generation_matches_decoding_each_prompt_alone(target):
    prompts = [(k, prompt(n, seed=10 + k)) for k, n in enumerate([5, 17, 9, 30, 3, 12, 8])]
    eos = [7, 19]
    out = {k: (n, toks, feats) for k, n, toks, feats in generate_greedy_batched(target, iter(prompts), 32, 20, 3, eos)}
    assert sorted(out) == [k for k, _ in prompts]  # every prompt, rows refilled as they finish
    for k, ids in prompts:
        n, tokens, features = out[k]
        alone = speculative_generate(target, None, ids, 20, eos_token_id=eos).token_ids
        assert n == ids.numel() and tokens[:n].tolist() == ids.tolist()
        assert tokens[n:].tolist() == alone
        # The features kept while decoding are the target's features of the whole sequence.
        assert features.shape == (tokens.numel() - 1, target.config.hidden_size)
        torch.testing.assert_close(features, target_features(target, tokens)[:-1], atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match=r"max_prompt_tokens=4"):
        list(generate_greedy_batched(target, iter(prompts[1:2]), 4, 5, 2, eos))
    # A prompt whose first answer token is EOS ends at once, also when it refills a row.
    first = {k: int(speculative_generate(target, None, ids, 1).token_ids[0]) for k, ids in prompts}
    out = {k: t for k, _, t, _ in generate_greedy_batched(target, iter(prompts), 32, 20, 2, [first[4]])}
    assert out[4].numel() == prompts[4][1].numel() + 1
    with pytest.raises(ValueError, match=r"max_batch_size must be in \[1, 1024\], got 0"):
        list(generate_greedy_batched(target, iter(prompts), 32, 5, 0, eos))


def test_training_set_round_trip_resume_and_settings(tmp_path, target):
    settings = dict(source="self_distill", target="tiny")
    w = TrainSetWriter(tmp_path, settings, shard_tokens=30)
    seqs = {}
    for k in range(5):
        toks = prompt(8 + 3 * k, seed=k)
        mask = torch.arange(toks.numel()) >= 4
        seqs[k] = (toks, mask, target_features(target, toks))
        w.add(k, toks, mask, seqs[k][2][:-1] if k % 2 else seqs[k][2])  # n - 1 feature rows are padded
    w.flush()
    examples, meta = load_trainset(tmp_path)
    assert meta["sequences"] == 5 and len(meta["shards"]) >= 2 and sorted(meta["done"]) == list(range(5))
    assert meta["tokens"] == sum(t.numel() for t, _, _ in seqs.values())
    assert meta["learned_tokens"] == sum(int(m.sum()) for _, m, _ in seqs.values())
    by_len = {ex.tokens.numel(): ex for ex in examples}
    for k, (toks, mask, feats) in seqs.items():
        ex = by_len[toks.numel()]
        assert torch.equal(ex.tokens, toks) and torch.equal(ex.loss_mask, mask)
        torch.testing.assert_close(ex.features[:-1], feats[:-1], atol=0, rtol=0)
    # Reopening resumes (the finished sources are known); other settings are refused.
    assert TrainSetWriter(tmp_path, settings).done == set(range(5))
    with pytest.raises(ValueError, match=r"other settings"):
        TrainSetWriter(tmp_path, dict(settings, source="teacher_forced"))
    with pytest.raises(FileNotFoundError, match=r"build the training set first"):
        load_trainset(tmp_path / "nothing")


def test_draft_vocab_takes_the_most_learned_tokens():
    ex = Example(torch.tensor([5, 5, 5, 9, 9, 2, 7, 7, 7, 7]), torch.zeros(10, 4),
                 torch.tensor([False, True, True, True, True, True, True, True, True, False]))
    # learned: 5 x2, 9 x2, 2 x1, 7 x3
    ids, coverage = select_draft_vocab([ex], 2)
    assert ids.tolist() == [5, 7]  # 5 and 9 tie on learned counts; 5 occurs more often in all
    assert coverage == pytest.approx(5 / 8)
    ids, coverage = select_draft_vocab([ex], 3, always=[11])
    assert 11 in ids.tolist() and 7 in ids.tolist() and len(ids) == 3


def reduced_copy_head(target, kind, vocab_ids):
    """A copy head (drafts its input token) restricted to a draft vocabulary."""
    full = copy_head(target, kind)
    config = DraftConfig(**{**full.config.__dict__, "draft_vocab_size": len(vocab_ids)})
    head = DraftHead(config)
    head.load_state_dict({**full.state_dict(), "draft_to_target": torch.as_tensor(vocab_ids)})
    return head.bind(target)


@pytest.mark.parametrize("kind,method", [("eagle2", "eagle2"), ("jakiro", "jakiro"), ("jakiro", "jakiro_star")])
def test_reduced_vocab_heads_are_lossless_and_draft_target_ids(target, kind, method, tmp_path):
    vocab = target.config.vocab_size
    ids_in_vocab = torch.randperm(vocab, generator=gen(3))[:60].sort().values
    head = reduced_copy_head(target, kind, ids_in_vocab)
    assert head.lm_head_weight.shape == (60, target.config.hidden_size)
    for seed in range(3):
        x = prompt(11, seed=seed)
        plain = speculative_generate(target, None, x, 24).token_ids
        out = speculative_generate(target, head, x, 24, method=method, tree=TreeConfig(12, 3, 4))
        assert out.token_ids == plain
    # Every drafted token is a target id of the draft vocabulary.
    from jakiro_ext.methods import METHODS
    from jakiro_ext.engine.drafter import Drafter

    d = Drafter(head, METHODS[method], TreeConfig(12, 3, 4))
    x = prompt(11, seed=0)
    _, hidden = target(x.unsqueeze(0), target.new_cache(1, 16), last_logits_only=True)
    tokens = d.draft(x[-1:], *d.prefill(x[1:], hidden[0, :-1])).tokens[0]
    assert set(tokens[1:].tolist()) <= set(ids_in_vocab.tolist())
    # Saved and loaded with its vocabulary.
    head.save(tmp_path, torch.bfloat16)
    loaded = DraftHead.load(tmp_path, target)
    assert torch.equal(loaded.draft_to_target, head.draft_to_target)
    assert loaded.fc.weight.dtype == torch.float32
    with pytest.raises(ValueError, match=r"draft_vocab_size 60; got 3"):
        loaded.set_draft_vocab([1, 2, 3])
    with pytest.raises(ValueError, match=r"distinct target ids"):
        loaded.set_draft_vocab(torch.zeros(60, dtype=torch.int64))


@pytest.mark.parametrize("kind,ttt_steps,mlp_input", [("eagle2", 0, "teacher"), ("jakiro", 0, "teacher"),
                                                       ("eagle2", 3, "teacher"), ("jakiro", 3, "teacher"),
                                                       ("gumiho", 0, "teacher"), ("gumiho", 0, "drafted"),
                                                       ("jakiro_gumiho", 0, "drafted")])
def test_training_learns_and_resumes_bit_exactly(target, kind, ttt_steps, mlp_input, tmp_path):
    examples = make_examples(target)
    cfg = TrainConfig(steps=8, lr=3e-3, warmup_steps=2, batch_sequences=3, checkpoint_every=4, eval_every=4,
                      ttt_steps=ttt_steps, mlp_input=mlp_input)

    def fresh():
        return DraftHead(DraftConfig.for_target(target.config, kind, num_experts=4, intermediate_size=32)).init_weights(0).bind(target)

    before = evaluate(fresh(), examples, cfg)
    straight = fresh()
    history = train_head(straight, examples, cfg, examples)
    assert history[-1]["loss"] < history[0]["loss"]
    assert "eval_acc1" in history[3] and "eval_acc1" in history[-1] and "eval_acc1" not in history[0]
    assert history[-1]["eval_acc1"] > before["acc1"]
    # Training reports every unrolled step's accuracy; the evaluation always drafts 4 steps deep.
    assert {f"acc{s}" for s in range(1, ttt_steps + 2)} <= set(history[-1])
    assert f"acc{ttt_steps + 2}" not in history[-1]
    assert {f"eval_acc{s}" for s in range(1, 5)} <= set(history[-1])
    if "jakiro" in kind:
        assert {f"acc{s}_contrastive" for s in range(2, ttt_steps + 3)} <= set(history[-1])
        assert {f"eval_acc{s}_contrastive" for s in range(2, 6)} <= set(history[-1])
    if "gumiho" in kind:  # its two MLP heads draft depths 3 and 4
        assert {"acc3_mlp", "acc4_mlp", "eval_acc3_mlp", "eval_acc4_mlp"} <= set(history[-1])
        assert history[-1]["eval_acc3_mlp"] > before["acc3_mlp"]

    class Stop(Exception):
        pass

    def stop_after_checkpoint(step, record, planned):
        if step + 1 == 5:
            raise Stop

    ckpt = tmp_path / "ckpt.pt"
    with pytest.raises(Stop):
        train_head(fresh(), examples, cfg, examples, ckpt, stop_after_checkpoint)
    assert ckpt.exists()
    resumed, steps_run = fresh(), []
    history2 = train_head(resumed, examples, cfg, examples, ckpt, lambda step, record, planned: steps_run.append(step))
    assert steps_run == [4, 5, 6, 7]  # resumed after the checkpoint at step 4, not from the start
    assert len(history2) == len(history) and history2[:4] == torch.load(ckpt, weights_only=False)["history"][:4]
    for a, b in zip(straight.state_dict().values(), resumed.state_dict().values()):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match=r"other settings"):
        train_head(fresh(), examples, TrainConfig(steps=9, checkpoint_every=4), (), ckpt)
    with pytest.raises(ValueError, match=r"other settings or data"):
        train_head(fresh(), examples[:-1], cfg, (), ckpt)


def test_gumiho_drafted_mlp_inputs_are_what_drafting_computes(target):
    """The "drafted" MLP-head input of a row is what the drafter builds for a leaf two tokens
    past the row: cat(x_parent, x_leaf) from one serial step on the head's own features. Checked
    by drafting a chain (top_k 1) from a committed prefix and comparing the MLP heads' features
    with the training-side ones at the prefix's last row; the "teacher" input differs there."""
    from jakiro_ext.methods import METHODS
    from jakiro_ext.engine.drafter import Drafter
    from jakiro_ext.training.examples import Batch
    from jakiro_ext.training.loss import mlp_features, unroll

    head = DraftHead(DraftConfig.for_target(target.config, "gumiho")).init_weights(3, std=0.2).bind(target)
    tokens = prompt(14, seed=9)
    features = target_features(target, tokens)
    n = 10  # the committed prefix: tokens 0..n, features 0..n-1
    drafter = Drafter(head, METHODS["gumiho"], TreeConfig(8, 3, 1))
    started = drafter.prefill(tokens[1:n + 1], features[:n])
    seen = []
    mlp_heads = head.mlp_heads
    head.mlp_heads = lambda x: seen.append(x) or mlp_heads(x)
    tree = drafter.draft(tokens[n:n + 1], *started)
    # The chain's serial tokens: depth 1 and 2; force the training sequence to follow them.
    chain = tree.tokens[0, 1:3]
    seq = torch.cat([tokens[:n + 1], chain, torch.zeros(3, dtype=torch.int64)])
    feats = torch.cat([features[:n], torch.zeros(seq.numel() - n, features.shape[1])])
    batch = Batch(seq.unsqueeze(0), feats.unsqueeze(0), torch.ones(1, seq.numel(), dtype=torch.bool))
    del head.mlp_heads
    steps = [step for _, step in unroll(head, batch, 2)]
    row = n - 1  # the row whose input is (x_n, f_{n-1}): the drafter's root row
    leaf = head.project_input(torch.nn.functional.pad(batch.tokens[:, 3:], (0, 2)), steps[1].feature, train=True)
    drafted = torch.cat([steps[1].projected, leaf], -1)[0, row]
    # (the drafter's fused kernels against plain PyTorch, through two random layers)
    torch.testing.assert_close(seen[0][0, 0], drafted, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(mlp_features(head, batch, steps, "drafted")[0, row], mlp_heads(drafted), atol=1e-5,
                               rtol=1e-5)
    teacher = mlp_features(head, batch, steps, "teacher")[0, row]
    assert (teacher - mlp_heads(drafted)).abs().max() > 0.1  # the teacher input is another one


def test_resume_refuses_another_draft_vocabulary(target, tmp_path):
    examples = make_examples(target, 3)
    cfg = TrainConfig(steps=2, batch_sequences=3, checkpoint_every=1)
    config = DraftConfig.for_target(target.config, "eagle2", intermediate_size=32)
    config.draft_vocab_size = 50

    def head(first):
        return DraftHead(config).init_weights(0).set_draft_vocab(torch.arange(first, first + 50)).bind(target)

    ckpt = tmp_path / "ckpt.pt"
    train_head(head(0), examples, cfg, (), ckpt)
    train_head(head(0), examples, cfg, (), ckpt)  # same vocabulary: resumes (already finished)
    with pytest.raises(ValueError, match=r"another draft vocabulary"):
        train_head(head(1), examples, cfg, (), ckpt)


def test_train_command_builds_data_trains_saves_and_resumes(tmp_path, monkeypatch):
    """The CLI end to end on the default model with a tiny corpus: the training set is built
    (self-distilled), a reduced-vocabulary Jakiro head trained, saved with its recipe, and it
    decodes losslessly; running the command again resumes from the finished checkpoint."""
    from jakiro_ext.cli import main
    from jakiro_ext.models.default import load_default_target

    corpus = tmp_path / "corpus.json"
    convs = [{"id": str(i), "conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": "ok"}]}
             for i, q in enumerate(["What is 2 + 2?", "Name a colour.", "Say hi.", "Count to five.", "What is rain?"])]
    corpus.write_text(json.dumps(convs))
    out = tmp_path / "head"
    argv = ["train", "--kind", "jakiro", "--out", str(out), "--data", str(tmp_path / "data"), "--corpus", str(corpus),
            "--max-tokens", "10000", "--max-new-tokens", "12", "--generation-batch", "2", "--steps", "4", "--batch", "2",
            "--draft-vocab", "256", "--eval-every-nth", "5", "--eval-every", "2", "--checkpoint-every", "2"]
    assert main(argv) == 0
    summary = json.loads((out / "training.json").read_text())
    assert summary["data"]["sequences"] == 5 and summary["train"]["total_steps"] == 4
    assert summary["draft_vocab"]["size"] == 256 and summary["draft_vocab"]["coverage"] == 1.0
    assert set(summary["final_eval"]) == ({f"eval_acc{s}" for s in range(1, 5)}
                                          | {f"eval_acc{s}_contrastive" for s in range(2, 6)})
    target, tokenizer = load_default_target()
    head = DraftHead.load(out, target)
    assert head.config.num_experts == 8 and head.config.intermediate_size == target.config.intermediate_size // 8
    x = prompt(9, vocab=1000, seed=5)
    assert speculative_generate(target, head, x, 12).token_ids == speculative_generate(target, None, x, 12).token_ids
    # Running it again resumes at the last step: no step is trained (a training step would raise).
    import jakiro_ext.training.train

    def no_training(*args, **kwargs):
        raise AssertionError("a finished run must not train again")

    monkeypatch.setattr(jakiro_ext.training.train, "batch_loss", no_training)
    assert main(argv) == 0
    assert json.loads((out / "training.json").read_text())["final_eval"] == summary["final_eval"]


def test_a_resumed_budget_counts_the_earlier_segments_as_they_ran(target, tmp_path, monkeypatch):
    """A run for a budget in minutes, stopped and resumed on a machine that now runs 2x slower
    (a fake clock: 0.25 s a step, then 0.5 s): the steps left are planned from what the earlier
    segment took, not from its steps at today's rate, so the run takes the budget (it used to end
    early, its schedule cut short, when a loaded stretch made the earlier steps look slow)."""
    import types

    import jakiro_ext.training.train as train_module

    clock = types.SimpleNamespace(t=0.0, rate=0.25)
    monkeypatch.setattr(train_module, "time", types.SimpleNamespace(perf_counter=lambda: clock.t))
    examples = make_examples(target, count=4)
    cfg = TrainConfig(minutes=2, lr=1e-3, warmup_steps=10, batch_sequences=2, checkpoint_every=100)

    def fresh():
        return DraftHead(DraftConfig.for_target(target.config, "eagle2", intermediate_size=32)).init_weights(0).bind(target)

    def tick(step, record, planned):
        clock.t += clock.rate
        if step + 1 == 100 and clock.rate == 0.25:
            raise KeyboardInterrupt  # stopped after the checkpoint at step 100 (25 s)

    ckpt = tmp_path / "checkpoint.pt"
    with pytest.raises(KeyboardInterrupt):
        train_head(fresh(), examples, cfg, (), ckpt, tick)
    clock.t, clock.rate = 1000.0, 0.5  # another process, another day
    history = train_head(fresh(), examples, cfg, (), ckpt, tick)
    seconds = 25 + (len(history) - 100) * 0.5
    assert 115 <= seconds <= 121 and history[-1]["lr"] == 0.0


def test_a_budget_is_not_moved_by_a_few_slow_windows(target, monkeypatch):
    """A run for a budget in minutes that runs 20 steps 4x slower (the machine loaded for a moment,
    a fake clock): the steps are planned from the median of the sitting's rates, so the plan is
    cut once by the time really lost and the learning rate never rises again after the warm-up (the
    latest window's rate cut the plan deep, and the next window's put it back, the rate rising)."""
    import types

    import jakiro_ext.training.train as train_module

    clock = types.SimpleNamespace(t=0.0)
    monkeypatch.setattr(train_module, "time", types.SimpleNamespace(perf_counter=lambda: clock.t))
    examples = make_examples(target, count=4)
    cfg = TrainConfig(minutes=2, lr=1e-3, warmup_steps=10, batch_sequences=2)
    head = DraftHead(DraftConfig.for_target(target.config, "eagle2", intermediate_size=32)).init_weights(0).bind(target)

    plans = []

    def tick(step, record, planned):
        clock.t += 1.0 if 150 <= step < 170 else 0.25
        plans.append(planned)

    history = train_head(head, examples, cfg, (), None, tick)
    # What the progress bar is told: no length before the rate is measured, then the plan, whose
    # last figure is the steps run.
    assert plans[0] is None and plans[-1] == len(history), (plans[:12], plans[-1])
    rates = [h["lr"] for h in history[10:]]
    assert all(b <= a for a, b in zip(rates, rates[1:])) and rates[-1] == 0.0
    # 120 s: 15 s lost to the slow steps, the rest at 0.25 s a step.
    assert abs(len(history) - 420) <= 2, len(history)


def test_training_for_a_budget_in_minutes(target):
    """--minutes: the steps are set from the first ten steps' time, the schedule decays to zero at
    the last one, and the run takes about the budget."""
    import time

    examples = make_examples(target, count=4)
    cfg = TrainConfig(minutes=0.05, lr=1e-3, warmup_steps=10, batch_sequences=2)
    head = DraftHead(DraftConfig.for_target(target.config, "eagle2", intermediate_size=32)).init_weights(0).bind(target)
    t0 = time.perf_counter()
    history = train_head(head, examples, cfg)
    seconds = time.perf_counter() - t0
    assert len(history) > 10 and history[-1]["lr"] == 0.0 and history[9]["lr"] == pytest.approx(1e-3)
    assert 0.3 * 3 < seconds < 3 * 3  # loose: the first steps are slower (allocation), and machines are noisy
    with pytest.raises(ValueError, match="warmup_steps >= 10"):
        train_head(head, examples, TrainConfig(minutes=1, warmup_steps=5))
    # A cap in epochs ends a budget that would run longer: 4 examples, 2 a step, 7 epochs = 14
    # steps (the budget's hour would be thousands), the schedule decayed to zero at the last.
    capped = train_head(head, examples, TrainConfig(minutes=60, max_epochs=7, lr=1e-3, warmup_steps=10,
                                                    batch_sequences=2))
    assert len(capped) == 14 and capped[-1]["lr"] == 0.0
    with pytest.raises(ValueError, match="max_epochs caps a budget in minutes"):
        train_head(head, examples, TrainConfig(steps=5, max_epochs=7))
