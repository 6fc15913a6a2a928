"""Training an EAGLE-3 head: its differentiable forward against EAGLE-3's layer in plain PyTorch
(step 0 over the target's three layers, an unrolled step over its own outputs, as drafting feeds
it), the token-only loss with the target's distributions as labels, and a short run that learns."""
import pytest
import torch

from helpers import train_briefly, eagle3_reference, prompt, six_layer_target, write_eagle3
from jakiro_ext.engine.generate import speculative_generate
from jakiro_ext.models.heads.draft_head import DraftHead
from jakiro_ext.models.llama import as_target
from jakiro_ext.training import eagle3
from jakiro_ext.training.examples import Example, collate
from jakiro_ext.training.features import attach_target_probs
from jakiro_ext.training.loss import batch_loss, scored_rows, unroll
from jakiro_ext.training.settings import TrainConfig


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = tmp_path_factory.mktemp("e3") / "head"
    hf = six_layer_target()
    target = as_target(hf)
    state = write_eagle3(path, layers=[2, 3, 5], seed=4)
    head = DraftHead.load(path, target)
    return target, head, state


def layers_of(target, head, ids):
    _, aux = target(ids.unsqueeze(0), target.new_cache(1, ids.numel()), feature_layers=head.feature_layers)
    return aux[0]


