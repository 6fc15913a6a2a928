"""The tree chosen by measured cost: the expected acceptance of a dynamic tree from a head's
acceptance profile, the choice against synthetic cost curves, the measured and cached costs, the
profile recorded with a head, and decoding with the chosen tree (still lossless)."""
import json
import time

import pytest
import torch

from jakiro_ext.config import TreeConfig
from jakiro_ext.engine.generate import speculative_generate
from jakiro_ext.models.heads.draft_head import DraftHead
from jakiro_ext.training.settings import TrainConfig
from jakiro_ext.training.loss import evaluate
from jakiro_ext.engine.tree_cost import (CONTEXT, SIZES, auto_tree, capped_by_larger, choose_tree, expected_accepted, load_costs,
                                         rate, round_seconds)
from jakiro_ext.engine import policy, tree_cost
from jakiro_ext.training.acceptance import acceptance_profile
from helpers import copy_head, make_examples, prompt, random_head, tiny_target


def chain_profile(depth=6, ranks=4):
    return dict(depth_rank=[[1.0] + [0.0] * (ranks - 1)] * depth)


def test_expected_acceptance_of_dynamic_trees():
    # A head that is always right with its best candidate: the chain, as long as the tree allows.
    for n, d, k in [(2, 3, 2), (4, 3, 2), (8, 3, 2), (8, 5, 1), (30, 2, 3)]:
        assert expected_accepted(chain_profile(), n, d, k, "eagle2") == min(n - 1, d + 1)
        assert expected_accepted(chain_profile(), n, d, k, "jakiro") == min(n - 1, d)  # one layer fewer...
    # contrastive_depth_rank starts at depth 2 (the root step's contrastive feature); the tree
    # below uses depth 3's (that of the depth-1 nodes' step).
    p = dict(depth_rank=[[0.6, 0.3], [0.5, 0.2]], contrastive_depth_rank=[[0.9, 0.9], [0.4, 0.1]])
    # Depth 1: 0.6, 0.3; both expanded: 0.3, 0.12, 0.15, 0.06; the best three kept.
    assert expected_accepted(p, 4, 1, 2, "eagle2") == pytest.approx(0.6 + 0.3 + 0.3)
    assert expected_accepted(p, 99, 1, 1, "eagle2") == pytest.approx(0.6 + 0.3)
    # Jakiro at depth 2: one MoE expansion of {0.6, 0.3}, plus contrastive nodes under each
    # frontier node's best child: v * 0.5 * {0.4, 0.1}.
    nodes = [0.6, 0.3, 0.3, 0.12, 0.15, 0.06, 0.12, 0.03, 0.06, 0.015]
    # Jakiro at depth 1: the root's children, and the root step's contrastive nodes under the best
    # of them: 0.6 * {0.9, 0.9}. (No draft forward but the catch-up's.)
    assert expected_accepted(p, 99, 1, 2, "jakiro") == pytest.approx(0.6 + 0.3 + 0.54 + 0.54)
    assert expected_accepted(p, 99, 2, 2, "jakiro") == pytest.approx(sum(nodes))
    assert expected_accepted(p, 5, 2, 2, "jakiro") == pytest.approx(0.6 + 0.3 + 0.3 + 0.15)
    assert expected_accepted(dict(depth_rank=[[0.0, 0.0]]), 10, 3, 2, "eagle2") == 0.0
    # Gumiho, depth 3 with two MLP heads: one serial expansion (depth_rank's second row), then
    # a layer per MLP head from mlp_depth_rank, each expanding the best top_k nodes.
    g = dict(depth_rank=[[0.6, 0.3], [0.5, 0.2], [0.0, 0.0]], mlp_depth_rank=[[0.4, 0.1], [0.3, 0.2]])
    layer2 = [0.3, 0.12, 0.15, 0.06]  # under 0.6 and 0.3
    layer3 = [v * q for v in (0.3, 0.15) for q in (0.4, 0.1)]  # the best two of layer 2
    layer4 = [v * q for v in sorted(layer3, reverse=True)[:2] for q in (0.3, 0.2)]
    assert expected_accepted(g, 99, 3, 2, "gumiho") == pytest.approx(0.9 + sum(layer2 + layer3 + layer4))
    # More nodes never expect fewer tokens.
    real = dict(depth_rank=[[0.5, 0.2, 0.1], [0.45, 0.2, 0.1], [0.4, 0.2, 0.1]])
    values = [expected_accepted(real, n, 3, 3, "eagle2") for n in range(2, 40)]
    assert values == sorted(values) and values[-1] > values[0]


