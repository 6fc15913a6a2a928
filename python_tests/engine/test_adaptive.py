"""Speculation that never loses: the live choice of each round's tree (TreeChooser) against
synthetic round timings, the draft's deferred catch-up after rounds of plain decoding (per row,
across row changes, rebuilt from a window when far behind, prompts admitted without the draft's
prefill), and the engine with the live choice giving plain decoding's tokens."""
import random
import statistics

import pytest
import torch

from helpers import BIG, FAR, SMALL, candidates, copy_head, profiled_head, prompt, run, tiny_target
from jakiro_ext.config import TreeConfig, tree_key
from jakiro_ext.engine import adaptive, policy
from jakiro_ext.engine.adaptive import Candidate, TreeChooser
from jakiro_ext.engine.drafter import Drafter
from jakiro_ext.engine import draft_lag
from jakiro_ext.engine.generate import generate_many, speculative_generate
from jakiro_ext.engine.state import BatchState, Started
from jakiro_ext.methods import METHODS

def test_measures_plain_decoding_then_the_best_tree_and_probes_the_close_one():
    chooser = TreeChooser(candidates(), batch=1)
    ran = run(chooser, 3, lambda c: c.expected_seconds)
    assert ran == [None, None, BIG]  # FAR: a third of the best rate, never tried
    # The costs were right: the best from now on, and a probe of the close one after PROBE_EVERY
    # rounds (round 15); behind, probed again twice as late. Plain decoding, far behind, is probed
    # too (its seconds are the reference of every tree's), PROBE_EVERY rounds after its last.
    assert run(chooser, 13) == [BIG] * 12 + [SMALL]
    assert run(chooser, 2 * adaptive.PROBE_EVERY) == [BIG, None] + [BIG] * (2 * adaptive.PROBE_EVERY - 3) + [SMALL]


def test_a_tree_never_run_is_tried_at_once_only_when_the_model_puts_it_clearly_ahead():
    # The cost model puts BIG 1.20x ahead of plain decoding: tried after plain decoding's two
    # rounds. At 1.10x (within the model's error): plain decoding is the choice (a prompt admitted
    # then leaves its draft prefill for later) until BIG's probe is due, PROBE_EVERY rounds in;
    # the model was right, so BIG runs from then on.
    for ahead, first in ((1.20, 2), (1.10, adaptive.PROBE_EVERY - 1)):
        chooser = TreeChooser([Candidate(BIG, 2.5, 0.020), Candidate(None, 1.0, 0.020 * ahead / 2.5)], batch=1)
        ran = run(chooser, 2)
        assert chooser.drafting(1) == (ahead > adaptive.EXPLORE_MARGIN)
        ran += run(chooser, 100, lambda c: c.expected_seconds)
        assert ran.index(BIG) == first and ran[first:].count(BIG) >= len(ran[first:]) - 2  # (plain re-measured when forgotten)


def test_a_stretch_of_slow_plain_rounds_does_not_keep_a_slower_tree_running():
    """Plain decoding leads (BIG at 0.89x its rate); then the machine is busy for 10 rounds (plain
    decoding's steps 4x as long; a tree's less hit): BIG takes over. Once the machine is idle
    again, plain decoding's probe (made even when it seems far behind) measures it afresh and it
    leads again from its first probe, not after BIG's 64 rounds to forgetting."""
    big, plain = Candidate(BIG, 2.5, 0.028), Candidate(None, 1.0, 0.010)
    chooser = TreeChooser([big, plain], batch=1)
    run(chooser, 40)
    busy = run(chooser, 10, lambda c: 0.040 if c.tree is None else 0.032)
    after = run(chooser, 100)
    assert BIG in busy + after[:2]  # (the tree ran while plain decoding looked slow)
    assert after[adaptive.PROBE_EVERY:].count(None) >= len(after[adaptive.PROBE_EVERY:]) - 4  # (BIG probed: 2 rounds a probe)


def test_a_trees_first_round_after_plain_decoding_is_not_its_rate():
    """The draft's weights come cold from plain rounds: a tree's first round after them takes
    longer than its later ones (beside the Q4_1 file 1.08-1.13x). Timed as its rate, a tree 1.27x
    ahead of plain decoding per round read 0.95x at every probe and never ran. Its first round's
    excess goes to the switch cost, the round after it runs the tree again and times it, and the
    tree runs from its first probe on."""
    small, plain = Candidate(SMALL, 1.9, 0.020), Candidate(None, 1.0, 0.010)  # (the model: 0.95x)
    chooser = TreeChooser([small, plain], batch=1)
    ran, switch_costs = [], []
    for _ in range(100):
        c = chooser.choose(1)
        cold = c.tree is not None and (not ran or ran[-1] is None)
        chooser.record(c, 1, 0.020 if cold else 0.015 if c.tree else 0.010, c.expected_tokens)
        ran.append(c.tree)
        switch_costs.append(small.switch_cost)
    first = ran.index(SMALL)
    assert first == adaptive.PROBE_EVERY - 1 and ran[first:].count(None) <= 2  # (plain decoding's own probe)
    assert small.median_seconds(1) == pytest.approx(0.015)
    assert switch_costs[first] == pytest.approx(0.020 - 1.9 * 0.010)  # (its first round against plain decoding's)


