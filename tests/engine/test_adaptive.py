"""Speculation that never loses: the live choice of each round's tree (TreeChooser) against
synthetic round timings, the draft's deferred catch-up after rounds of plain decoding, and the
engine with the live choice giving plain decoding's tokens."""
import pytest
import torch

from helpers import copy_head, prompt, tiny_target
from jakiro_ext.config import TreeConfig
from jakiro_ext.engine import adaptive, tree_cost
from jakiro_ext.engine.adaptive import Candidate, TreeChooser
from jakiro_ext.engine.drafter import Drafter
from jakiro_ext.engine.generate import speculative_generate
from jakiro_ext.engine.state import BatchState, Started
from jakiro_ext.methods import METHODS

BIG, SMALL, FAR = TreeConfig(16, 3, 4), TreeConfig(4, 2, 2), TreeConfig(32, 5, 4)


def candidates():
    # The cost model's view: BIG best, SMALL close behind, FAR far behind, plain decoding last.
    return [Candidate(BIG, 2.5, 0.020), Candidate(SMALL, 1.9, 0.017), Candidate(FAR, 2.6, 0.060),
            Candidate(None, 1.0, 0.012)]


def run(chooser, rounds, seconds_of=lambda c: c.expected_seconds, tokens_of=lambda c: c.expected_tokens, rows=1):
    """Drive the chooser with a live machine given as functions of the candidate; returns the trees run."""
    ran = []
    for _ in range(rounds):
        c = chooser.choose(rows)
        chooser.record(c, rows, seconds_of(c), tokens_of(c))
        ran.append(c.tree)
    return ran


def test_measures_plain_decoding_and_the_competitive_trees_first():
    chooser = TreeChooser(candidates(), batch=1)
    ran = run(chooser, 4, lambda c: c.expected_seconds)
    assert ran == [None, None, BIG, SMALL]  # FAR: a third of the best rate, never tried
    # The costs were right: the best from now on, and a probe of the close one PROBE_EVERY rounds
    # after it last ran (round 3).
    assert run(chooser, adaptive.PROBE_EVERY) == [BIG] * (adaptive.PROBE_EVERY - 1) + [SMALL]


def test_falls_back_to_plain_decoding_when_speculation_is_slower():
    # Costs measured on a loaded machine: every tree is three times slower than they said.
    chooser = TreeChooser(candidates(), batch=1)
    ran = run(chooser, 400, lambda c: c.expected_seconds * (3 if c.tree else 1))
    assert ran[-1] is None and ran[10:].count(None) / len(ran[10:]) > 0.97  # a probe now and then
    assert ran.count(FAR) <= 1  # far behind by the costs: only when stale


def test_a_close_tree_that_stays_behind_is_probed_less_and_less_often():
    # Live: SMALL 0.9x plain decoding's rate (close: probed), BIG and FAR far behind.
    chooser = TreeChooser(candidates(), batch=1)
    ran = run(chooser, 1000, lambda c: c.expected_seconds * (3 if c.tree in (BIG, FAR) else 1),
              tokens_of=lambda c: 1.0 if c.tree is None else 0.9 * c.expected_seconds / 0.012)
    runs = [i for i, tree in enumerate(ran) if tree is SMALL]
    gaps = [b - a for a, b in zip(runs, runs[1:]) if b - a > 1]  # (first a few rounds in a row: its prior)
    assert gaps[:3] == [adaptive.PROBE_EVERY, 2 * adaptive.PROBE_EVERY, 4 * adaptive.PROBE_EVERY]
    # Forgotten after FORGET_AFTER rounds, it is tried again for a few rounds (its tokens' prior is
    # the cost model's again): in all, under a tenth of the rounds at 0.9x.
    assert ran[100:].count(SMALL) < 0.1 * len(ran[100:]) and ran.count(BIG) + ran.count(FAR) <= 1


