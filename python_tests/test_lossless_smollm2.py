"""Losslessness on the real default model (SmolLM2-135M-Instruct, float32, greedy): on 30 of the
packaged prompts, every method's tokens equal plain greedy decoding, with a random head (which
accepts almost nothing) and with trained heads (which accept multi-token paths). The trained heads
are trained here, briefly, on the target's own greedy answers to the 40 packaged prompts
(self-distillation); the heads shipped for the default model are tested the same way."""
import json

import pytest
import torch

from jakiro_ext.cli import PROMPTS_FILE, chat_ids
from jakiro_ext.engine import TreeConfig, speculative_generate
from jakiro_ext.models.draft_head import DraftConfig, DraftHead
from jakiro_ext.train import TrainConfig, make_example, train_head

MAX_NEW = 32


@pytest.fixture(scope="module")
def setup():
    from jakiro_ext.models import load_default_target

    target, tokenizer = load_default_target(torch.float32)
    prompts = [json.loads(line)["prompt"] for line in PROMPTS_FILE.read_text().splitlines()]
    assert len(prompts) >= 30
    ids = [chat_ids(tokenizer, p) for p in prompts]
    plain = [speculative_generate(target, None, x, MAX_NEW, eos_token_id=tokenizer.eos_token_id).token_ids for x in ids]
    return target, tokenizer, ids, plain


@pytest.fixture(scope="module")
def trained_heads(setup):
    target, _, ids, plain = setup
    examples = [make_example(target, torch.cat([x, torch.tensor(p, dtype=torch.int64)])) for x, p in zip(ids, plain)]
    heads = {}
    for kind in ("eagle2", "jakiro"):
        config = DraftConfig.for_target(target.config, kind, num_experts=4)
        head = DraftHead(config).init_weights(seed=0).bind(target)
        losses = train_head(head, examples, TrainConfig(steps=250, lr=2e-3, warmup_steps=10, sequences_per_step=2,
                                                        w_token=0.0, w_token2=0.0))
        assert losses[-1] < 0.5 * losses[0]
        heads[kind] = head
    return heads


def generate_all(setup, head, method, prompts, tree=None):
    target, tokenizer, ids, plain = setup
    taus = []
    for i in prompts:
        out = speculative_generate(target, head, ids[i], MAX_NEW, method=method, tree=tree,
                                   eos_token_id=tokenizer.eos_token_id)
        assert out.token_ids == plain[i], f"prompt {i}: {method} differs from plain greedy decoding"
        taus.append(out.stats.tau)
    return sum(taus) / len(taus)


def test_plain_decoding_equals_transformers_greedy(setup):
    from jakiro_ext.models import load_default_hf

    _, tokenizer, ids, plain = setup
    hf, _ = load_default_hf()
    for i in range(4):
        with torch.no_grad():
            out = hf.generate(ids[i].unsqueeze(0), max_new_tokens=MAX_NEW, do_sample=False,
                              eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
        assert out[0, ids[i].numel():].tolist() == plain[i]


def test_random_head_is_exact_on_every_prompt(setup):
    target = setup[0]
    head = DraftHead(DraftConfig.for_target(target.config, "jakiro", num_experts=8)).init_weights(seed=0).bind(target)
    # A small tree: nothing is accepted, so each round verifies the whole tree for one token.
    tree = TreeConfig(8, 3, 3)
    generate_all(setup, head, "jakiro", range(30), tree)
    for method in ("eagle2", "jakiro_star"):
        generate_all(setup, head, method, range(5), tree)


@pytest.mark.parametrize("kind,method", [("eagle2", "eagle2"), ("jakiro", "jakiro"), ("jakiro", "jakiro_star")])
def test_trained_head_is_exact_on_every_prompt(setup, trained_heads, kind, method):
    tau = generate_all(setup, trained_heads[kind], method, range(30))
    assert tau > 1.5, f"the trained head should accept multi-token paths (tau {tau:.2f})"