def test_a_calls_first_rounds_are_not_timed():
    """Plain decoding leads (BIG at 0.89x its rate). Each new call's first SETTLE_ROUNDS plain
    steps take twice as long (its prefill's memory traffic evicted the weights from the cache, as
    beside the Q4_1 file on the Xeon): not timed, they do not hand the choice to BIG."""
    big, plain = Candidate(BIG, 2.5, 0.028), Candidate(None, 1.0, 0.010)
    chooser = TreeChooser([big, plain], batch=1)
    run(chooser, 40)
    for _ in range(3):
        chooser.new_call()
        start = chooser.round
        ran = run(chooser, 30, lambda c: c.expected_seconds * (2 if chooser.round < start + adaptive.SETTLE_ROUNDS else 1))
        assert ran.count(BIG) <= 2, ran  # (its probe at most: a switch round and a timed one)


def test_falls_back_to_plain_decoding_when_speculation_is_slower():
    # Costs measured on a loaded machine: every tree is three times slower than they said.
    chooser = TreeChooser(candidates(), batch=1)
    ran = run(chooser, 400, lambda c: c.expected_seconds * (3 if c.tree else 1))
    assert ran[-1] is None and ran[10:].count(None) / len(ran[10:]) > 0.97  # a probe now and then
    assert ran.count(FAR) <= 1  # far behind by the costs: only when stale


def test_a_tree_a_few_percent_ahead_per_round_does_not_displace_plain_decoding():
    """A call pays for a tree what its rounds do not show (the draft's prefill, its catch-up after
    plain rounds, the probes, a static batch waiting for its slowest row): at 4 rows a tree 5-10%
    ahead per round ran at 0.94-0.95x plain decoding per call. A tree displaces plain decoding
    only when its live rate is MARGIN ahead: at 1.06x plain decoding runs (the tree at its
    probes), at 1.20x the tree."""
    for ahead, tree_runs in ((1.06, False), (1.20, True)):
        small, plain = Candidate(SMALL, 1.9, 0.020), Candidate(None, 1.0, 0.012)
        chooser = TreeChooser([small, plain], batch=4)
        ran = run(chooser, 200, lambda c: 0.012 * (1.9 / ahead if c.tree else 1), rows=4)
        share = ran[20:].count(SMALL) / len(ran[20:])
        assert share > 0.95 if tree_runs else share < 0.1, (ahead, share)
    assert 1.06 < adaptive.MARGIN < 1.20


def test_a_small_tree_found_slower_than_the_model_said_spares_running_the_bigger_ones():
    """The cost model is off for every tree alike (a batch of 16 rows: each tree twice its
    predicted seconds) and puts the small tree first: once it is measured, the bigger close one
    is estimated with the same error and never run; then plain decoding runs."""
    small, big, plain = Candidate(SMALL, 1.9, 0.017), Candidate(BIG, 2.5, 0.0225), Candidate(None, 1.0, 0.012)
    chooser = TreeChooser([small, big, plain], batch=16)
    ran = run(chooser, 400, lambda c: c.expected_seconds * (2 if c.tree else 1), rows=16)
    assert ran[:3] == [None, None, SMALL] and BIG not in ran  # (nor after SMALL's measurements are forgotten)
    assert ran[3:].count(None) / len(ran[3:]) > 0.98  # (the smallest tree: probed now and then)
    assert chooser.model_error(big, 16) == pytest.approx(0.5) and chooser.model_error(small, 16) == pytest.approx(0.5)


def test_a_big_tree_found_slower_than_the_model_said_says_nothing_of_a_small_one():
    """The big tree the model put first runs at a third of its rate, the small one as the model
    said: the small one is still tried (at its probe: the model's costs are now suspect), and
    kept; the cached costs stay (a round slower than its cost carries host work the model does
    not time, or ran on a machine loaded now)."""
    forgotten = []
    chooser = TreeChooser(candidates(), batch=1, forget_costs=lambda why: forgotten.append(why))
    ran = run(chooser, 60, lambda c: c.expected_seconds * (3 if c.tree in (BIG, FAR) else 1))
    assert ran[:3] == [None, None, BIG] and ran.index(SMALL) == adaptive.PROBE_EVERY - 1
    assert chooser.costs_disagree and not forgotten
    assert ran[-20:].count(SMALL) >= 19
    assert chooser.model_error(chooser.candidates[1], 1) == pytest.approx(1.0)