def synthetic_costs(per_token):
    return dict(verify={str(n): 0.02 + per_token * n for n in SIZES},
                draft={f"{d},{k}": 0.0005 * d * k for d in range(1, 7) for k in range(1, 9)},
                catch_up={str(r): 0.001 for r in range(1, 9)})


def test_a_plain_round_costs_its_verification_alone():
    # The engine defers the draft's catch-up after rounds of plain decoding to the next drafting
    # round: a plain round's expected seconds are the one-token forward's, a tree's add its
    # drafting and the catch-up on its accepted tokens.
    costs = synthetic_costs(0.01)
    assert round_seconds(costs, 1, 0, 0, 0.0) == pytest.approx(costs["verify"]["1"])
    assert round_seconds(costs, 4, 2, 2, 1.5) == pytest.approx(costs["verify"]["4"] + costs["draft"]["2,2"] + 0.001)


def test_the_choice_follows_the_costs_and_the_acceptance():
    good = dict(depth_rank=[[0.8, 0.1, 0.05]] * 6)
    flat, _ = choose_tree(synthetic_costs(0.0), good, "eagle2")
    steep, rows = choose_tree(synthetic_costs(0.01), good, "eagle2")
    assert flat.total_tokens >= 16 and flat.depth >= 4  # verifying is free: draft deep and wide
    assert steep.total_tokens <= 6  # every node costs half a plain forward
    assert rows[0][0] == max(r[0] for r in rows) and len(rows) > 100
    weak = dict(depth_rank=[[0.3, 0.1, 0.05]] * 6)
    assert choose_tree(synthetic_costs(0.001), weak, "eagle2")[0].depth < choose_tree(
        synthetic_costs(0.001), good, "eagle2")[0].depth


def test_a_size_measured_slow_is_capped_by_the_larger_ones():
    curve = {"1": 0.032, "4": 0.039, "5": 0.051, "6": 0.040, "10": 0.046, "8": 0.045}
    assert capped_by_larger(curve) == {"1": 0.032, "4": 0.039, "5": 0.040, "6": 0.040, "8": 0.045, "10": 0.046}
    assert capped_by_larger({"1": 0.5, "2": 0.2, "3": 0.3}) == {"1": 0.2, "2": 0.2, "3": 0.3}


def test_costs_are_measured_once_and_cached(tmp_path, monkeypatch):
    target = tiny_target()
    head = copy_head(target, "jakiro")
    costs = load_costs(target, head, "jakiro", tmp_path, progress=False)
    assert set(costs["verify"]) == {str(n) for n in SIZES} and all(v > 0 for v in costs["verify"].values())
    assert len(costs["draft"]) == 6 * 8 and all(v > 0 for v in costs["catch_up"].values())
    assert costs["context"] == CONTEXT and costs["context_slope"] >= 0
    by_size = [costs["verify"][str(n)] for n in SIZES]
    assert by_size == sorted(by_size)  # (capped_by_larger)
    assert len(list(tmp_path.iterdir())) == 1

    def no_measuring(*args, **kwargs):
        raise AssertionError("cached costs must not be measured again")

    monkeypatch.setattr("jakiro_ext.engine.tree_cost.measure_costs", no_measuring)
    assert load_costs(target, head, "jakiro", tmp_path, progress=False) == costs


# A whole cost table as measure_costs writes it (small).
MEASURED = {"verify": {"1": 0.01, "2": 0.012, "4": 0.015}, "draft": {"1,2": 0.002, "2,2": 0.004},
            "catch_up": {"1": 0.001, "2": 0.0012}, "context": 256, "context_slope": 1e-6, "batch": 1}


def test_costs_of_another_build_are_measured_again(tmp_path, monkeypatch, capsys):
    # Costs measured with other kernels (another build of the library) say nothing of these.
    from jakiro_ext.engine import tree_cost

    monkeypatch.setattr(tree_cost, "costs_key", lambda *a: "k")
    measured = MEASURED
    calls = []
    monkeypatch.setattr(tree_cost, "measure_costs", lambda *a, **k: calls.append(1) or measured)
    (tmp_path / "k.json").write_text(json.dumps(dict(measured, build="0.0.1-123-456")))
    costs = load_costs(None, None, "jakiro", tmp_path, progress=False)
    assert calls == [1] and costs["build"] == tree_cost.build_id() != "0.0.1-123-456"
    assert "were measured by another build of jakiro_ext" in capsys.readouterr().err
    assert load_costs(None, None, "jakiro", tmp_path, progress=False) == costs and calls == [1]


