"""What the live tree choice measured, kept for the next chooser: a new head or process starts from
each tree's live seconds over plain decoding's instead of the cost model's guess and from what
switching to it cost, within KEEP_LIVE seconds and while plain decoding's live seconds agree, and
from the live acceptance of greedy and sampling calls apart; the file beside the cost cache, its
round trip, and damaged, foreign or unwritable files."""
import json
import math
import time
from pathlib import Path

import pytest

from helpers import JAKIRO_PROFILE, prompt, profiled_head, tiny_target
from jakiro_ext import atomic
from jakiro_ext.engine import adaptive, policy, tree_cost
from jakiro_ext.engine.adaptive import Candidate, TreeChooser, tree_key
from jakiro_ext.engine.candidate import KEEP_LIVE
from jakiro_ext.engine.generate import generate_many
from helpers import BIG, SMALL, run


def chooser():
    # The cost model puts BIG 1.25x ahead of plain decoding (tried at once, unless known better):
    # live, BIG takes twice its modelled seconds (0.62x plain decoding's rate).
    return TreeChooser([Candidate(BIG, 2.5, 0.020), Candidate(SMALL, 1.5, 0.014), Candidate(None, 1.0, 0.010)],
                       batch=1)


def slow_big(c):
    return c.expected_seconds * (2 if c.tree is BIG else 1)


def test_a_new_chooser_starts_from_the_last_ones_ratios():
    first = chooser()
    ran = run(first, 40, slow_big)
    assert ran[:4] == [None, None, BIG, BIG] and ran[4:].count(BIG) == 0  # explored once (timed the second round), then known slow
    kept = first.kept()
    assert kept["rows"] == 1 and kept["plain_seconds"] == pytest.approx(0.010)
    assert kept["ratios"][tree_key(BIG)][0] == pytest.approx(4.0)
    assert time.time() - kept["ratios"][tree_key(BIG)][1] < 60
    # A new chooser (a new head, another process) from the kept ratios: BIG is not tried again.
    second = chooser()
    second.start_from(json.loads(json.dumps(kept)))  # (as kept in the file)
    assert BIG not in run(second, 40, slow_big)
    # Without them it pays the exploration again.
    assert run(chooser(), 3, slow_big) == [None, None, BIG]
    # Before its first round it knows it will not draft (the draft's prefill of the prompt waits
    # for a tree round); without the kept ratios the cost model says BIG.
    third = chooser()
    third.start_from(json.loads(json.dumps(kept)))
    assert not third.drafting(1) and chooser().drafting(1)


def test_kept_ratios_expire_and_yield_to_a_changed_machine():
    first = chooser()
    run(first, 40, lambda c: 0.7 * slow_big(c))  # (the machine 0.7x the cached costs: within their margin)
    kept = first.kept()
    old = chooser()
    old.start_from(kept, now=time.time() + KEEP_LIVE + 1)
    assert run(old, 3, slow_big) == [None, None, BIG]  # older than KEEP_LIVE: the model's guess again
    # Plain decoding now 1.9x slower than when the ratios were kept, over WINDOW rounds: the
    # machine is not as it was (judged on WINDOW rounds, not two: a call's first ones run slower).
    changed = chooser()
    changed.start_from(kept)
    ran, w = run(changed, 2 * adaptive.WINDOW + adaptive.QUIET_ROUNDS, lambda c: 1.3 * slow_big(c)), adaptive.WINDOW
    assert ran[:w] == [None] * w and BIG in ran[w: w + adaptive.QUIET_ROUNDS + 1]  # (after plain decoding's quiet rounds)
    # Its first two rounds 2x slower than kept, the next ones as kept (beside a quantized target a
    # call's first plain steps ran 1.7-2x its later ones: the caches): the kept ratios hold.
    warming, plain_rounds = chooser(), []
    warming.start_from(kept)

    def cold_start(c):
        plain_rounds.append(c.tree is None)
        return 0.7 * slow_big(c) * (2 if c.tree is None and sum(plain_rounds) <= 2 else 1)
    assert BIG not in run(warming, 20, cold_start)
    # Within the disagreement allowed (drift): the kept ratios hold.
    drifted = chooser()
    drifted.start_from(kept)
    assert BIG not in run(drifted, 20, lambda c: 0.7 * 1.3 * slow_big(c))