def test_a_close_tree_that_stays_behind_is_probed_less_and_less_often():
    # Live: SMALL 0.9x plain decoding's rate (close: probed). (Alone with plain decoding: beside a
    # tree found slower than the model said, it would be estimated as slow and not run at all.)
    chooser = TreeChooser([candidates()[1], candidates()[3]], batch=1)
    ran = run(chooser, 1000, lambda c: c.expected_seconds,
              tokens_of=lambda c: 1.0 if c.tree is None else 0.9 * c.expected_seconds / 0.012)
    runs = [i for i, tree in enumerate(ran) if tree is SMALL]
    gaps = [b - a for a, b in zip(runs, runs[1:]) if b - a > 1]  # (first a few rounds in a row: its prior)
    assert gaps[:3] == [adaptive.PROBE_EVERY, 2 * adaptive.PROBE_EVERY, 4 * adaptive.PROBE_EVERY]
    # Forgotten after FORGET_AFTER rounds, it is tried again for a few rounds (its tokens' prior is
    # the cost model's again): in all, under a tenth of the rounds at 0.9x.
    assert ran[100:].count(SMALL) < 0.1 * len(ran[100:])


def test_a_tree_costly_to_switch_to_is_probed_within_the_budget():
    """As the last test, but each switch from plain decoding to the tree costs a catch-up of 3
    plain rounds (16 rows, 32 tokens behind): probes come no sooner than PROBE_BUDGET of the time
    since pays for that, so in all they cost about that fraction, not a round in 16."""
    chooser = TreeChooser([candidates()[1], candidates()[3]], batch=1)
    ran = run(chooser, 3000, lambda c: c.expected_seconds, catch_up=3 * 0.012,
              tokens_of=lambda c: 1.0 if c.tree is None else 0.9 * c.expected_seconds / 0.012)
    runs = [i for i, tree in enumerate(ran) if tree is SMALL]
    gaps = [b - a for a, b in zip(runs, runs[1:]) if b - a > 1]
    # (3 rounds' catch-up plus the probe's own loss, a tenth of a round: ~310 rounds at 1%)
    assert gaps and min(gaps) >= 3 / adaptive.PROBE_BUDGET
    assert len(gaps) < 3000 / 300


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
    assert ran[-15:].count(None) >= 13  # (a probe at most: two rounds)
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
    chooser = TreeChooser(candidates(), batch=1, forget_costs=lambda why: forgotten.append(True))
    run(chooser, 30, lambda c: c.expected_seconds * 1.1)  # within the margin
    assert not forgotten
    # Costs measured idle: a live plain round at 0.7-0.9x its cached seconds (the cached one-row
    # verification goes through the tree path) is not a verdict on them.
    chooser = TreeChooser(candidates(), batch=1, forget_costs=lambda why: forgotten.append(True))
    run(chooser, 30, lambda c: c.expected_seconds * 0.7)
    assert not forgotten
    said = []
    chooser = TreeChooser(candidates(), batch=1, forget_costs=lambda why: (forgotten.append(True), said.append(why)))
    run(chooser, 30, lambda c: c.expected_seconds / 2.5)  # measured under load: every round faster live
    assert forgotten == [True]  # once
    assert said == ["plain decoding's rounds took 0.40x the cached seconds"]
    # Slower live than cached: the model is suspect for this chooser, the file stays (host work the
    # costs do not time, a machine loaded now); a sampling call's rounds (its verification draws
    # from the filtered distribution) are no verdict at all.
    chooser = TreeChooser(candidates(), batch=1, forget_costs=lambda why: forgotten.append(True))
    run(chooser, 30, lambda c: c.expected_seconds * 2.5)
    assert forgotten == [True] and chooser.costs_disagree
    chooser = TreeChooser(candidates(), batch=1, forget_costs=lambda why: forgotten.append(True))
    chooser.new_call(sampling=True)
    run(chooser, 30, lambda c: c.expected_seconds / 2.5)
    assert forgotten == [True] and not chooser.costs_disagree
    chooser = TreeChooser(candidates(), batch=2, forget_costs=lambda why: forgotten.append(True))
    run(chooser, 30, lambda c: c.expected_seconds / 2.5, rows=3)  # costs of another batch size: no verdict
    assert forgotten == [True]
    # Trees 3x their modelled seconds, plain decoding as cached (a fast target's round carries
    # host work the model does not time): the file stays.
    chooser = TreeChooser(candidates(), batch=1, forget_costs=lambda why: forgotten.append(True))
    run(chooser, 30, lambda c: c.expected_seconds * (1.0 if c.tree is None else 3.0))
    assert forgotten == [True] and chooser.costs_disagree


def test_graphed_rounds_are_not_judged_against_the_eager_costs():
    # Replayed as graphs (absolute=False), a round launches once: on a GPU it takes a fraction of
    # what the costs measured with eager launches. Rounds 2.5x faster than the costs, which
    # condemn the file for eager rounds (above), neither delete it nor make the model suspect:
    # the trees are tried by its ratios as when it was right (the first test), and then by live rates.
    forgotten = []
    chooser = TreeChooser(candidates(), batch=1, forget_costs=lambda why: forgotten.append(why), absolute=False)
    ran = run(chooser, 30, lambda c: c.expected_seconds / 2.5)
    assert not forgotten and not chooser.costs_disagree
    assert ran[:3] == [None, None, BIG] and ran[3:].count(BIG) >= len(ran[3:]) - 2
    # The control: the same rounds judged against the costs.
    chooser = TreeChooser(candidates(), batch=1, forget_costs=lambda why: forgotten.append(why))
    run(chooser, 30, lambda c: c.expected_seconds / 2.5)
    assert forgotten and chooser.costs_disagree