def test_a_cost_file_is_read_again_only_when_it_changed(tmp_path, monkeypatch):
    # Every new head's first call loads the costs: parsed and checked once while the file stays.
    monkeypatch.setattr(tree_cost, "costs_key", lambda *a: "k")
    monkeypatch.setattr(tree_cost, "measure_costs", lambda *a, **k: pytest.fail("cached costs measured again"))
    path = tmp_path / "k.json"
    path.write_text(json.dumps(dict(MEASURED, build=tree_cost.build_id())))
    checked = []
    check = tree_cost.check_costs
    monkeypatch.setattr(tree_cost, "check_costs", lambda costs: checked.append(1) or check(costs))
    first = load_costs(None, None, "jakiro", tmp_path, progress=False)
    assert load_costs(None, None, "jakiro", tmp_path, progress=False) == first and checked == [1]
    path.write_text(json.dumps(dict(MEASURED, context_slope=2e-6, build=tree_cost.build_id())))  # rewritten
    assert load_costs(None, None, "jakiro", tmp_path, progress=False)["context_slope"] == 2e-6 and checked == [1, 1]


@pytest.mark.parametrize("damage", [
    dict(verify={"1": "0.01", "2": "0.02"}), dict(verify={"1": None, "2": 0.01}), dict(verify={"1": 0.0, "2": 0.01}),
    dict(verify={"1": 0.01}), dict(verify={"0": 0.01, "2": 0.02}), dict(verify=[0.01, 0.02]),
    dict(draft={}), dict(draft={"2": 0.01}), dict(draft={"2,x": 0.01}), dict(draft={"1,2": float("nan")}),
    dict(catch_up=0.01), dict(catch_up={"1": True, "2": 0.01}), dict(catch_up={"1": float("inf"), "2": 0.01}),
    dict(context="256"), dict(context_slope=-1.0), dict(batch=0), dict(batch=2.5), dict(verify=None)],
    ids=lambda d: json.dumps(d))
def test_costs_damaged_in_value_are_measured_again_with_a_warning(tmp_path, monkeypatch, capsys, damage):
    # Well-formed JSON whose values are not costs (strings, nulls, zeros, an empty draft table,
    # a table of the wrong type): one warning naming the file and a re-measure, never an
    # IndexError or ZeroDivisionError out of the tree choice.
    monkeypatch.setattr(tree_cost, "costs_key", lambda *a: "k")
    calls = []
    monkeypatch.setattr(tree_cost, "measure_costs", lambda *a, **k: calls.append(1) or MEASURED)
    path = tmp_path / "k.json"
    path.write_text(json.dumps(dict(MEASURED, build=tree_cost.build_id(), **damage)))
    costs = load_costs(None, None, "jakiro", tmp_path, progress=False)
    assert calls == [1] and costs == dict(MEASURED, build=tree_cost.build_id())
    assert f"warning: the cached costs {path} are damaged" in capsys.readouterr().err
    choose_tree(costs, chain_profile(), "eagle2")  # what a damaged table broke: usable now
    assert load_costs(None, None, "jakiro", tmp_path, progress=False) == costs and calls == [1]  # written whole


def test_a_whole_cost_table_is_kept_and_an_unwritable_cache_is_a_warning(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tree_cost, "costs_key", lambda *a: "k")
    calls = []
    monkeypatch.setattr(tree_cost, "measure_costs", lambda *a, **k: calls.append(1) or MEASURED)
    assert tree_cost.check_costs(dict(MEASURED)) == MEASURED
    (tmp_path / "a file").write_text("")  # a cache directory that cannot be made
    blocked = tmp_path / "a file" / "costs"
    costs = load_costs(None, None, "jakiro", blocked, progress=False)
    assert costs == dict(MEASURED, build=tree_cost.build_id()) and calls == [1]
    assert "warning: could not keep the costs in" in capsys.readouterr().err
    forget = policy.forget_cost_file(blocked / "k.json")  # (deleting there fails too: a warning)
    forget("plain decoding's rounds took 2.00x the cached seconds")
    assert "warning: could not delete" in capsys.readouterr().err