def accepting(share):
    """Rounds whose trees accept ``share`` of the drafts the cost model expected (greedy)."""
    return lambda c: 1.0 + (c.expected_tokens - 1.0) * share


def test_greedy_and_sampling_calls_keep_their_own_acceptance():
    # Sampling, the trees accept a third of the greedy profile's drafts: BIG, 1.25x ahead of plain
    # decoding greedy, is at 0.75x. A chooser that ran a greedy call, then a sampling one...
    first = chooser()
    run(first, 40, tokens_of=accepting(1.0))
    first.new_call(sampling=True)
    run(first, 40, tokens_of=accepting(1 / 3))
    kept = first.kept()
    assert kept["acceptance"]["greedy"][0] == pytest.approx(1.0, abs=0.05)
    assert kept["acceptance"]["sampling"][0] < 0.5
    # ... starts its next greedy call from the greedy acceptance: BIG runs (SMALL probed), never plain decoding.
    first.new_call(sampling=False)
    ran = run(first, 4, tokens_of=accepting(1.0))
    assert BIG in ran and None not in ran
    # A new chooser (a new head, another process) from what it kept, after plain decoding's first
    # two rounds: a sampling call does not run BIG on the greedy profile's word (without the kept
    # acceptance, it did); a greedy call does.
    for sampling in (True, False):
        second = chooser()
        second.start_from(json.loads(json.dumps(kept)))
        second.new_call(sampling)
        ran = run(second, 6, tokens_of=accepting(1 / 3 if sampling else 1.0))
        assert ran == [None] * 6 if sampling else ran[2] is BIG
    unaware = chooser()
    unaware.new_call(sampling=True)
    assert run(unaware, 3, tokens_of=accepting(1 / 3))[2] is BIG


def test_a_tree_costly_to_switch_to_is_not_probed_by_the_next_chooser_within_a_short_call():
    # BIG at 0.9x plain decoding's rate (within COMPETITIVE: probed), switching to it costs a
    # catch-up of five plain rounds (at 16 rows: most of a round or more).
    def close_big(c):
        return c.expected_seconds * (1.39 if c.tree is BIG else 1)

    def pair():
        return TreeChooser([Candidate(BIG, 2.5, 0.020), Candidate(None, 1.0, 0.010)], batch=1)
    first = pair()
    run(first, 40, close_big, catch_up=0.05)
    kept = first.kept()
    assert kept["switch"][tree_key(BIG)] == pytest.approx(5.0)  # (in plain rounds; explored as the best: no round lost)
    second = pair()
    second.start_from(kept)
    assert BIG not in run(second, 60, close_big, catch_up=0.05)  # 1% of 60 rounds pays no 0.05 s
    third = pair()
    third.start_from(dict(kept, switch={}))  # without the kept switch cost: probed within the call
    assert BIG in run(third, 60, close_big, catch_up=0.05)


def test_what_switching_costs_is_what_switching_from_plain_decoding_cost():
    # BIG and SMALL in turn after plain decoding, switching from plain decoding to either costs a
    # catch-up of five plain rounds, from one tree to the other nothing: each keeps the five (its
    # probes from plain decoding are budgeted by them), not the free switch from the other tree.
    first = TreeChooser([Candidate(BIG, 2.5, 0.020), Candidate(SMALL, 1.5, 0.014), Candidate(None, 1.0, 0.010)],
                        batch=1)
    order = [None, None, BIG, SMALL, None, SMALL, BIG]
    for tree, last in zip(order, [None] + order[:-1]):
        c = next(c for c in first.candidates if c.tree is tree)
        first.record(c, 1, c.expected_seconds, c.expected_tokens, 0.05 if tree is not None and last is None else 0.0)
    kept = first.kept()
    assert all(5.0 <= kept["switch"][tree_key(t)] < 6.0 for t in (BIG, SMALL))  # (SMALL's: with a round lost to BIG)