def test_a_round_that_captured_its_graph_is_not_timed():
    # A round that captured its graph (seconds None: the capture is paid once, its graph kept for
    # later rounds and calls) counts its tokens, not its seconds: plain decoding's first round
    # captured, then it is measured on its replays; a tree's capture round after plain decoding
    # sets no switch cost, and the tree's next round is timed as its rate.
    small, plain = Candidate(SMALL, 1.9, 0.012), Candidate(None, 1.0, 0.010)  # (the model: 1.58x)
    chooser = TreeChooser([small, plain], batch=1)
    captured, ran = set(), []
    for _ in range(6):
        c = chooser.choose(1)
        first = id(c) not in captured
        captured.add(id(c))
        chooser.record(c, 1, None if first else c.expected_seconds, c.expected_tokens)
        ran.append(c.tree)
    assert ran == [None, None, None, SMALL, SMALL, SMALL]  # (plain decoding: MIN_SAMPLES timed rounds)
    assert plain.samples(1) == 2 and small.samples(1) == 2 and small.switch_cost == 0.0
    assert small.median_seconds(1) == pytest.approx(0.012) and len(small.tokens) == 3


def test_live_timing_is_judged_at_its_own_context():
    # Costs measured behind 256 tokens, each committed token adding 0.1 ms a round: live rounds
    # behind 32 tokens take 0.0224 s less, plain decoding's 0.55x its cached seconds (beyond
    # 1 / 1.6), and agree with the costs moved to that context.
    forgotten = []
    moved = lambda c: c.expected_seconds - 224e-4  # noqa: E731
    slow = [Candidate(BIG, 2.5, 0.060), Candidate(None, 1.0, 0.050)]

    def live(chooser, rounds, seconds_of, context):
        for _ in range(rounds):
            c = chooser.choose(1)
            chooser.record(c, 1, seconds_of(c), c.expected_tokens, context=context)

    chooser = TreeChooser(slow, batch=1, forget_costs=lambda why: forgotten.append(True), context=256, context_slope=1e-4)
    live(chooser, 30, moved, 32)
    assert not forgotten and not chooser.costs_disagree
    assert chooser.expected_seconds_at(slow[1], 32) == pytest.approx(0.050 - 0.0224)
    assert chooser.expected_seconds_at(slow[1], None) == 0.050
    # Costs measured under load still disagree at any context: 2.5x faster than the moved ones.
    chooser = TreeChooser(slow, batch=1, forget_costs=lambda why: forgotten.append(True), context=256, context_slope=1e-4)
    live(chooser, 30, lambda c: moved(c) / 2.5, 32)
    assert forgotten == [True]
    # Without the move the same timing disagrees.
    chooser = TreeChooser(slow, batch=1, forget_costs=lambda why: forgotten.append(True))
    live(chooser, 30, moved, 32)
    assert forgotten == [True, True]
    with pytest.raises(ValueError, match="context_slope must be finite numbers >= 0"):
        TreeChooser(slow, batch=1, context=256, context_slope=-1e-4)


def test_costs_that_disagree_with_live_timing_try_trees_only_at_their_probes():
    """Costs measured under load (every round 2.5x faster live than cached, trees as plain
    decoding): the model's relative costs are suspect too, so no tree is tried at once (not even
    BIG, 1.5x ahead by the model) and a prompt admitted then leaves its draft prefill for later;
    the smallest tree is tried at its probe (and, right after all, runs from then on), the bigger
    ones wait for costs measured again."""
    chooser = TreeChooser(candidates(), batch=1)
    ran = run(chooser, 2, lambda c: c.expected_seconds / 2.5)
    assert ran == [None, None] and chooser.costs_disagree and not chooser.drafting(1)
    ran += run(chooser, 60, lambda c: c.expected_seconds / 2.5)
    assert ran.index(SMALL) == adaptive.PROBE_EVERY - 1 and ran[-20:].count(SMALL) >= 19 and BIG not in ran


def test_candidates_must_include_plain_decoding():
    with pytest.raises(ValueError, match="plain decoding"):
        TreeChooser(candidates()[:3], batch=1)


def started_batch(target, head, drafter, ids, rows, room=24):
    """A batch state of ``rows`` copies of ``ids``'s sequence (stand-ins for the sequences), started as
    the engine starts one, with ``room`` positions for more."""
    one = target.new_cache(1, ids.numel())
    _, hidden = target(ids.unsqueeze(0), one)
    one.commit(ids.numel())
    state = BatchState(target, drafter, rows, ids.numel() + room)
    started = Started(one, *drafter.prefill(torch.cat([ids[1:], ids[:1]]), hidden[0]))
    for b in range(rows):
        state.load(b, object(), Started(started.target_kv, started.draft_kv, started.root_step))
    return state


