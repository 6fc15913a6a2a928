"""Capture and replay of a round's device work (issue 15: CUDA graphs). The ``"recorded"`` mode
replays the captured ops with the rules of a CUDA graph on the CPU, so these tests hold the
engine's captured round to them without a GPU: the same tokens as eager decoding for every
method and tree shape, greedy and sampling, with continuous batching, and a negative control
that shows a host value baked into the capture is caught. On a CUDA device the ``"cuda"`` mode
runs the same tests."""
import copy

import pytest
import torch

from jakiro_ext.engine import graphs
from jakiro_ext.engine.generate import generate_many, speculative_generate
from jakiro_ext.models import llama
from helpers import PROMPTS
from helpers import DYNAMIC_ONLY, HEAD_METHODS, TREES, copy_head, sharp_target, tiny_target

MODES = ["recorded"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(scope="module")
def target():
    return sharp_target()


def attentive_head(target, kind):
    """A copy head whose draft attention counts (random o_proj; a copy head's is zero): its drafts
    depend on the draft cache's contents, lengths and positions, so a replay that bakes any of
    them in changes the drafts, and the accept lengths the tests compare."""
    head = copy_head(target, kind)
    with torch.no_grad():
        for i, layer in enumerate([head, *(head.layers if head.config.num_layers > 1 else ())]):
            layer.o_proj.weight.normal_(0, 0.1, generator=torch.Generator().manual_seed(i))
    return head


def _placed(target, head, mode):
    """The target and head on the mode's device (copies on CUDA)."""
    if mode != "cuda":
        return target, head
    on_gpu = copy.deepcopy(target).to("cuda")
    return on_gpu, None if head is None else copy.deepcopy(head).to("cuda").bind(on_gpu)


def test_a_replay_runs_the_recorded_ops_not_the_python():
    calls = []

    def fn(x):
        calls.append(1)
        return (x * 2 + len(calls),), len(calls)  # len(calls): a host value, fixed by the capture
    replay = graphs.Replay(fn, "recorded")
    (out,), host = replay("a", [torch.tensor([1.0])])
    assert out.tolist() == [3.0] and host == 1
    (out,), host = replay("a", [torch.tensor([5.0])])
    assert out.tolist() == [11.0] and host == 1 and len(calls) == 1  # new input, the capture's constant
    (out,), host = replay("b", [torch.tensor([5.0])])  # a new key captures anew
    assert out.tolist() == [12.0] and host == 2 and replay.captures == 2
    with pytest.raises(ValueError, match=r"graph mode must be one of \('cuda', 'recorded'\), got 'fast'"):
        graphs.Replay(fn, "fast")


def test_bad_graph_settings_are_clear_errors():
    model = tiny_target()
    with pytest.raises(ValueError, match=r"graphs must be one of \('eager', 'cuda', 'recorded'\), got 'yes'"):
        speculative_generate(model, None, PROMPTS[0], 4, graphs="yes")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"graphs='cuda' needs the target on a CUDA device, it is on cpu"):
            speculative_generate(model, None, PROMPTS[0], 4, graphs="cuda")


def _same(a, b) -> bool:
    return (a.token_ids == b.token_ids and a.stats.accept_lengths == b.stats.accept_lengths
            and a.stats.draft_forwards == b.stats.draft_forwards and a.stats.stop_reason == b.stats.stop_reason)


CASES = [(None, "ar", "dynamic-small")] + [(k, m, t) for k, m in HEAD_METHODS for t in TREES
                                           if not (m in DYNAMIC_ONLY and t == "static")]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind,method,tree", CASES, ids=[f"{m}-{k}-{t}" for k, m, t in CASES])