def test_a_forgotten_tree_keeps_its_live_estimate():
    # The cost model says BIG is the best by far; live it is three times slower. Forgotten after
    # FORGET_AFTER rounds, it is estimated from what it measured, not from the cost model: not run again
    # before its probe is due.
    chooser = TreeChooser(candidates()[:2] + candidates()[3:], batch=1)
    slow = lambda c: c.expected_seconds * (3 if c.tree is BIG else 1)
    run(chooser, 8, slow)
    big = chooser.candidates[0]
    assert big.seconds and big.forget_after > adaptive.FORGET_AFTER  # measured, far behind
    ran = run(chooser, 2 * big.forget_after + 1, slow)
    assert not big.seconds and big.remembered_ratio == pytest.approx(3 * 0.020 / 0.012)
    assert ran.count(BIG) == 0


def test_follows_a_change_within_a_window_of_rounds():
    chooser = TreeChooser(candidates(), batch=1)
    run(chooser, 40, lambda c: c.expected_seconds)
    ran = run(chooser, 30, lambda c: c.expected_seconds, tokens_of=lambda c: 1.0)  # a prompt nothing is accepted on
    assert ran[-6:] == [None] * 6
    # Acceptance back: the close trees are probed, the others measured again when forgotten.
    ran = run(chooser, 140, lambda c: c.expected_seconds)
    assert ran[-20:].count(BIG) >= 17


def test_a_new_row_count_is_measured_again():
    chooser = TreeChooser(candidates(), batch=1)
    run(chooser, 20, lambda c: c.expected_seconds)
    # Four rows: plain decoding first, then the best tree; the other is estimated from its ratio to
    # plain decoding at one row (and probed later).
    assert run(chooser, 5, lambda c: c.expected_seconds * 4, rows=4) == [None, None, BIG, BIG, BIG]
    assert chooser.rate(chooser.candidates[1], 4) == pytest.approx(chooser.rate(chooser.candidates[1], 1) / 4)
    assert run(chooser, 3, lambda c: c.expected_seconds) == [BIG] * 3  # one row again: known


def test_forgets_cached_costs_that_disagree_with_live_timing():
    forgotten = []
    chooser = TreeChooser(candidates(), batch=1, forget_costs=lambda: forgotten.append(True))
    run(chooser, 30, lambda c: c.expected_seconds * 1.1)  # within the margin
    assert not forgotten
    chooser = TreeChooser(candidates(), batch=1, forget_costs=lambda: forgotten.append(True))
    run(chooser, 30, lambda c: c.expected_seconds * 2.5)
    assert forgotten == [True]  # once
    chooser = TreeChooser(candidates(), batch=2, forget_costs=lambda: forgotten.append(True))
    run(chooser, 30, lambda c: c.expected_seconds * 2.5, rows=3)  # costs of another batch size: no verdict
    assert forgotten == [True]


def test_candidates_must_include_plain_decoding():
    with pytest.raises(ValueError, match="plain decoding"):
        TreeChooser(candidates()[:3], batch=1)


def started_batch(target, head, drafter, ids, rows):
    """A batch state of ``rows`` copies of ``ids``'s sequence, started as the engine starts one."""
    one = target.new_cache(1, ids.numel())
    _, hidden = target(ids.unsqueeze(0), one)
    one.commit(ids.numel())
    state = BatchState(target, drafter, rows, ids.numel() + 24)
    started = Started(one, *drafter.prefill(torch.cat([ids[1:], ids[:1]]), hidden[0]))
    for b in range(rows):
        state.load(b, None, Started(started.target_kv, started.draft_kv, started.root_step))
    return state


