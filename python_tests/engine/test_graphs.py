"""Capture and replay of a round's device work (issue 15: CUDA graphs). The ``"recorded"`` mode
replays the captured ops with the rules of a CUDA graph on the CPU, so these tests hold the
engine's captured round to them without a GPU: the same tokens as eager decoding for every
method and tree shape, greedy and sampling, with continuous batching, and a negative control
that shows a host value baked into the capture is caught. On a CUDA device the ``"cuda"`` mode
runs the same tests."""
import copy
import gc
import weakref

import pytest
import torch

from jakiro_ext.engine import graphs
from jakiro_ext.engine.generate import generate_many, speculative_generate
from jakiro_ext.models import llama
from helpers import PROMPTS
from helpers import DYNAMIC_ONLY, HEAD_METHODS, JAKIRO_PROFILE, TREES, copy_head, sharp_target, tiny_target

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
        for i, layer in enumerate([head, *(head.layers if getattr(head.config, "num_layers", 1) > 1 else ())]):
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


@pytest.mark.parametrize("mode", MODES)
def test_a_captured_round_commits_and_catches_the_draft_up_in_its_capture(target, mode, monkeypatch):
    """A graphed round is one replay: its commit and the draft's catch-up (padded to the tree's
    longest path) are in its capture, so no draft forward runs outside the captures but the
    prompts' (the tokens and accept lengths equal the eager ones: test above), and after every
    round each cache's lengths on the host equal those on the device."""
    from jakiro_ext.engine.drafter import Drafter
    from jakiro_ext.engine.round import Round
    forwards, agree = [], []
    catch_up, run = Drafter.catch_up, Round.run
    monkeypatch.setattr(Drafter, "catch_up", lambda self, *args: (forwards.append(1), catch_up(self, *args))[1])

    def checked(self, state, *args, **kwargs):
        result = run(self, state, *args, **kwargs)
        agree.extend(cache.lengths.tolist() == cache.host_lengths for cache in (state.target_kv, state.draft_kv)
                     if cache is not None)
        return result
    monkeypatch.setattr(Round, "run", checked)
    made = _count_captures(monkeypatch)
    target, head = _placed(target, attentive_head(target, "jakiro"), mode)
    kwargs = dict(method="jakiro", tree=TREES["dynamic-small"])
    replayed = speculative_generate(target, head, PROMPTS[:3], 40, graphs=mode, **kwargs)
    assert len(made) > 5 and sum(made) >= 1 and all(agree) and len(agree) == 2 * len(made)
    runs = 2 if mode == "cuda" else 1  # (a CUDA graph's capture runs the function twice: a warm-up, the capture)
    assert len(forwards) == len(PROMPTS[:3]) + runs * sum(made)  # (a prompt of up to PREFILL_CHUNK tokens: one forward)
    monkeypatch.undo()
    assert [r.token_ids for r in replayed] == [speculative_generate(target, None, p, 40).token_ids for p in PROMPTS[:3]]


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


# ---------------------------------------------------------------- what a graphed call keeps for the next

def test_a_capture_reads_in_place_changes_and_is_made_again_when_what_it_reads_is_let_go():
    class Owner:
        pass
    owner = Owner()
    owner.table = torch.arange(4.0)

    def fn(x):  # reads an external table, and a tensor it makes itself outside the dispatcher
        return (x * 2 + owner.table.sum() + torch.tensor([100.0]),), None
    replay = graphs.Replay(fn, "recorded")
    assert replay("k", [torch.tensor([1.0])])[0][0].tolist() == [108.0]
    assert replay("k", [torch.tensor([2.0])])[0][0].tolist() == [110.0] and replay.captures == 1
    (captured,) = replay.kept.values()
    assert [ref() is owner.table for ref in captured._refs] == [True]  # the table alone is watched
    owner.table.add_(1)  # changed in place: read by the replay
    assert replay("k", [torch.tensor([2.0])])[0][0].tolist() == [114.0] and replay.captures == 1
    owner.table = torch.zeros(4)  # let go: the capture is stale (a CUDA graph would read freed memory)
    assert captured.stale
    assert replay("k", [torch.tensor([2.0])])[0][0].tolist() == [104.0] and replay.captures == 2


def test_a_replay_keeps_a_bounded_number_of_captures():
    replay = graphs.Replay(lambda x: ((x + 1,), None), "recorded")
    for key in range(graphs.KEPT_CAPTURES + 3):
        replay(key, [torch.tensor([1.0])])
    assert len(replay.kept) == graphs.KEPT_CAPTURES and list(replay.kept)[0][0] == 3  # the oldest let go
    replay(3, [torch.tensor([1.0])])  # kept: replayed
    assert replay.captures == graphs.KEPT_CAPTURES + 3 and list(replay.kept)[-1][0] == 3