def test_replayed_rounds_give_the_eager_tokens(target, mode, kind, method, tree, monkeypatch):
    target, head = _placed(target, None if kind is None else attentive_head(target, kind), mode)
    captures = []
    original = graphs.Replay.__call__
    monkeypatch.setattr(graphs.Replay, "__call__",
                        lambda self, key, inputs: (captures.append(self.captures), original(self, key, inputs))[1])
    for temperature in (0.0, 1.0):
        kwargs = dict(method=method, tree=TREES[tree], temperature=temperature)
        eager = dict(generate_many(target, head, iter(PROMPTS), 3, 40, **kwargs))
        captures.clear()
        replayed = dict(generate_many(target, head, iter(PROMPTS), 3, 40, graphs=mode, **kwargs))
        assert all(_same(eager[i], replayed[i]) for i in range(len(PROMPTS))), (temperature, method, tree)
        assert len(captures) > 3 * captures[-1]  # most rounds were replays
        if kind is not None:  # drafts were accepted: the accept lengths compared above say something
            assert sum(sum(out.stats.accept_lengths) for out in eager.values()) > 0


def test_a_draft_position_baked_into_the_capture_changes_the_drafts(target, monkeypatch):
    """Negative control of the draft side: the draft's positions taken from its cache's host
    lengths (fixed at the capture) instead of the device's. Eager drafting does not see the
    difference; a replay drafts other trees (other accept lengths), though the tokens stay the
    target's."""
    from jakiro_ext.models.heads.draft_head import DraftHead

    forward = DraftHead.forward

    def host_positions(self, tokens, features, positions, cache, *args, **kwargs):
        baked = torch.tensor(cache.host_lengths).unsqueeze(1) + (positions - cache.lengths.unsqueeze(1))
        return forward(self, tokens, features, baked, cache, *args, **kwargs)
    monkeypatch.setattr(DraftHead, "forward", host_positions)
    head = attentive_head(target, "eagle2")
    kwargs = dict(method="eagle2", tree=TREES["dynamic-small"])
    eager = speculative_generate(target, head, PROMPTS[:3], 40, **kwargs)
    monkeypatch.setattr(DraftHead, "forward", forward)
    assert all(_same(a, b) for a, b in zip(eager, speculative_generate(target, head, PROMPTS[:3], 40, **kwargs)))
    monkeypatch.setattr(DraftHead, "forward", host_positions)
    replayed = speculative_generate(target, head, PROMPTS[:3], 40, graphs="recorded", **kwargs)
    plain = [speculative_generate(target, None, p, 40) for p in PROMPTS[:3]]
    assert all(r.token_ids == p.token_ids for r, p in zip(replayed, plain))  # still lossless
    assert any(not _same(r, e) for r, e in zip(replayed, eager))


def test_a_host_value_baked_into_the_capture_changes_the_tokens(target, monkeypatch):
    # Negative control: positions taken from the host's lengths (fixed at the capture) instead of
    # the device's. Eager decoding does not see the difference; a replay does.
    rope = llama.LlamaModel._rope
    forward = llama.LlamaModel.forward

    def remembers_cache(self, tokens, cache, *args, **kwargs):
        self.last_cache = cache
        return forward(self, tokens, cache, *args, **kwargs)

    def host_positions(self, positions, capacity):
        baked = torch.tensor(self.last_cache.host_lengths).unsqueeze(1) + positions * 0
        return rope(self, baked + positions - self.last_cache.lengths.unsqueeze(1), capacity)
    monkeypatch.setattr(llama.LlamaModel, "forward", remembers_cache)
    monkeypatch.setattr(llama.LlamaModel, "_rope", host_positions)
    head = copy_head(target, "jakiro")
    eager = speculative_generate(target, head, PROMPTS[:3], 40, method="jakiro", tree=TREES["dynamic-small"])
    plain = [speculative_generate(target, None, p, 40) for p in PROMPTS[:3]]
    assert all(e.token_ids == p.token_ids for e, p in zip(eager, plain))  # eager: the same positions
    replayed = speculative_generate(target, head, PROMPTS[:3], 40, method="jakiro", tree=TREES["dynamic-small"],
                                    graphs="recorded")
    assert any(r.token_ids != p.token_ids for r, p in zip(replayed, plain))
