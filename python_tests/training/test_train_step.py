"""The cheaper training step: bf16 products with fp32 master weights (chosen by the CPU's
native bf16 support), the MoE's experts as grouped products, the token loss's target
distributions computed once and cached, and the head started from the target's last layer."""
import pytest
import torch

from jakiro_ext import ops
from jakiro_ext.models.heads.config import DraftConfig
from jakiro_ext.models.heads.draft_head import DraftHead
from jakiro_ext.training.settings import TrainConfig, compute_dtype
from jakiro_ext.training.loss import batch_loss, target_top_probs
from jakiro_ext.training.examples import collate
from jakiro_ext.training.train import train_head
from jakiro_ext.training.features import attach_target_probs
from jakiro_ext.training.feature_cache import target_probs_file
from jakiro_ext.training.head_forward import routed_experts, train_forward
from helpers import make_examples



@pytest.fixture(scope="module")
def examples(target):
    return make_examples(target)


def head_of(target, kind, **kw):
    config = DraftConfig.for_target(target.config, kind, num_experts=4, intermediate_size=32, **kw)
    return DraftHead(config).init_weights(0).bind(target)


def test_compute_dtype_follows_the_cpus_native_bf16(monkeypatch):
    assert compute_dtype("float32", "cpu") == torch.float32
    assert compute_dtype("bfloat16", "cpu") == torch.bfloat16
    assert compute_dtype("auto", "cpu") == (torch.bfloat16 if ops.cpu_bf16_dot() else torch.float32)
    monkeypatch.setattr(ops, "cpu_bf16_dot", lambda: False)
    assert compute_dtype("auto", "cpu") == torch.float32  # without native bf16 it would only convert
    assert compute_dtype("auto", "cuda") == torch.bfloat16
    with pytest.raises(ValueError, match=r"compute_dtype must be one of \('auto', 'float32', 'bfloat16'\), got 'fp16'"):
        compute_dtype("fp16", "cpu")
    with pytest.raises(ValueError, match="compute_dtype must be one of"):
        train_head(DraftHead(DraftConfig(8, 10, 2, 1, 4, 8)), [None], TrainConfig(compute_dtype="half"))


def flat_grad(head):
    return torch.cat([p.grad.flatten() for p in head.parameters() if p.grad is not None])


@pytest.mark.parametrize("kind", ["eagle2", "jakiro", "gumiho"])
def test_bf16_step_follows_the_fp32_step(target, examples, kind):
    """Under autocast the loss and the gradient are the fp32 step's to bf16 rounding, and the
    weights, their gradients and the residual stream stay fp32."""
    cfg = TrainConfig(ttt_steps=1)
    batch = collate(examples[:4], 512)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        head = head_of(target, kind)
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            loss, _ = batch_loss(head, batch, cfg)
            step = train_forward(head, batch.tokens[:, 1:], batch.features[:, :-1])
        loss.backward()
        assert all(p.dtype == torch.float32 and (p.grad is None or p.grad.dtype == torch.float32)
                   for p in head.parameters())
        assert step.feature.dtype == step.residual.dtype == torch.float32
        out[dtype] = float(loss.detach()), flat_grad(head)
    (l32, g32), (l16, g16) = out[torch.float32], out[torch.bfloat16]
    assert abs(l16 - l32) < 0.02 * abs(l32)
    assert torch.nn.functional.cosine_similarity(g16, g32, dim=0) > 0.99
    assert not torch.equal(g16, g32)  # (the products did run in bf16)


