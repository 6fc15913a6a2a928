"""EAGLE-2's and Jakiro's layer on EAGLE-3's features (a fused head, ``DraftConfig.feature_layers``):
it drafts from the target's three layers at committed tokens and decodes exactly what plain
decoding gives; its training forward is the head's layer on the fused features; it trains as
EAGLE-3 trains (the token loss alone, unrolled, the contrastive branch beside it); it is saved in
this package's format and refused by the formats that cannot say what it reads."""
import json

import pytest
import torch

from helpers import train_briefly, prompt, six_layer_target
from jakiro_ext.engine.generate import speculative_generate
from jakiro_ext.config import TreeConfig
from jakiro_ext.models.heads.config import DraftConfig
from jakiro_ext.models.heads.draft_head import DraftHead
from jakiro_ext.models.llama import as_target
from jakiro_ext.training.examples import Example, collate
from jakiro_ext.training.features import attach_target_probs
from jakiro_ext.training.head_forward import train_forward
from jakiro_ext.training.loss import batch_loss, evaluate, reads_layers, scored_rows, unroll
from jakiro_ext.training.settings import TrainConfig

LAYERS = [2, 3, 5]


@pytest.fixture(scope="module")
def target():
    return as_target(six_layer_target())


def fused_head(target, kind, seed=1, std=0.2, layers=LAYERS, **kw):
    config = DraftConfig.for_target(target.config, kind, num_experts=2, intermediate_size=64, feature_layers=layers, **kw)
    return DraftHead(config).init_weights(seed, std=std).bind(target)


def echoing(head):
    """Its feature is 300 * embed(its input token) whatever the target's layers: with tied
    embeddings it proposes the token it was given, which a tiny random target tends to repeat,
    so that drafts are accepted and the tree's later layers run."""
    H = head.config.hidden_size
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, :H] = torch.eye(H) * 300.0
        head.o_proj.weight.zero_()
        (head.w_down if head.config.num_experts else head.down_proj.weight).zero_()
    return head


@pytest.mark.parametrize("kind,method", [("eagle2", "eagle2"), ("jakiro", "jakiro"), ("jakiro", "jakiro_star")])
def test_a_fused_head_drafts_from_the_targets_layers_and_decodes_what_plain_decoding_gives(target, kind, method):
    head = echoing(fused_head(target, kind))
    widths = []
    project = head.project_input
    head.project_input = lambda tokens, features, **kw: widths.append(features.shape[-1]) or project(tokens, features,
                                                                                                   **kw)
    assert head.feature_layers == tuple(LAYERS) and not reads_layers(DraftHead(DraftConfig.for_target(target.config)))
    for seed in (2, 7):
        ids = prompt(11, seed=seed)
        plain = speculative_generate(target, None, ids, 40).token_ids
        out = speculative_generate(target, head, ids, 40, method=method, tree=TreeConfig(16, 4, 4))
        assert out.token_ids == plain
        assert sum(out.stats.accept_lengths) > 0
    assert 3 * 64 in widths and 64 in widths  # committed tokens: the three layers; drafted ones: its own features