def test_a_bf16_checkpoint_in_float32_has_its_own_costs(monkeypatch):
    """Its steps read bf16 copies of the weights (half the bytes): other costs than the same
    shapes read in float32, and than itself with the copies turned off."""
    target = tiny_target()
    head = random_head(target, "jakiro")
    plain = tree_cost.costs_key(target, head, "jakiro")
    with torch.no_grad():
        for p in target.parameters():
            p.copy_(p.bfloat16().float())
    rounded = tree_cost.costs_key(target, head, "jakiro")
    assert rounded != plain and rounded.replace("-bf16_weights", "") == plain
    monkeypatch.setenv("JAKIRO_CPU_BF16_WEIGHTS", "0")
    assert tree_cost.costs_key(target, head, "jakiro") == plain


def test_a_run_on_the_reference_ops_keeps_its_costs_apart(monkeypatch):
    # (JAKIRO_USE_REFERENCE=1, or the source tree without a build: never the compiled build's file)
    target = tiny_target()
    head = random_head(target, "jakiro")
    compiled = tree_cost.costs_key(target, head, "jakiro")
    monkeypatch.setattr(tree_cost.ops, "compiled_available", lambda: False)
    assert tree_cost.costs_key(target, head, "jakiro") == compiled + "-reference"


def test_costs_of_a_batch_are_measured_at_its_bucket(tmp_path, monkeypatch):
    # A batch of 3 uses the costs of 2 sequences (the power of two at or below), measured with 2
    # rows everywhere and cached apart from batch 1's; its verify curve stops at 1024 rows.
    from jakiro_ext.engine import tree_cost

    target = tiny_target()
    head = copy_head(target, "eagle2")
    seen = []
    measure = tree_cost.measure_costs

    def spy(*args, **kwargs):
        seen.append(kwargs["batch"])
        return measure(*args, **kwargs)

    monkeypatch.setattr(tree_cost, "MAX_VERIFY_ROWS", 40)
    monkeypatch.setattr(tree_cost, "measure_costs", spy)
    costs = load_costs(target, head, "eagle2", tmp_path, progress=False, batch=3)
    assert seen == [2] and costs["batch"] == 2
    assert set(costs["verify"]) == {str(n) for n in SIZES if 2 * n <= 40}
    assert [p.name.endswith("-eagle2-b2.json") for p in tmp_path.iterdir()] == [True]
    assert load_costs(target, head, "eagle2", tmp_path, progress=False, batch=2) == costs and seen == [2]
    # The rate counts every sequence's tokens, and only measured sizes are candidates.
    profile = {"depth_rank": [[0.5, 0.2], [0.4, 0.2]]}
    tree, rows = choose_tree(costs, profile, "eagle2")
    assert all(str(n) in costs["verify"] for _, _, n, _, _ in rows)
    one = dict(costs, batch=1)
    assert rate(costs, 4, 1, 2, 0.7) == pytest.approx(2 * rate(one, 4, 1, 2, 0.7))
    # Each candidate's acceptance (one ranking of the nodes per depth and width) is that tree's own.
    for r, accepted, n, d, k in rows:
        assert accepted == pytest.approx(expected_accepted(profile, n, d, k, "eagle2"))
        assert r == pytest.approx(rate(costs, n, d, k, accepted))


@pytest.mark.parametrize("kind", ["jakiro", "gumiho"])
def test_profile_recorded_with_the_head_and_used_by_default(tmp_path, monkeypatch, kind):
    target = tiny_target()
    head = copy_head(target, kind)
    examples = make_examples(target, count=3)
    profile = acceptance_profile(head, examples, depth=4, ranks=3)
    table = torch.tensor(profile["depth_rank"])
    assert table.shape == (4, 3) and bool(((table >= 0) & (table <= 1)).all())
    assert bool((table.sum(-1) <= 1 + 1e-9).all()) and profile["positions"] > 0
    # Rank 0 at depth d is the evaluation's acc{d} (and its MLP heads' acc{d}_mlp).
    acc = evaluate(head, examples, TrainConfig())
    for d in range(1, 5):
        assert table[d - 1, 0].item() == pytest.approx(acc[f"acc{d}"])
    if kind == "jakiro":
        assert torch.tensor(profile["contrastive_depth_rank"]).shape == (4, 3)
    else:
        mlp = torch.tensor(profile["mlp_depth_rank"])
        assert mlp.shape == (2, 3) and "contrastive_depth_rank" not in profile
        assert [mlp[j, 0].item() for j in range(2)] == pytest.approx([acc["acc3_mlp"], acc["acc4_mlp"]])
    head.acceptance = profile
    head.save(tmp_path / "head")
    loaded = DraftHead.load(tmp_path / "head", target)
    assert loaded.acceptance == json.loads((tmp_path / "head" / "acceptance.json").read_text())
    # The engine's default tree on a CPU is the one chosen for it; decoding stays lossless.
    monkeypatch.setenv("JAKIRO_CACHE", str(tmp_path / "cache"))
    chosen = auto_tree(target, loaded, kind)
    assert isinstance(chosen, TreeConfig)
    assert chosen == choose_tree(load_costs(target, loaded, kind, progress=False), loaded.acceptance, kind)[0]
    if kind == "gumiho":
        assert chosen.depth >= 3  # a serial step, then its two MLP heads
    x = prompt(9)
    assert (speculative_generate(target, loaded, x, 20).token_ids
            == speculative_generate(target, loaded, x, 20, tree=chosen).token_ids
            == speculative_generate(target, None, x, 20).token_ids)
    assert auto_tree(target, copy_head(target, kind), kind) is None  # no profile: the caller's preset