def test_grouped_experts_compute_each_rows_two_experts(target):
    head = head_of(target, "jakiro")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(37, target.config.hidden_size, generator=g, requires_grad=True)
    idx = torch.stack([torch.randint(0, 3, (37,), generator=g), torch.full((37,), 3)], -1)  # expert 3: slot 1 only
    idx[5] = torch.tensor([3, 0])
    out = routed_experts(head, x, idx)
    assert out.shape == (37, 2, target.config.hidden_size)
    F = torch.nn.functional
    for r in range(37):
        for s in range(2):
            j = int(idx[r, s])
            want = F.linear(F.silu(F.linear(x[r], head.w_gate[j])) * F.linear(x[r], head.w_up[j]), head.w_down[j])
            torch.testing.assert_close(out[r, s], want, atol=1e-5, rtol=1e-5)
    out.square().sum().backward()
    assert x.grad is not None and bool(x.grad.abs().sum() > 0)
    assert all(bool(head.w_gate.grad[j].abs().sum() > 0) for j in range(4))
    # No row routed to an expert: its gradient is zero, the rest unchanged.
    head.zero_grad()
    routed_experts(head, x, torch.zeros(37, 2, dtype=torch.int64)).sum().backward()
    assert bool(head.w_gate.grad[0].abs().sum() > 0) and not head.w_gate.grad[1:].any()


def test_cached_target_distributions_are_the_computed_ones(target, examples, tmp_path, capsys):
    head = head_of(target, "jakiro")
    shard = [type(ex)(ex.tokens, ex.features, ex.loss_mask, i, "shard-00000.npz") for i, ex in enumerate(examples)]
    attach_target_probs(shard, head, 8, tmp_path, progress=False)
    file = target_probs_file(tmp_path, "shard-00000.npz", head, 8)
    assert file.exists() and file.name.startswith("shard-00000.top8-")
    for ex in shard:
        want = target_top_probs(head, ex.features.float(), 8)
        assert torch.equal(ex.top_probs.ids.long(), want.ids)
        torch.testing.assert_close(ex.top_probs.probs.float(), want.probs, atol=1e-3, rtol=1e-3)
    # The loss with the cached distributions is the loss computing them.
    cfg = TrainConfig(token_loss_top=8, compute_dtype="float32", noise=0.0)
    cached = collate(shard[:3], 512)
    assert cached.probs is not None
    computed = collate(examples[:3], 512)
    assert computed.probs is None
    torch.testing.assert_close(batch_loss(head, cached, cfg)[0], batch_loss(head, computed, cfg)[0], atol=1e-4, rtol=1e-3)
    with pytest.raises(ValueError, match="cached target probabilities keep 8 tokens, the recipe 32"):
        batch_loss(head, cached, TrainConfig(token_loss_top=32))
    # A second run reads the cache (nothing is computed) ...
    import jakiro_ext.training.features as features_module

    def fail(*a, **k):
        raise AssertionError("computed again")
    original = features_module.target_top_probs
    features_module.target_top_probs = fail
    try:
        again = [type(ex)(ex.tokens, ex.features, ex.loss_mask, ex.conversation, ex.shard) for ex in shard]
        attach_target_probs(again, head, 8, tmp_path, progress=False)
        assert all(torch.equal(a.top_probs.probs, b.top_probs.probs) for a, b in zip(again, shard))
    finally:
        features_module.target_top_probs = original
    # ... another draft vocabulary or other tokens are computed anew, a damaged file with a warning.
    stale = [type(ex)(ex.tokens.flip(0), ex.features, ex.loss_mask, ex.conversation, ex.shard) for ex in shard]
    attach_target_probs(stale, head, 8, tmp_path, progress=False)
    torch.testing.assert_close(stale[0].top_probs.probs.float(), target_top_probs(head, stale[0].features.float(), 8).probs,
                               atol=1e-3, rtol=1e-3)
    file.write_bytes(b"garbage")
    attach_target_probs(shard, head, 8, tmp_path, progress=False)
    assert "is damaged" in capsys.readouterr().err and file.stat().st_size > 100
    # Examples without a shard are computed in memory, nothing written.
    loose = make_examples(target, 2)
    before = sorted(p.name for p in tmp_path.iterdir())
    attach_target_probs(loose, head, 8, None, progress=False)
    assert all(ex.top_probs is not None for ex in loose) and sorted(p.name for p in tmp_path.iterdir()) == before