def test_the_buffer_pool_hands_back_buffers_of_the_shape_zeroed_and_bounded():
    from jakiro_ext.kv_cache import BufferPool, CacheShape, KVCache
    pool = BufferPool(most=3, quantum=16)
    shape = CacheShape(2, 1, 4)
    cache = KVCache(shape, 2, 5, max_capacity=40, pool=pool)
    assert cache.capacity == 16 and cache.max_capacity == 48  # rounded up to the quantum
    first_kv, first_lengths = cache.kv, cache.lengths
    cache.kv.fill_(7.0)
    cache.commit(3)
    cache.reserve(17)  # grows (to twice: 32): the old buffer goes to the pool
    assert cache.capacity == 32 and pool.take(first_kv.shape, first_kv.dtype, "cpu") is first_kv
    assert not first_kv.any()  # (zeroed when taken)
    assert torch.equal(cache.kv[..., :3, :], torch.full_like(cache.kv[..., :3, :], 7.0))
    cache.release()
    again = KVCache(shape, 2, 20, max_capacity=40, pool=pool)  # the same shape: the same buffers
    assert again.kv.data_ptr() == cache.kv.data_ptr() and again.lengths is first_lengths and not again.kv.any()
    assert KVCache(shape, 2, 20, max_capacity=40, pool=pool).kv.data_ptr() != again.kv.data_ptr()  # none left: made
    assert KVCache(shape, 3, 5, pool=pool).kv.shape[2] == 3  # another batch: made
    for _ in range(5):
        pool.give(torch.ones(2, 2, 2, 1, 64, 4))
    pool.give(torch.ones(2, 2, 2, 1, 80, 4))
    assert sum(map(len, pool.kept.values())) == 3 and len(pool.kept[pool._key((2, 2, 2, 1, 80, 4), torch.float32,
                                                                              "cpu")]) == 1
    # The same capacities without a pool that keeps anything: a graphed call's caches are an eager one's.
    eager = KVCache(shape, 2, 5, max_capacity=40, pool=BufferPool(most=0, quantum=16))
    eager.reserve(17)
    assert eager.capacity == 32 and eager.max_capacity == 48
    # Rows selected into a kept buffer: the rows' keys and values as they were.
    rows = KVCache(shape, 3, 8, max_capacity=64, pool=pool)
    rows.kv.copy_(torch.randn(rows.kv.shape))
    rows.commit(5)
    before = rows.kv.clone()
    kept = torch.ones(2, 2, 2, 1, 16, 4)
    pool.give(kept)
    rows.select_rows([2, 0])
    assert rows.kv is kept and rows.host_lengths == [5, 5] and rows.lengths.tolist() == [5, 5]
    assert torch.equal(rows.kv, before[:, :, [2, 0]])
    # Within a sliding window, the rounding stops at the window.
    windowed = KVCache(CacheShape(2, 1, 4, sliding_window=20), 1, 5, max_capacity=18, pool=BufferPool(quantum=16))
    assert windowed.capacity == 16 and windowed.max_capacity == 20


def _count_captures(monkeypatch):
    made = []
    original = graphs.Replay.__call__

    def counting(self, key, inputs):
        before = self.captures
        result = original(self, key, inputs)
        made.append(self.captures - before)
        return result
    monkeypatch.setattr(graphs.Replay, "__call__", counting)
    return made