def test_a_switch_the_rest_of_the_call_cannot_pay_for_is_not_made():
    # BIG 1.25x plain decoding's rate, switching to it costs a catch-up of five plain rounds. A
    # chooser with 1,000 tokens left switches; with 10 left (4 rounds of BIG) the switch would
    # cost more than BIG wins, and it stays with plain decoding (the probes' budget too).
    def pair():
        return TreeChooser([Candidate(BIG, 2.5, 0.020), Candidate(None, 1.0, 0.010)], batch=1)

    def drive(c, rounds, left):
        ran = []
        for _ in range(rounds):
            chosen = c.choose(1)
            catch_up = 0.05 if chosen.tree is not None and ran and ran[-1] is None else 0.0
            c.record(chosen, 1, chosen.expected_seconds, chosen.expected_tokens, catch_up, left=left)
            ran.append(chosen.tree)
        return ran
    first = pair()
    assert BIG in drive(first, 10, left=None)  # (the tokens left unknown: the switch not weighed)
    kept = first.kept()
    assert kept["switch"][tree_key(BIG)] == pytest.approx(5.0)
    for left, switches in ((1000, True), (10, False)):
        c = pair()
        c.start_from(json.loads(json.dumps(kept)))
        assert (BIG in drive(c, 20, left)) == switches, left


def test_a_chooser_that_measured_nothing_keeps_nothing():
    c = chooser()
    kept = []
    c.keep = kept.append
    c.end_call()
    assert kept == [] and c.kept()["ratios"] == {}
    run(c, 1)  # one round of plain decoding: not measured yet (MIN_SAMPLES)
    c.end_call()
    assert kept == []


def test_a_call_that_changes_nothing_kept_writes_nothing():
    # The next chooser acts on what moved by COSTS_DISAGREE: a call that only ran plain decoding
    # at about the kept seconds does not write the file again (2 ms with its fsync, every call).
    def pair():
        return TreeChooser([Candidate(BIG, 2.5, 0.020), Candidate(None, 1.0, 0.010)], batch=1)
    first = pair()
    run(first, 40, slow_big)
    kept = first.kept()
    second = pair()
    written = []
    second.keep = written.append
    second.start_from(json.loads(json.dumps(kept)))
    second.new_call()
    assert BIG not in run(second, 40, lambda c: 1.02 * slow_big(c))  # plain decoding 2% slower: the same
    second.end_call()
    assert written == []
    run(second, 40, lambda c: 1.2 * slow_big(c))  # 20% slower (drift, not yet a changed machine): kept
    second.end_call()
    assert len(written) == 1 and written[0]["plain_seconds"] == pytest.approx(0.012)
    second.end_call()  # nothing new since
    assert len(written) == 1
    big = next(c for c in second.candidates if c.tree is BIG)
    time.sleep(0.01)
    second.record(big, 1, 1.2 * slow_big(big), 2.5)  # a round of BIG (its probe): measured anew, at the same ratio
    second.end_call()
    assert len(written) == 2 and written[1]["ratios"][tree_key(BIG)][1] > kept["ratios"][tree_key(BIG)][1]


def test_the_file_is_parsed_again_only_when_its_text_changed(tmp_path, monkeypatch):
    """Every new head's first call reads the kept file: its text unchanged, what was parsed and
    checked from it is returned again (0.15 ms a call beside the Q4_1 file); any change in it,
    whoever wrote it, is parsed and checked anew."""
    path, checked = tmp_path / "costs.live.json", []
    check = policy.check_live
    monkeypatch.setattr(policy, "check_live", lambda measured: checked.append(1) or check(measured))
    first = chooser()
    run(first, 40, slow_big)
    policy.keep_live(path, first.kept())
    assert policy.load_live(path) == first.kept() and policy.load_live(path) == first.kept() and len(checked) == 1
    changed = dict(first.kept(), plain_seconds=0.5, build=tree_cost.build_id())
    path.write_text(json.dumps(changed))  # (in place: the same file, written again at once)
    assert policy.load_live(path)["plain_seconds"] == 0.5 and len(checked) == 2
    path.write_text(json.dumps(dict(changed, rows="16")))
    assert policy.load_live(path) is None and len(checked) == 3  # (damaged: a warning)