def test_the_training_forward_is_the_heads_layer_on_the_fused_features(target):
    """Step 0 of the fused head is the same head's layer fed ``hidden_norm(fuse(layers))`` in place
    of the final hidden state; a later unrolled step reads ``hidden_norm`` of its own [H] features,
    as drafting feeds it."""
    head = fused_head(target, "jakiro")
    plain = DraftHead(DraftConfig.for_target(target.config, "jakiro", num_experts=2, intermediate_size=64)).bind(target)
    with torch.no_grad():
        head.hidden_norm.weight.uniform_(0.5, 1.5)  # (not the identity: its place is checked)
    plain.load_state_dict({k: v for k, v in head.state_dict().items() if not k.startswith(("fuse.", "hidden_norm."))})
    ids = prompt(12, seed=9)
    _, layers = target(ids.unsqueeze(0), target.new_cache(1, ids.numel()), feature_layers=head.feature_layers)
    assert layers.shape == (1, 12, 3 * 64)
    with torch.no_grad():
        unrolled, again = [], []
        first = train_forward(head, ids[1:].unsqueeze(0), layers[:, :-1], unrolled)
        want = train_forward(plain, ids[1:].unsqueeze(0), head.hidden_norm(head.fuse(layers[:, :-1])), again)
        torch.testing.assert_close(first.feature, want.feature, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(first.contrastive_feature(), want.contrastive_feature(), atol=1e-5, rtol=1e-5)
        second = train_forward(head, torch.cat([ids[2:], ids[:1]]).unsqueeze(0), first.feature, unrolled)
        torch.testing.assert_close(second.feature, train_forward(plain, torch.cat([ids[2:], ids[:1]]).unsqueeze(0),
                                                                 head.hidden_norm(want.feature), again).feature,
                                   atol=1e-5, rtol=1e-5)


def examples_of(target, head, seqs, masks=None):
    """Examples labelled from the final hidden states (the target's distribution over the draft
    vocabulary, as ``train`` attaches them), then given the three layers as features."""
    out = []
    for i, ids in enumerate(seqs):
        _, final = target(ids.unsqueeze(0), target.new_cache(1, ids.numel()), last_logits_only=True)
        mask = torch.ones_like(ids, dtype=torch.bool) if masks is None else masks[i]
        out.append(Example(ids, final[0], mask))
    attach_target_probs(out, head, 8, progress=False)
    for ex, ids in zip(out, seqs):
        _, layers = target(ids.unsqueeze(0), target.new_cache(1, ids.numel()), feature_layers=head.feature_layers)
        ex.features = layers[0]
    return out


def test_the_loss_is_the_token_loss_of_every_step_and_the_contrastive_branch(target):
    head = fused_head(target, "jakiro")
    examples = examples_of(target, head, [prompt(10 + i, seed=20 + i) for i in range(3)])
    batch = collate(examples, 64)
    cfg = TrainConfig(ttt_steps=1, ttt_decay=0.5, w_token=0.1, w_token2=0.05)
    with torch.no_grad():
        loss, metrics = batch_loss(head, batch, cfg)
    rows = scored_rows(batch, cfg, True)
    want = 0.0
    for s, step in unroll(head, batch, 2):
        for ahead, feature, weight in ((1, step.for_lm_head, 1.0), (2, step.contrastive_feature(), 0.5)):
            name = f"acc{s + ahead}" + ("_contrastive" if ahead == 2 else "")
            for b, ex in enumerate(examples):
                for i in range(ex.tokens.numel() - s - ahead - 1):
                    q = torch.log_softmax(feature[b, i] @ head.lm_head_weight.T, -1)
                    p = ex.top_probs.probs[i + s + ahead].float()
                    want += 0.5 ** s * weight * -(p * q[ex.top_probs.ids[i + s + ahead].long()]).sum() / rows[name]
    torch.testing.assert_close(loss, torch.as_tensor(want, dtype=loss.dtype), atol=1e-4, rtol=1e-4)
    assert set(metrics) == {"hits_acc1", "hits_acc2", "hits_acc2_contrastive", "hits_acc3_contrastive"}
    with pytest.raises(ValueError, match="attach them to the examples first"):
        batch_loss(head, collate([Example(e.tokens, e.features, e.loss_mask) for e in examples], 64), cfg)


def test_a_short_run_learns_the_targets_next_tokens(target):
    """Sequences the target wrote (a prompt, then its greedy answer): after a short run the fused
    Jakiro head's draft token, and its contrastive branch's, are the answer's far more often."""
    head = fused_head(target, "jakiro", std=0.02)
    seqs, masks = [], []
    for i in range(8):
        ids = prompt(8, seed=40 + i)
        seqs.append(torch.cat([ids, torch.tensor(speculative_generate(target, None, ids, 16).token_ids)]))
        masks.append(torch.arange(seqs[-1].numel()) >= ids.numel())
    examples = examples_of(target, head, seqs, masks)
    cfg = TrainConfig(ttt_steps=1)
    before, losses, after = train_briefly(head, examples, cfg)
    assert losses[-1] < 0.7 * losses[0], losses[::10]
    assert after["acc1"] > before["acc1"] + 0.2 and after["acc2"] > before["acc2"], (before, after)
    assert after["acc2_contrastive"] > before["acc2_contrastive"], (before, after)


def test_saved_and_loaded_in_this_packages_format_only(target, tmp_path):
    head = fused_head(target, "jakiro")
    head.save(tmp_path / "fused")
    assert json.loads((tmp_path / "fused" / "config.json").read_text())["feature_layers"] == LAYERS
    back = DraftHead.load(tmp_path / "fused", target)
    assert back.config == head.config and back.feature_layers == tuple(LAYERS)
    for k, v in head.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    # A head reading the final hidden state writes the config it always wrote.
    DraftHead(DraftConfig.for_target(target.config)).save(tmp_path / "top")
    assert "feature_layers" not in json.loads((tmp_path / "top" / "config.json").read_text())
    assert DraftHead.load(tmp_path / "top", target).feature_layers is None
    eagle = fused_head(target, "eagle2")
    with pytest.raises(ValueError, match=r"reads target layers \[2, 3, 5\] fused, which the eagle format cannot say"):
        eagle.save(tmp_path / "eagle", format="eagle")
    with pytest.raises(ValueError, match=r"serving format holds heads reading the target's final hidden state"):
        head.save(tmp_path / "serving", format="serving")


def test_bad_feature_layers_are_refused(target, tmp_path):
    with pytest.raises(ValueError, match=r"0..6, 6: after the last"):
        fused_head(target, "jakiro", layers=[2, 3, 7])
    for layers, kind in (([2, 3], "jakiro"), ([2, -1, 3], "eagle2"), ([2, 3, 4], "gumiho")):
        with pytest.raises(ValueError, match="three target layer ids >= 0 of a one-layer head without MLP heads"):
            DraftConfig.for_target(target.config, kind, feature_layers=layers)
    assert DraftConfig.for_target(target.config, feature_layers=(2, 3, 4)).feature_layers == [2, 3, 4]
    with pytest.raises(ValueError, match="init_from_target starts a head as the target's last layer"):
        fused_head(target, "eagle2").init_from_target(target)
    # Given final hidden states, a fused head's training and evaluation refuse them (its fuse skipped).
    ids = prompt(9, seed=1)
    _, final = target(ids.unsqueeze(0), target.new_cache(1, 9), last_logits_only=True)
    with pytest.raises(ValueError, match=r"reads target layers \[2, 3, 5\]: step 0's features must be \[..., 192\]"):
        evaluate(fused_head(target, "jakiro"), [Example(ids, final[0], torch.ones(9, dtype=torch.bool))], TrainConfig())
    fused_head(target, "jakiro", layers=[2, 6, 6])  # (layer L: the stream after the last)
    head = fused_head(target, "jakiro")
    head.save(tmp_path / "h")
    config = json.loads((tmp_path / "h" / "config.json").read_text())
    for bad, says in (([2, 3], "three target layer ids"), ([2, -1, 3], "three target layer ids"),
                      ([2, 3.0, 4], "must be a JSON list of ints"), ("2,3,4", "must be a JSON list of ints")):
        (tmp_path / "h" / "config.json").write_text(json.dumps({**config, "feature_layers": bad}))
        with pytest.raises(ValueError, match=says):
            DraftHead.load(tmp_path / "h")
    with pytest.raises(ValueError, match="one-layer head without MLP heads"):
        (tmp_path / "h" / "config.json").write_text(json.dumps({**config, "num_mlp_heads": 2}))
        DraftHead.load(tmp_path / "h")