def test_malformed_acceptance_profile_is_an_error(tmp_path):
    target = tiny_target()
    head = copy_head(target, "eagle2")
    head.save(tmp_path / "head")
    for bad in ('{"depth_rank": [[1.5]]}', '{"depth_rank": []}', '{"other": 1}', "not json"):
        (tmp_path / "head" / "acceptance.json").write_text(bad)
        with pytest.raises(ValueError, match="acceptance"):
            DraftHead.load(tmp_path / "head", target)


@pytest.mark.parametrize("kind,method", [("eagle2", "eagle2"), ("jakiro", "jakiro"), ("jakiro", "jakiro_star"),
                                         ("gumiho", "gumiho")])
def test_the_drafter_and_the_cost_model_read_one_schedule(monkeypatch, kind, method):
    # A method's tree layers are written once (Method.schedule): the drafter drafts that many
    # layers with a forward for each of the forward kinds past the root's children, and the cost
    # model counts the nodes of the same layers.
    from jakiro_ext.engine.drafter import Drafter
    from jakiro_ext.engine.tree import DraftTree
    from jakiro_ext.methods import FORWARD_KINDS, METHODS

    target = tiny_target()
    head = random_head(target, kind)
    tree = TreeConfig(64, 4, 2)
    drafter = Drafter(head, METHODS[method], tree)
    ids = prompt()
    one = target.new_cache(1, ids.numel())
    _, hidden = target(ids.unsqueeze(0), one)
    cache, root_step = drafter.prefill(torch.cat([ids[1:], ids[:1]]), hidden[0])
    drafted = []
    kept = DraftTree.kept
    monkeypatch.setattr(DraftTree, "kept", lambda self, total: (drafted.append(self), kept(self, total))[1])
    before = drafter.forwards
    drafter.draft(ids[-1:], cache, root_step)
    kinds = METHODS[method].schedule(tree.depth, getattr(head.config, "num_mlp_heads", 0))
    assert len(kinds) == tree.depth + 1 and int(drafted[0].depths.max()) == len(kinds)
    assert drafter.forwards - before == sum(k in FORWARD_KINDS for k in kinds[1:])
    ones = dict(depth_rank=[[1.0] * 4] * 8, contrastive_depth_rank=[[1.0] * 4] * 8,
                mlp_depth_rank=[[1.0] * 4] * getattr(head.config, "num_mlp_heads", 0))
    if method != "jakiro_star":  # (its cost model counts top_k children a node, of 2 top_k drafted)
        counted = METHODS[method].node_probabilities(ones, tree.depth, tree.top_k)
        assert len(counted) == drafted[0].size - 1


def test_a_part_is_timed_with_its_device_work():
    # On a GPU a launch returns before its work is done: the timing synchronizes before (nothing
    # earlier counted) and after (the part's own work counted), as measure_costs passes it.
    calls = []

    def sync():
        calls.append("sync")
        if calls.count("fn"):  # the part's device work, finishing at the second synchronize
            time.sleep(0.02)

    seconds = tree_cost._seconds(lambda: calls.append("fn"), sync)
    assert calls == ["sync", "fn", "sync"] and seconds >= 0.02
    calls.clear()
    medians = tree_cost._interleaved_medians({"a": lambda: calls.append("fn")}, 3, lambda: None, sync)
    assert medians["a"] >= 0.02 and calls.count("sync") == 6