def test_a_new_heads_candidates_are_ranked_again_only_when_the_costs_or_profile_change(monkeypatch):
    """Ranking the trees (5 ms) is done once for the costs as read and the head's profile: a new
    head with the same profile gets the same candidates without it; another profile, or the costs
    read anew, ranks again."""
    ranked = []
    choose = policy.choose_tree
    monkeypatch.setattr(policy, "choose_tree", lambda *a: ranked.append(1) or choose(*a))
    costs = tree_cost.check_costs({"verify": {"1": 0.01, "2": 0.012, "4": 0.015}, "catch_up": {"1": 0.001, "2": 0.0012},
                                   "draft": {"1,1": 0.001, "1,2": 0.002, "2,2": 0.004}, "context": 256,
                                   "context_slope": 1e-6, "batch": 1})
    profile = JAKIRO_PROFILE
    path = Path("/nowhere/costs.json")
    first = policy.candidate_specs(path, costs, profile, "jakiro")
    assert policy.candidate_specs(path, costs, json.loads(json.dumps(profile)), "jakiro") is first and len(ranked) == 1
    assert first[-1] == (None, 1.0, pytest.approx(tree_cost.round_seconds(costs, 1, 0, 0, 0.0)))
    weaker = dict(profile, depth_rank=[[0.2, 0.1]] * 3)
    assert policy.candidate_specs(path, costs, weaker, "jakiro") != first and len(ranked) == 2
    policy.candidate_specs(path, json.loads(json.dumps(costs)), weaker, "jakiro")  # (read anew)
    assert len(ranked) == 3


def test_the_file_round_trip_and_bad_files(tmp_path, monkeypatch, capsys):
    path = tmp_path / "costs.live.json"
    assert policy.load_live(path) is None
    first = chooser()
    run(first, 40, slow_big)
    policy.keep_live(path, first.kept())
    assert policy.load_live(path) == first.kept()  # (JSON keeps floats exactly)
    measured = json.loads(path.read_text())
    for bad in ("{", '{"ratios": 3}', json.dumps(dict(measured, plain_seconds="x")),
                json.dumps(dict(measured, ratios={"16,3,4": [float("nan"), 0.0]})),
                json.dumps(dict(measured, ratios={"16,3,4": [-1.0, 0.0]})),
                json.dumps(dict(measured, switch={"16,3,4": -1.0})),
                json.dumps(dict(measured, acceptance={"beam search": [1.0, 0.0]})),
                json.dumps(dict(measured, acceptance={"greedy": [-0.5, 0.0]})),
                # well formed, damaged in value: a non-finite or non-integer row count, a switch
                # table of the wrong type, a non-finite wall time, a string for a number
                json.dumps(dict(measured, rows=float("inf"))), json.dumps(dict(measured, rows="16")),
                json.dumps(dict(measured, rows=2.5)), json.dumps(dict(measured, switch=[1.0])),
                json.dumps(dict(measured, ratios={"16,3,4": [1.0, float("inf")]})),
                json.dumps(dict(measured, ratios={"16,3,4": ["1.0", 0.0]}))):
        path.write_text(bad)
        assert policy.load_live(path) is None
        assert "damaged" in capsys.readouterr().err
    # Tree rounds that accepted no draft (sampling on a hard text) keep an acceptance of 0: the
    # file is whole (it was found "damaged", and every ratio it kept was lost).
    nothing = chooser()
    run(nothing, 40, slow_big, tokens_of=lambda c: 1.0)
    assert nothing.kept()["acceptance"]["greedy"][0] == 0.0 and nothing.kept()["ratios"]
    policy.keep_live(path, nothing.kept())
    assert policy.load_live(path) == nothing.kept() and "damaged" not in capsys.readouterr().err
    started = chooser()  # a chooser starting from it: the kept 0 as a prior of a few rounds
    started.start_from(policy.load_live(path))
    started.new_call()
    assert started.acceptance_scale() == pytest.approx(1 / 3)
    run(started, 10)
    path.write_text(json.dumps(dict(measured, build="another build")))
    assert policy.load_live(path) is None  # measured with other kernels: not this machine's rounds
    # An unwritable cache is a warning, never the call's failure.
    blocked = tmp_path / "a file" / "x.live.json"
    (tmp_path / "a file").write_text("")
    policy.keep_live(blocked, first.kept())
    atomic.wait_for_writes_behind()  # (written behind the call)
    assert "could not keep" in capsys.readouterr().err