def test_deferred_catch_up_equals_one_catch_up_a_round():
    # Three rounds of plain decoding, their catch-up deferred and run as one, leave the draft's
    # cache and root step as catching up after each round does.
    target = tiny_target()
    head = copy_head(target, "jakiro")
    drafter = Drafter(head, METHODS["jakiro"], TreeConfig(8, 2, 2))
    ids = prompt(9)
    each, later = (started_batch(target, head, drafter, ids, 2) for _ in range(2))
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        tokens = torch.randint(0, 211, (2, 1), generator=g)
        features = torch.randn(2, 1, target.config.hidden_size, generator=g)
        path, counts = torch.zeros(2, 1, dtype=torch.int64), [1, 1]
        each.commit(path, counts, drafter.catch_up(each.draft_kv, tokens, features))
        later.commit(path, counts, None)
        later.defer_catch_up(tokens, features)
    assert later.draft_kv.host_lengths == [9] * 2 and len(later.pending) == 3
    assert later.catch_up_pending() and not later.pending and not later.catch_up_pending()
    assert later.draft_kv.host_lengths == each.draft_kv.host_lengths == [12] * 2
    n = 12
    torch.testing.assert_close(later.draft_kv.kv[..., :n, :], each.draft_kv.kv[..., :n, :], atol=1e-5, rtol=1e-5)
    for mine, theirs in zip(later.root_step, each.root_step):
        if mine is not None:
            torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)


def test_a_row_change_runs_the_deferred_catch_up_first():
    target = tiny_target()
    head = copy_head(target, "jakiro")
    drafter = Drafter(head, METHODS["jakiro"], TreeConfig(8, 2, 2))
    state = started_batch(target, head, drafter, prompt(9), 2)
    state.commit(torch.zeros(2, 1, dtype=torch.int64), [1, 1], None)
    state.defer_catch_up(torch.ones(2, 1, dtype=torch.int64), torch.randn(2, 1, target.config.hidden_size))
    state.make_room(3, 40)  # a new row: the pending tokens belong to the old rows' order
    assert not state.pending and state.draft_kv.host_lengths[:2] == [10, 10]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_live_choice_gives_plain_decodings_tokens(tmp_path, monkeypatch, temperature):
    # Default tree on a CPU with a profiled head: chosen live. Rounds alternate between a tree and
    # plain decoding here (whatever the timing), which must change nothing at temperature 0, and
    # at temperature 1 give tokens only from the target's support (its top-k 5 here).
    monkeypatch.setenv("JAKIRO_CACHE", str(tmp_path))
    monkeypatch.setattr(tree_cost, "_CHOOSERS", type(tree_cost._CHOOSERS)())
    target = tiny_target()
    head = copy_head(target, "jakiro")
    head.acceptance = {"depth_rank": [[0.6, 0.2], [0.5, 0.2], [0.4, 0.2]],
                       "contrastive_depth_rank": [[0.3, 0.2], [0.3, 0.2], [0.3, 0.2]]}
    used = []

    def alternate(self, rows):
        trees = [c for c in self.candidates if c.tree is not None]
        plain = next(c for c in self.candidates if c.tree is None)
        chosen = plain if len(used) % 3 else trees[len(used) % len(trees)]
        used.append(chosen.tree)
        return chosen

    monkeypatch.setattr(adaptive.TreeChooser, "choose", alternate)
    x = [prompt(9, seed=s) for s in range(3)]
    outs = speculative_generate(target, head, x, 24, temperature=temperature, top_k=5)
    assert None in used and any(t is not None for t in used)
    assert sum(o.stats.accept_lengths.count(0) < len(o.stats.accept_lengths) for o in outs) >= 1  # drafts accepted
    if temperature == 0:
        assert [o.token_ids for o in outs] == [o.token_ids for o in speculative_generate(target, None, x, 24)]
    else:
        for ids, out in zip(x, outs):
            context = ids.tolist()
            for token in out.token_ids:  # each token among the target's top 5 after what came before
                cache = target.new_cache(1, len(context))
                logits, _ = target(torch.tensor([context]), cache, last_logits_only=True)
                assert token in logits[0, -1].topk(5).indices.tolist()
                context.append(token)