def jakiro_drafter():
    target = tiny_target()
    head = copy_head(target, "jakiro")
    return target, Drafter(head, METHODS["jakiro"], TreeConfig(8, 2, 2))


def plain_rounds(states, rounds, seed=3, hidden=None):
    """``rounds`` rounds of plain decoding on each state (one new token a row), their catch-up
    deferred; returns the (tokens [B, rounds], features [B, rounds, H]) they left behind."""
    g = torch.Generator().manual_seed(seed)
    B = len(states[0].rows)
    tokens = torch.randint(0, 211, (B, rounds), generator=g)
    features = torch.randn(B, rounds, hidden, generator=g)
    for i in range(rounds):
        for state in states:
            state.commit(torch.zeros(B, 1, dtype=torch.int64), [1] * B, None)
            state.defer_catch_up(tokens[:, i: i + 1], features[:, i: i + 1])
    return tokens, features


def assert_same_draft(state, kv, lengths, root_step, rows):
    """Rows ``rows`` of ``state``'s draft: cache entries equal to ``kv`` [.., rows, .., n, D] up to
    each row's length, and root step equal to ``root_step``'s rows."""
    assert [state.draft_kv.host_lengths[b] for b in rows] == lengths
    for i, b in enumerate(rows):
        torch.testing.assert_close(state.draft_kv.kv[:, :, b, :, :lengths[i]], kv[:, :, i, :, :lengths[i]],
                                   atol=1e-5, rtol=1e-5)
    for mine, theirs in zip(state.root_step, root_step):
        if mine is not None:
            torch.testing.assert_close(mine[rows], theirs, atol=1e-5, rtol=1e-5)


def test_deferred_catch_up_equals_one_catch_up_a_round():
    # Three rounds of plain decoding, their catch-up deferred and run as one, leave the draft's
    # cache and root step as catching up after each round does.
    target, drafter = jakiro_drafter()
    ids = prompt(9)
    each, later = (started_batch(target, drafter.head, drafter, ids, 2) for _ in range(2))
    tokens, features = plain_rounds([later], 3, hidden=target.config.hidden_size)
    for i in range(3):
        each.commit(torch.zeros(2, 1, dtype=torch.int64), [1, 1],
                    drafter.catch_up(each.draft_kv, tokens[:, i: i + 1], features[:, i: i + 1]))
    assert later.draft_kv.host_lengths == [9] * 2 and later.lag.behind == [3, 3]
    assert later.catch_up_pending() and later.lag.behind == [0, 0] and not later.catch_up_pending()
    assert_same_draft(later, each.draft_kv.kv, [12, 12], each.root_step, [0, 1])


def test_rows_keep_what_their_draft_is_behind_across_row_changes():
    # No catch-up at a row change: each row's pairs move with it; a row admitted later is behind
    # by less; one catch-up forward serves rows behind by different counts (and free rows).
    target, drafter = jakiro_drafter()
    ids = prompt(9)
    state, reference = (started_batch(target, drafter.head, drafter, ids, 2) for _ in range(2))
    tokens, features = plain_rounds([state, reference], 2, hidden=target.config.hidden_size)
    state.make_room(1, 40)  # a new free row 2 after rows 0 and 1
    assert state.lag.behind == [2, 2, 0] and state.draft_kv.host_lengths == [9, 9, 0]
    more_tokens, more_features = plain_rounds([state], 1, seed=4, hidden=target.config.hidden_size)
    state._select([1, 0, 2])  # rows 0 and 1 swap
    assert state.lag.behind == [3, 3, 1]
    reference.catch_up_pending()
    reference.commit(torch.zeros(2, 1, dtype=torch.int64), [1, 1],
                     drafter.catch_up(reference.draft_kv, more_tokens[:2], more_features[:2]))
    assert state.catch_up_pending()
    assert_same_draft(state, reference.draft_kv.kv[:, :, [1, 0]], [12, 12], reference.root_step.of_sequences(
        torch.tensor([1, 0])), [0, 1])