def alternating():
    """A ``TreeChooser.choose`` that measures plain decoding (two rounds in four) and runs every
    tree twice in a row (a tree's first round after plain decoding is not timed), whatever the timing."""
    rounds = [0]

    def choose(self, rows):
        trees = [c for c in self.candidates if c.tree is not None]
        n = rounds[0]
        rounds[0] += 1
        return self.plain if n % 4 < 2 else trees[n // 4 % len(trees)]
    return choose


def test_the_engine_keeps_them_beside_the_costs_for_a_new_head(tmp_path, monkeypatch):
    monkeypatch.setenv("JAKIRO_CACHE", str(tmp_path))
    monkeypatch.setattr(policy, "_CHOOSERS", type(policy._CHOOSERS)())
    monkeypatch.setattr(adaptive, "COSTS_DISAGREE", math.inf)  # (the same costs, the same candidates, both calls)
    target = tiny_target()
    heads = [profiled_head(target) for _ in range(2)]
    monkeypatch.setattr(adaptive.TreeChooser, "choose", alternating())
    x = [prompt(9, seed=s) for s in range(2)]
    dict(generate_many(target, heads[0], x, max_batch_size=2, max_new_tokens=20))
    live = policy.live_path(tree_cost.costs_path(target, heads[0], "jakiro", 2))
    kept = policy.load_live(live)
    assert kept is not None and kept["rows"] == 2 and kept["ratios"]
    second = policy.tree_chooser(target, heads[1], "jakiro", 2)
    started = {tree_key(c.tree): c.remembered_ratio for c in second.candidates if c.remembered_ratio is not None}
    assert started == pytest.approx({k: r for k, (r, _) in kept["ratios"].items()})


def test_graphed_calls_choose_and_keep_apart_from_eager_ones(tmp_path, monkeypatch):
    # A round replayed as a graph costs otherwise than an eager one (on a GPU a fraction of it):
    # graphed calls have their own chooser, which judges nothing against the eagerly measured
    # costs, and keep what it measured in their own file, which eager calls do not read.
    monkeypatch.setenv("JAKIRO_CACHE", str(tmp_path))
    monkeypatch.setattr(policy, "_CHOOSERS", type(policy._CHOOSERS)())
    target = tiny_target()
    head = profiled_head(target)
    monkeypatch.setattr(adaptive.TreeChooser, "choose", alternating())
    dict(generate_many(target, head, [prompt(9, seed=s) for s in range(2)], max_batch_size=2, max_new_tokens=30,
                       graphs="recorded"))
    costs = tree_cost.costs_path(target, head, "jakiro", 2)
    assert policy.load_live(policy.live_path(costs, "recorded"))["ratios"]
    assert policy.live_path(costs, "recorded").name == costs.stem + ".live-recorded.json"
    assert not policy.live_path(costs).exists() and costs.exists()
    graphed = policy.tree_chooser(target, head, "jakiro", 2, graphs="recorded")
    eager = policy.tree_chooser(target, head, "jakiro", 2)
    assert graphed is not eager and graphed.round > 0 and eager.round == 0
    assert not graphed.absolute and graphed.forget_costs is None
    assert eager.absolute and eager.forget_costs is not None