KEPT_CASES = [("jakiro", "jakiro", "dynamic-small"), ("eagle2", "eagle2", "static")]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind,method,tree", KEPT_CASES, ids=[c[1] for c in KEPT_CASES])
def test_a_second_graphed_call_replays_the_first_calls_captures(target, kind, method, tree, mode, monkeypatch):
    from jakiro_ext.engine import graph_sessions
    target, head = _placed(target, attentive_head(target, kind), mode)
    made = _count_captures(monkeypatch)
    kwargs = dict(method=method, tree=TREES[tree])
    calls = {"one prompt": lambda **kw: [speculative_generate(target, head, PROMPTS[1], 300, **kwargs, **kw)],
             "a batch": lambda **kw: speculative_generate(target, head, PROMPTS[:3], 40, **kwargs, **kw),
             "continuous batching": lambda **kw: [out for _, out in sorted(generate_many(
                 target, head, iter(PROMPTS), 3, 40, **kwargs, **kw))]}
    for name, call in calls.items():
        eager = call()
        made.clear()
        first = call(graphs=mode)  # (a batch's session serves the continuous batching of as many rows)
        assert sum(made) >= (name != "continuous batching"), name
        for _ in range(2):
            made.clear()
            again = call(graphs=mode)
            assert sum(made) == 0 and len(made) > 5, name  # (the one-prompt call grows its caches: captured again at first)
            assert all(_same(a, b) for a, b in zip(eager, again)) and all(_same(a, b) for a, b in zip(eager, first)), name
    assert len(target.__dict__["_graph_sessions"]) == graph_sessions.KEPT_SESSIONS
    assert not copy.deepcopy(target).__dict__["_graph_sessions"]  # a copy starts without them
    graph_sessions.free_graphs(target)
    assert not target.__dict__["_graph_sessions"]
    speculative_generate(target, head, PROMPTS[1], 8, **kwargs)
    assert not target.__dict__["_graph_sessions"]  # an eager call keeps nothing


def test_a_second_graphed_call_with_the_tree_chosen_live_captures_nothing(target, tmp_path, monkeypatch):
    # The live choice runs each candidate (trees and plain decoding) as a capture of its own, at
    # each batch size a draining batch passes through: a session keeps KEPT_CAPTURES captures a
    # candidate, so the next such call replays every one of them.
    from jakiro_ext.engine import adaptive, policy
    monkeypatch.setenv("JAKIRO_CACHE", str(tmp_path))
    monkeypatch.setattr(policy, "_CHOOSERS", type(policy._CHOOSERS)())
    monkeypatch.setattr(policy, "CANDIDATES", 5)  # (trees of 5 sizes and plain decoding: 12 captures at 2 batch sizes)
    head = attentive_head(target, "jakiro")
    head.acceptance = JAKIRO_PROFILE
    ran = []

    def every_candidate(self, rows):  # (by the round within the call: the same choices in each call)
        ran.append((len(ran), rows))
        return self.candidates[len(ran) % len(self.candidates)]
    monkeypatch.setattr(adaptive.TreeChooser, "choose", every_candidate)
    made = _count_captures(monkeypatch)
    ends = [197, 208]  # (the first two prompts' answers end early, at different rounds: 3 rows, then 1)
    outs, captured = [], []
    for _ in range(2):
        ran.clear()
        made.clear()
        outs.append(speculative_generate(target, head, PROMPTS[:3], 40, method="jakiro", graphs="recorded",
                                         eos_token_id=ends))
        captured.append(sum(made))
    candidates = len(policy.tree_chooser(target, head, "jakiro", 3, graphs="recorded").candidates)
    assert {rows for _, rows in ran} == {3, 1} and captured[0] == 2 * candidates > graphs.KEPT_CAPTURES
    assert captured[1] == 0 and len(made) == len(ran)
    assert [o.token_ids for o in outs[0]] == [o.token_ids for o in outs[1]] == \
        [o.token_ids for o in speculative_generate(target, None, PROMPTS[:3], 40, eos_token_id=ends)]


def test_a_tree_changed_after_a_graphed_call_does_not_change_its_kept_session(target):
    """A session is found by its trees' values and its drafters serve later calls, so they draft
    from their own copies: a tree changed in place after a call (another shape: another session)
    leaves the first session drafting the first shape for a later call of an equal tree, when its
    longer caches are captured again (a replay runs what was recorded, not the drafter)."""
    head = attentive_head(target, "jakiro")
    tree = copy.deepcopy(TREES["dynamic-small"])
    eager = speculative_generate(target, head, PROMPTS[0], 400, method="jakiro", tree=copy.deepcopy(tree))
    speculative_generate(target, head, PROMPTS[0], 20, method="jakiro", tree=tree, graphs="recorded")
    tree.total_tokens = 2  # (a drafter reads it when a round is captured)
    speculative_generate(target, head, PROMPTS[0], 20, method="jakiro", tree=tree, graphs="recorded")
    again = speculative_generate(target, head, PROMPTS[0], 400, method="jakiro", tree=copy.deepcopy(TREES["dynamic-small"]),
                                 graphs="recorded")
    assert _same(eager, again)
    from jakiro_ext.engine import graph_sessions
    graph_sessions.free_graphs(target)