def test_a_draft_far_behind_is_rebuilt_from_its_last_window(monkeypatch):
    # Behind by more than DRAFT_WINDOW: emptied and run over its last DRAFT_WINDOW pairs, exactly
    # a fresh draft prefill over them; a row behind by less beside it is caught up exactly.
    monkeypatch.setattr(draft_lag, "DRAFT_WINDOW", 4)
    monkeypatch.setattr(draft_lag, "DRAFT_PAIRS", 0)  # (the window DRAFT_WINDOW at any rows)
    target, drafter = jakiro_drafter()
    ids = prompt(9)
    state, reference = (started_batch(target, drafter.head, drafter, ids, 2) for _ in range(2))
    tokens, features = plain_rounds([state], 7, hidden=target.config.hidden_size)
    state.lag.behind[1] = 3  # row 1: as if it had caught up 4 rounds ago
    reference.draft_kv.commit(torch.tensor([0, 4]), [0, 4])
    reference.draft_kv.kv[:, :, 1, :, 9:13] = state.draft_kv.kv[:, :, 1, :, 9:13]  # (what it ran then: as in state)
    state.draft_kv.commit(torch.tensor([0, 4]), [0, 4])
    assert state.lag.rebuild == [True, False]
    assert state.catch_up_pending()
    own, step = drafter.prefill(tokens[0, 3:], features[0, 3:])  # row 0: the last 4 pairs alone
    assert state.draft_kv.host_lengths == [4, 16]
    torch.testing.assert_close(state.draft_kv.kv[:, :, 0, :, :4], own.kv[:, :, 0, :, :4], atol=1e-5, rtol=1e-5)
    for mine, theirs in zip(state.root_step, step):
        if mine is not None:
            torch.testing.assert_close(mine[0], theirs[0], atol=1e-5, rtol=1e-5)
    row1 = drafter.catch_up(reference.draft_kv, tokens[:, 4:], features[:, 4:])
    torch.testing.assert_close(state.draft_kv.kv[:, :, 1, :, 13:16], reference.draft_kv.kv[:, :, 1, :, 13:16],
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state.root_step.feature[1, 0], row1.feature[1, -1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("length", [3, 11])
def test_a_prompt_admitted_without_its_draft_prefill(monkeypatch, length):
    # Its pairs wait in the row; the catch-up before drafting runs them: the draft prefill itself
    # (a short prompt), or a rebuild from its last DRAFT_WINDOW pairs (a long one).
    monkeypatch.setattr(draft_lag, "DRAFT_WINDOW", 4)
    monkeypatch.setattr(draft_lag, "DRAFT_PAIRS", 0)  # (the window DRAFT_WINDOW at any rows)
    target, drafter = jakiro_drafter()
    ids = prompt(length)
    one = target.new_cache(1, length)
    _, hidden = target(ids.unsqueeze(0), one)
    one.commit(length)
    pairs = (torch.cat([ids[1:], ids[:1]]), hidden[0])
    state = BatchState(target, drafter, 2, length + 24)
    state.load(1, object(), Started(one, None, None, pairs))
    assert state.lag.behind == [0, length] and state.lag.rebuild == [False, length > 4]
    assert state.catch_up_pending() and state.lag.behind == [0, 0]
    kept = slice(max(length - 4, 0), length)
    own, step = drafter.prefill(pairs[0][kept], pairs[1][kept])
    assert_same_draft(state, own.kv, [min(length, 4)], step, [1])


def test_the_window_is_a_budget_of_pairs_over_the_rows():
    # One row keeps a whole short call and its prompt (the draft's context whole when drafting
    # resumes); a batch shares DRAFT_PAIRS, each row at least DRAFT_WINDOW; the drafting scratch
    # and the lag's ring are the window of the batch's most rows.
    assert [draft_lag.window(r) for r in (1, 2, 4, 8, 16, 64)] == [256, 128, 64, 32, 32, 32]
    target, drafter = jakiro_drafter()
    for rows in (1, 4, 16):
        wide = Drafter(drafter.head, METHODS["jakiro"], drafter.tree, rows)
        state = BatchState(target, wide, 2, 8)
        assert wide.window == state.lag.window == draft_lag.window(rows) and wide.scratch >= wide.window
    # Behind by 40 pairs at one row: caught up on all of them, exactly as a draft that ran them.
    ids = prompt(9)
    state, reference = (started_batch(target, drafter.head, drafter, ids, 1, room=48) for _ in range(2))
    tokens, features = plain_rounds([state], 40, hidden=target.config.hidden_size)
    assert state.lag.rebuild == [False] and state.catch_up_pending()
    step = drafter.catch_up(reference.draft_kv, tokens, features)
    assert state.draft_kv.host_lengths == [9 + 40]
    torch.testing.assert_close(state.draft_kv.kv[:, :, 0, :, :49], reference.draft_kv.kv[:, :, 0, :, :49],
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state.root_step.feature[0, 0], step.feature[0, -1], atol=1e-5, rtol=1e-5)


def test_a_catch_up_stays_within_the_draft_caches_bound():
    # A row near its sequence's bound beside a row far behind: one forward as wide as the far
    # row's pairs (up to DRAFT_WINDOW), which the drafting scratch beyond the bound holds, so the
    # near-full row never writes past its cache's capacity.
    target, drafter = jakiro_drafter()
    bound, scratch = 20, drafter.scratch
    full, waiting = prompt(18), prompt(13, seed=1)
    state = BatchState(target, drafter, 2, 8, bound)
    assert state.draft_kv.max_capacity == bound + scratch and scratch >= draft_lag.DRAFT_WINDOW > 13
    for b, ids in enumerate((full, waiting)):
        one = target.new_cache(1, ids.numel())
        _, hidden = target(ids.unsqueeze(0), one)
        one.commit(ids.numel())
        pairs = (torch.cat([ids[1:], ids[:1]]), hidden[0])
        if b == 0:
            state.load(0, object(), Started(one, *drafter.prefill(*pairs)))
        else:
            state.load(1, object(), Started(one, None, None, pairs))
            own, step = drafter.prefill(*pairs)
    assert state.lag.behind == [0, 13] and state.catch_up_pending() == 1
    assert_same_draft(state, own.kv, [13], step, [1])
    assert state.draft_kv.host_lengths == [18, 13]


def test_a_long_wait_then_drafting_gives_plain_decodings_tokens(tmp_path, monkeypatch):
    # Plain decoding for longer than the window (prompts admitted without their draft prefill,
    # rows finishing and joining while the draft is behind), then trees: the tokens of plain
    # decoding, and the rebuilt drafts accepted.
    monkeypatch.setenv("JAKIRO_CACHE", str(tmp_path))
    monkeypatch.setattr(policy, "_CHOOSERS", type(policy._CHOOSERS)())
    monkeypatch.setattr(draft_lag, "DRAFT_WINDOW", 4)
    monkeypatch.setattr(draft_lag, "DRAFT_PAIRS", 0)  # (the window DRAFT_WINDOW at any rows)
    target = tiny_target()
    head = profiled_head(target)
    used = []

    def waits(self, rows):  # plain for 9 rounds, then trees for 3, and so on
        chosen = self.plain if len(used) % 12 < 9 else self.candidates[0]
        used.append(chosen.tree)
        return chosen

    monkeypatch.setattr(adaptive.TreeChooser, "choose", waits)
    monkeypatch.setattr(adaptive.TreeChooser, "drafting", lambda self, rows: False)
    x = [prompt(9 + 3 * s, seed=s) for s in range(3)]
    outs = dict(generate_many(target, head, x, max_batch_size=2, max_new_tokens=30))
    assert used.count(None) > 9 and any(t is not None for t in used)
    expected = [o.token_ids for o in speculative_generate(target, None, x, 30)]
    assert [outs[i].token_ids for i in range(3)] == expected
    assert sum(a > 0 for o in outs.values() for a in o.stats.accept_lengths) >= 3  # rebuilt drafts accepted


@pytest.mark.parametrize("temperature,graphs", [(0.0, "eager"), (1.0, "eager"), (0.0, "recorded")])
def test_the_live_choice_gives_plain_decodings_tokens(tmp_path, monkeypatch, temperature, graphs):
    # Default tree on a CPU with a profiled head: chosen live, eager or with each round's graph
    # replayed. Rounds alternate between a tree and plain decoding here (whatever the timing),
    # which must change nothing at temperature 0, and at temperature 1 give tokens only from the
    # target's support (its top-k 5 here).
    monkeypatch.setenv("JAKIRO_CACHE", str(tmp_path))
    monkeypatch.setattr(policy, "_CHOOSERS", type(policy._CHOOSERS)())
    target = tiny_target()
    head = profiled_head(target)
    used = []

    def alternate(self, rows):
        trees = [c for c in self.candidates if c.tree is not None]
        plain = next(c for c in self.candidates if c.tree is None)
        chosen = plain if len(used) % 3 else trees[len(used) % len(trees)]
        used.append(chosen.tree)
        return chosen

    monkeypatch.setattr(adaptive.TreeChooser, "choose", alternate)
    timed, observed = [], []
    record, observe = adaptive.TreeChooser.record, policy.LiveTree.observe
    monkeypatch.setattr(adaptive.TreeChooser, "record", lambda self, c, rows, seconds, *rest:
                        (timed.append(seconds is not None), record(self, c, rows, seconds, *rest))[1])
    monkeypatch.setattr(policy.LiveTree, "observe", lambda self, result: (observed.append(result), observe(self, result))[1])
    x = [prompt(9, seed=s) for s in range(3)]
    outs = speculative_generate(target, head, x, 24, temperature=temperature, top_k=5, graphs=graphs)
    assert None in used and any(t is not None for t in used)
    # A round that captured its graph is not timed: replayed, each candidate's first round.
    captured = [r.captured for r in observed]
    assert timed == [not c for c in captured]
    if graphs == "eager":
        assert not any(captured)
    else:
        assert {tree_key(r.tree) for r in observed if r.captured} == {tree_key(t) for t in used}
        assert sum(captured) < len(captured) // 2  # (most rounds replayed)
    assert sum(o.stats.accept_lengths.count(0) < len(o.stats.accept_lengths) for o in outs) >= 1  # drafts accepted
    assert all(0 < o.stats.plain_rounds < len(o.stats.accept_lengths) for o in outs)  # the plain rounds counted
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


def noisy_machine(chooser, scale, rounds, seed):
    """Sampling-like rounds: each tree accepts a chain of drafts of mean ``scale`` times what the
    cost model expected (Bernoulli steps up to its depth), every round's seconds off by ~8%
    (lognormal); plain decoding 24 ms. Returns the tokens per second over the rounds."""
    rng = random.Random(seed)
    tokens = seconds = 0.0
    for _ in range(rounds):
        c = chooser.choose(1)
        accepted = 0
        if c.tree is not None:
            p = min(0.95, 1.3 * (c.expected_tokens - 1) * scale / c.tree.depth)
            while accepted < c.tree.depth and rng.random() < p:
                accepted += 1
        s = c.expected_seconds * rng.lognormvariate(0, 0.08)
        chooser.record(c, 1, s, 1.0 + accepted)
        tokens, seconds = tokens + 1.0 + accepted, seconds + s
    return tokens / seconds


def test_nearly_equal_trees_that_lose_with_sampling_do_not_drag_it_below_plain_decoding():
    """Four nearly equal trees (4-8 nodes) which, sampling, accept a third of what the cost model
    expected (greedy): they run at 0.80-0.94x plain decoding's rate. Each tree's own 16 rounds vary
    by a tenth or more: judged alone, the luckiest of four looks ahead and runs (calls of 256
    rounds averaged 0.95x plain decoding, the worst 0.91x); judged by the acceptance pooled over
    every tree round they fall behind together (0.98x, the worst 0.97x)."""
    trees = [(TreeConfig(4, 2, 6), 2.2, 0.033), (TreeConfig(5, 2, 6), 2.29, 0.034),
             (TreeConfig(6, 2, 6), 2.36, 0.035), (TreeConfig(8, 3, 3), 2.5, 0.037)]
    rates = [noisy_machine(TreeChooser([Candidate(*t) for t in trees] + [Candidate(None, 1.0, 0.024)], batch=1),
                           0.3, 256, seed) * 0.024 for seed in range(30)]
    assert statistics.fmean(rates) > 0.97 and sorted(rates)[1] > 0.95


def test_a_new_call_keeps_the_machines_seconds_and_drops_the_texts_tokens():
    # A call on a text the head accepts little of: plain decoding wins, the tree's probes back off.
    chooser = TreeChooser([candidates()[1], candidates()[3]], batch=1)
    small = chooser.candidates[0]
    run(chooser, 300, tokens_of=lambda c: 1.0)  # (the tree runs 5 times: more than the CARRIED_ROUNDS a new call keeps)
    assert small.probe_every > adaptive.PROBE_EVERY and small.tokens and chooser.acceptance_scale() < 0.5
    seconds, scale = dict(small.seconds), chooser.acceptance_scale()
    chooser.new_call()  # (tree_chooser calls it when a call finds its head's chooser)
    assert not small.tokens and small.probe_every == adaptive.PROBE_EVERY
    assert small.seconds == seconds and scale < chooser.acceptance_scale() < 1  # (the pool: a prior of a few rounds)
    # The next call's text: the tree is probed as soon as the probe budget allows (a switch cost
    # 5 ms, 1% of ~40 rounds of 12 ms), not MAX_PROBE_EVERY rounds after the last probe.
    ran = run(chooser, 2 * adaptive.PROBE_EVERY)
    assert SMALL in ran


def test_plain_decoding_alone_is_a_valid_choice():
    chooser = TreeChooser([Candidate(None, 1.0, 0.012)], batch=1)
    assert run(chooser, 5) == [None] * 5 and chooser.acceptance_scale() == 1.0
    chooser.new_call()
    assert run(chooser, 2) == [None] * 2


@pytest.mark.parametrize("factor", [1.5, 1.3], ids=["far", "close"])
def test_plain_decoding_ahead_is_chosen_without_a_look_for_a_few_rounds(monkeypatch, factor):
    # BIG live at 0.83x (far) or 0.96x (close: probed) plain decoding's rate, switching to it
    # costing a catch-up: plain decoding is chosen with a look (the rates computed) about once in
    # QUIET_ROUNDS rounds, with the choices of looking every round (BIG's probes and its
    # forgetting at the same rounds).
    def ran(quiet):
        monkeypatch.setattr(adaptive, "QUIET_ROUNDS", quiet)
        chooser = TreeChooser([Candidate(BIG, 2.5, 0.020), Candidate(None, 1.0, 0.010)], batch=1)
        looks = []
        best = chooser.best
        chooser.best = lambda rows: looks.append(chooser.round) or best(rows)
        seconds = lambda c: c.expected_seconds * (factor if c.tree is BIG else 1)  # noqa: E731
        return run(chooser, 400, seconds, catch_up=0.004), len(set(looks))
    quiet, looks = ran(8)
    every, all_looks = ran(0)
    assert quiet == every and quiet.count(BIG) == 2 * (1 if factor == 1.5 else 5)  # (explored; probed 4 times; 2 rounds each)
    assert all_looks >= 390 and looks <= 400 / 8 + 2 * quiet.count(BIG) + 10