def test_training_with_cached_distributions_learns_as_without(target, examples):
    """The same steps with the distributions cached or computed at every step: the same history
    to fp16 rounding of the soft labels."""
    cfg = TrainConfig(steps=6, lr=3e-3, warmup_steps=2, batch_sequences=3, compute_dtype="float32")
    runs = []
    for cached in (False, True):
        head = head_of(target, "eagle2")
        data = [type(ex)(ex.tokens, ex.features, ex.loss_mask, ex.conversation) for ex in examples]
        if cached:
            attach_target_probs(data, head, cfg.token_loss_top, None, progress=False)
        runs.append([r["loss"] for r in train_head(head, data, cfg)])
    torch.testing.assert_close(torch.tensor(runs[1]), torch.tensor(runs[0]), atol=1e-3, rtol=1e-3)
    assert runs[0][-1] < runs[0][0]


@pytest.mark.parametrize("kind,layers", [("eagle2", 1), ("eagle2", 2), ("jakiro", 1)])
def test_init_from_target_copies_its_last_layers(target, kind, layers):
    t = target.config
    width = t.intermediate_size // (4 if kind == "jakiro" else 1)
    config = DraftConfig.for_target(t, kind, num_experts=4, intermediate_size=width, num_layers=layers)
    head = DraftHead(config).init_weights(0).init_from_target(target).bind(target)
    last = target.layers[-1]
    mine = head.layers[-1] if layers > 1 else head
    q = t.num_heads * t.head_dim
    assert torch.equal(mine.q_proj.weight, last.self_attn.qkv_proj.weight[:q])
    assert torch.equal(mine.o_proj.weight, last.self_attn.o_proj.weight)
    gate = last.gate_up_proj.weight[: t.intermediate_size]
    if kind == "jakiro":
        assert torch.equal(head.w_gate.flatten(0, 1), gate)
        assert torch.equal(torch.cat(list(head.w_down), 1), last.down_proj.weight)
    else:
        assert torch.equal(mine.gate_proj.weight, gate)
    if layers > 1:
        assert torch.equal(head.q_proj.weight, target.layers[-2].self_attn.qkv_proj.weight[:q])
    # fc passes the feature through: the serial layers start from f_t itself.
    f = torch.randn(2, 5, t.hidden_size)
    torch.testing.assert_close(head.project_input(torch.randint(0, t.vocab_size, (2, 5)), f, train=True), f)
    narrow = DraftHead(DraftConfig.for_target(t, "eagle2", intermediate_size=8))
    with pytest.raises(ValueError, match=rf"MLP \(1 x 8\) is not the target's \({t.intermediate_size}\) wide"):
        narrow.init_from_target(target)


def test_evaluations_at_every_doubling_of_the_tokens_seen(target, examples):
    """``eval_doublings``: the held-out evaluation runs when the tokens seen first reach N, 2N,
    4N, ... (and at the end); every record counts the tokens seen so far."""
    cfg = TrainConfig(steps=10, lr=3e-3, warmup_steps=2, batch_sequences=2, eval_doublings=50)
    history = train_head(head_of(target, "eagle2"), examples, cfg, examples[:2])
    seen = [r["tokens_seen"] for r in history]
    from jakiro_ext.training.train import shuffled_batches
    first = shuffled_batches(examples, cfg, 0)[0]
    assert seen[0] == sum(examples[i].tokens.numel() for i in first)
    assert all(b > a for a, b in zip(seen, seen[1:]))
    evaluated = [r["tokens_seen"] for r in history if "eval_acc1" in r]
    marks = [50 * 2 ** k for k in range(8) if 50 * 2 ** k <= seen[-1]]
    want = sorted({next(s for s in seen if s >= m) for m in marks} | {seen[-1]})
    assert evaluated == want and len(want) >= 3


def test_a_short_run_reaches_its_peak_learning_rate(target, examples):
    # 30 steps with the CLI's 50 warm-up steps: the warm-up is fitted to a tenth of the run (never
    # under 10 steps), so the peak rate is reached, then the cosine decay runs to the end.
    cfg = TrainConfig(steps=30, lr=2e-3, warmup_steps=50, batch_sequences=2, compute_dtype="float32")
    lrs = [r["lr"] for r in train_head(head_of(target, "eagle2"), examples, cfg)]  # (each the next step's rate)
    assert lrs[:10] == pytest.approx([2e-3 * min(s + 2, 10) / 10 for s in range(10)])
    assert max(lrs) == pytest.approx(2e-3) and lrs[-1] < 1e-4 and all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