def test_the_training_forward_is_eagle3s_layer_at_every_unrolled_step(setup):
    target, head, state = setup
    ids = prompt(12, seed=9)
    n = ids.numel() - 1
    aux = layers_of(target, head, ids)
    embed = target.embed_tokens.weight.detach()
    unrolled = []
    with torch.no_grad():
        first = eagle3.train_forward(head, ids[1:].unsqueeze(0), aux[:n].unsqueeze(0), unrolled)
        second = eagle3.train_forward(head, torch.cat([ids[2:], ids[:1]]).unsqueeze(0), first.feature, unrolled)
    out, logits = eagle3_reference(state, embed, ids[1:], aux[:n])
    torch.testing.assert_close(first.feature[0], out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(first.for_lm_head[0] @ head.lm_head.weight.T, logits, atol=1e-4, rtol=1e-4)
    # Step 1, row i: the token x_{i+2} at position i + 1 with step 0's output at row i as its
    # hidden state, seeing step 0's rows 0..i: the layer over the prefix plus one drafted row.
    for i in range(n - 1):
        ref, ref_logits = eagle3_reference(state, embed, ids[1: i + 3], aux[: i + 1], own=out[i: i + 1])
        torch.testing.assert_close(second.feature[0, i], ref[-1], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(second.for_lm_head[0, i] @ head.lm_head.weight.T, ref_logits[-1], atol=1e-4, rtol=1e-4)


def examples_of(target, head, seqs):
    """Examples with the labels from the final hidden states (the target's distribution over the
    head's draft vocabulary: a head whose LM head is still the target's rows gives them, as in
    ``train``), then the three layers as features."""
    out = []
    for ids in seqs:
        _, final = target(ids.unsqueeze(0), target.new_cache(1, ids.numel()), last_logits_only=True)
        out.append(Example(ids, final[0], torch.ones_like(ids, dtype=torch.bool)))
    labeller = eagle3.init_weights(type(head)(head.config)).bind(target)
    labeller.draft_to_target.copy_(head.draft_to_target)
    eagle3.init_lm_head(labeller, target.lm_head.weight.detach()[head.draft_to_target])
    attach_target_probs(out, labeller, 8, progress=False)
    for ex, ids in zip(out, seqs):
        ex.features = layers_of(target, head, ids)
    return out


def test_the_loss_is_the_cross_entropy_against_the_targets_distribution(setup):
    target, head, _ = setup
    seqs = [prompt(10 + i, seed=20 + i) for i in range(3)]
    examples = examples_of(target, head, seqs)
    assert examples[0].top_probs.probs.shape == (10, 8)
    torch.testing.assert_close(examples[0].top_probs.probs.float().sum(-1), torch.ones(10), atol=2e-3, rtol=0)
    batch = collate(examples, 64)
    cfg = TrainConfig(ttt_steps=1, ttt_decay=0.5)
    with torch.no_grad():
        loss, metrics = batch_loss(head, batch, cfg)
    # By hand: each step's rows with a next token, -sum p log q over the kept top tokens.
    want, steps = 0.0, list(unroll(head, batch, 2))
    for s, step in steps:
        for b, ex in enumerate(examples):
            L = ex.tokens.numel()
            for i in range(L - s - 2):
                q = torch.log_softmax(step.for_lm_head[b, i] @ head.lm_head.weight.T, -1)
                p = ex.top_probs.probs[i + s + 1].float()
                want += 0.5 ** s * -(p * q[ex.top_probs.ids[i + s + 1].long()]).sum() / scored_rows(batch, cfg, False)[f"acc{s + 1}"]
    torch.testing.assert_close(loss, torch.as_tensor(want, dtype=loss.dtype), atol=1e-4, rtol=1e-4)
    assert set(metrics) == {"hits_acc1", "hits_acc2"}
    with pytest.raises(ValueError, match="attach them to the examples first"):
        batch_loss(head, collate([Example(e.tokens, e.features, e.loss_mask) for e in examples], 64), cfg)


def test_a_short_run_learns_the_targets_next_tokens(tmp_path):
    """Sequences the target wrote (a prompt, then its greedy answer: what a corpus holds), a head
    over the whole vocabulary: after a short run its draft token is the answer's far more often."""
    target = as_target(six_layer_target())
    write_eagle3(tmp_path / "e3", layers=[2, 3, 5], draft_ids=torch.arange(211))
    like = DraftHead.load(tmp_path / "e3", target)
    seqs, masks = [], []
    for i in range(8):
        ids = prompt(8, seed=40 + i)
        answer = speculative_generate(target, None, ids, 16).token_ids
        seqs.append(torch.cat([ids, torch.tensor(answer)]))
        masks.append(torch.arange(seqs[-1].numel()) >= ids.numel())
    examples = examples_of(target, like, seqs)
    for ex, mask in zip(examples, masks):
        ex.loss_mask = mask
    head = eagle3.init_weights(type(like)(like.config), seed=1).bind(target)
    eagle3.init_lm_head(head, target.lm_head.weight.detach())
    cfg = TrainConfig(ttt_steps=1)
    before, losses, after = train_briefly(head, examples, cfg)
    assert losses[-1] < 0.7 * losses[0], losses[::10]  # (its floor: the labels' own entropy)
    assert after["acc1"] > before["acc1"] + 0.2 and after["acc2"] > before["acc2"], (before, after)
    with pytest.raises(ValueError, match=r"must be \[211, 64\]"):
        eagle3.init_lm_head(head, target.lm_head.weight.detach()[:5])


def test_layer_l_is_the_stream_after_the_last_layer(setup):
    """Feature layer L (the target's number of layers): the residual stream after its last layer,
    before the final norm, so that the same EAGLE-3 head can read the top feature alone (layers
    L, L, L: the ablation of the three-layer fusion at equal parameters)."""
    target, head, _ = setup
    L = target.config.num_layers
    ids = prompt(12, seed=3)
    _, top = target(ids.unsqueeze(0), target.new_cache(1, ids.numel()), feature_layers=(L,))
    _, final = target(ids.unsqueeze(0), target.new_cache(1, ids.numel()), last_logits_only=True)
    torch.testing.assert_close(target.norm(top), final, atol=1e-5, rtol=1e-5)
    _, both = target(ids.unsqueeze(0), target.new_cache(1, ids.numel()), feature_layers=(2, L, L))
    torch.testing.assert_close(both[..., 64:], torch.cat([top, top], -1), atol=0, rtol=0)
    head.check_target(target)  # (its layers 2, 3, 5 of 6)
    with pytest.raises(ValueError, match=r"\(0..6, 6: after the last\), got feature layers \[2, 3, 7\]"):
        type(head)(type(head.config)(**{**head.config.__dict__, "feature_layers": [2, 3, 7]})).check_target(target)