def test_a_kept_capture_is_made_again_when_a_table_it_reads_is_let_go(target, monkeypatch):
    head = attentive_head(target, "jakiro")
    made = _count_captures(monkeypatch)
    kwargs = dict(method="jakiro", tree=TREES["dynamic-small"])
    # (The eager call makes the rotary table the call needs, so the capture reads it as made before
    # it, as a CUDA graph's capture does after its warm-up: a recording without one makes it itself.)
    eager = speculative_generate(target, head, PROMPTS[0], 40, **kwargs)
    speculative_generate(target, head, PROMPTS[0], 40, graphs="recorded", **kwargs)
    table = target._rope_table.cos
    longer = PROMPTS[0].repeat(2 + table.shape[0] // len(PROMPTS[0]))[:table.shape[0] + 10]
    speculative_generate(target, None, longer, 2)
    assert target._rope_table.cos is not table  # the rotary table made again, larger: the old one let go
    made.clear()
    assert _same(eager, speculative_generate(target, head, PROMPTS[0], 40, graphs="recorded", **kwargs))
    assert sum(made) == 1  # captured again, not replayed
    # Negative control: a capture that watched nothing is replayed after the table is let go, and
    # its replay reads what is gone (here: a freed tensor is None; on a GPU, freed memory).
    monkeypatch.setattr(graphs._Capture, "watch", lambda self, externals: setattr(self, "_flag", [False]))
    from jakiro_ext.engine import graph_sessions
    graph_sessions.free_graphs(target)
    speculative_generate(target, head, PROMPTS[0], 40, graphs="recorded", **kwargs)
    target._rope_table.cos = target._rope_table.cos.clone()
    with pytest.raises(RuntimeError, match="tensor does not have a device"):  # (None where the table was)
        speculative_generate(target, head, PROMPTS[0], 40, graphs="recorded", **kwargs)
    graph_sessions.free_graphs(target)


def test_weights_changed_between_graphed_calls_are_read(monkeypatch):
    target = sharp_target()
    head = attentive_head(target, "eagle2")
    made = _count_captures(monkeypatch)
    kwargs = dict(method="eagle2", tree=TREES["dynamic-small"])

    def check(captures: int):
        eager = speculative_generate(target, head, PROMPTS[1], 40, **kwargs)
        made.clear()
        assert _same(eager, speculative_generate(target, head, PROMPTS[1], 40, graphs="recorded", **kwargs))
        assert sum(made) == captures
        return eager
    first = check(1)
    down = target.layers[-1].down_proj
    with torch.no_grad():  # in place, where the rounds read it: replayed
        down.weight.add_(torch.randn(down.weight.shape, generator=torch.Generator().manual_seed(5)) * 0.5)
    changed = check(0)
    down.weight = torch.nn.Parameter(down.weight.detach() * -1)
    replaced = check(1)  # another session, and the one of the old weights let go
    assert first.token_ids != changed.token_ids != replaced.token_ids  # (the changes count)
    assert len(target.__dict__["_graph_sessions"]) == 1
    monkeypatch.setenv("JAKIRO_GPU_TENSOR_CORES", "0")  # a switch the kernels read at launch: another session
    check(1)
    monkeypatch.delenv("JAKIRO_GPU_TENSOR_CORES")
    check(0)
    with torch.no_grad():
        head.o_proj.weight.mul_(-1)  # where drafting reads a copy of it: another session
    assert check(1).stats.accept_lengths != replaced.stats.accept_lengths


def test_a_call_in_flight_keeps_its_session_from_another_call(target):
    head = attentive_head(target, "jakiro")
    kwargs = dict(method="jakiro", tree=TREES["dynamic-small"])
    eager = dict(generate_many(target, head, iter(PROMPTS), 2, 40, **kwargs))
    paused = generate_many(target, head, iter(PROMPTS), 2, 40, graphs="recorded", **kwargs)
    got = dict([next(paused)])
    other = dict(generate_many(target, head, iter(PROMPTS), 2, 40, graphs="recorded", **kwargs))
    got.update(paused)
    assert all(_same(eager[i], got[i]) and _same(eager[i], other[i]) for i in eager)


def test_a_target_and_what_its_graphed_calls_kept_go_with_its_last_reference():
    # Without the cycle collector: nothing kept with the target points back at it, so its weights'
    # memory (and on a GPU the graphs') goes when the target does.
    gc.collect()
    gc.disable()
    try:
        target = sharp_target()
        head = attentive_head(target, "jakiro")
        speculative_generate(target, head, PROMPTS[0], 20, method="jakiro", tree=TREES["dynamic-small"],
                             graphs="recorded")
        assert target.__dict__["_graph_sessions"]
        weight = weakref.ref(target.layers[0].gate_up_proj.weight)
        del target, head
        assert weight() is None
    finally:
        gc.enable()
