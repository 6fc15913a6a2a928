"""Batches (issue 14): every sequence of a batch gets exactly what it gets alone (greedy float32,
every method and tree shape, ragged prompts, answers of different lengths), sampling inside a
batch follows the target's distribution (chi-square with its negative control), continuous
batching is independent of arrival order and of the number in flight, and bad batches are
clear errors."""
import itertools

import pytest
import torch

from jakiro_ext import ops
from jakiro_ext.engine.tree import DraftTree
from jakiro_ext.config import MAX_BATCH
from jakiro_ext.engine.generate import generate_many, speculative_generate
from helpers import (DYNAMIC_ONLY, HEAD_METHODS, PROMPTS, SAMPLES, SAMPLING_CASES, TREES, chi_square_p, copy_head,
                     exact_distribution, power_at_shift, prompt, random_head, same, tiny_target, verified_token_p)


@pytest.fixture(scope="module")
def alone_ar(target):
    return [speculative_generate(target, None, p, 30) for p in PROMPTS]


def eos_for_different_lengths(alone):
    """A token that ends some of the answers early (the first answer's 6th token) and not others."""
    return alone[0].token_ids[5]


CASES = [(k, m, t) for k, m in HEAD_METHODS for t in TREES if not (m in DYNAMIC_ONLY and t == "static")] + [
    (None, "ar", None)]


@pytest.mark.parametrize("kind,method,tree", CASES)
def test_each_sequence_of_a_batch_gets_what_it_gets_alone(target, alone_ar, kind, method, tree):
    eos = eos_for_different_lengths(alone_ar)
    heads = [None] if kind is None else [copy_head(target, kind), random_head(target, kind)]
    tree = None if tree is None else TREES[tree]
    for head in heads:
        alone = [speculative_generate(target, head, p, 30, method=method, tree=tree, eos_token_id=eos) for p in PROMPTS]
        # Lossless alone: the greedy tokens of plain decoding, cut at EOS.
        for a, plain in zip(alone, alone_ar):
            cut = plain.token_ids.index(eos) + 1 if eos in plain.token_ids else len(plain.token_ids)
            assert a.token_ids == plain.token_ids[:cut]
        assert len({len(a.token_ids) for a in alone}) > 1  # the answers' lengths differ
        batch = speculative_generate(target, head, PROMPTS, 30, method=method, tree=tree, eos_token_id=eos)
        assert len(batch) == len(PROMPTS)
        for a, b in zip(alone, batch):
            assert same(a, b), (a.token_ids, b.token_ids)


def test_a_copy_head_is_accepted_inside_a_batch(target, alone_ar):
    # The batch's rounds do accept drafts (so the batched acceptance path is exercised).
    head = copy_head(target, "jakiro")
    batch = speculative_generate(target, head, PROMPTS, 30, tree=TREES["dynamic-small"])
    assert sum(sum(b.stats.accept_lengths) for b in batch) > 10
    assert [b.token_ids for b in batch] == [a.token_ids for a in alone_ar]


def test_padded_tensor_with_lengths_and_streaming(target, alone_ar):
    n = max(p.numel() for p in PROMPTS)
    padded = torch.full((len(PROMPTS), n), 7, dtype=torch.int64)
    for b, p in enumerate(PROMPTS):
        padded[b, : p.numel()] = p
    seen = {i: [] for i in range(len(PROMPTS))}
    out = speculative_generate(target, copy_head(target, "eagle2"), padded, 30, lengths=[p.numel() for p in PROMPTS],
                               on_tokens=lambda i, tokens: seen[i].extend(tokens))
    assert [o.token_ids for o in out] == [a.token_ids for a in alone_ar]
    assert [seen[i] for i in range(len(PROMPTS))] == [a.token_ids for a in alone_ar]
    # A batch of one is one prompt (as a tokenizer's [1, n] tensor), unless lengths are given.
    assert speculative_generate(target, None, [PROMPTS[0].tolist()], 30).token_ids == alone_ar[0].token_ids
    one = speculative_generate(target, None, PROMPTS[0].unsqueeze(0), 30, lengths=[PROMPTS[0].numel()])
    assert isinstance(one, list) and one[0].token_ids == alone_ar[0].token_ids


@pytest.mark.parametrize("in_flight", [1, 2, 3, 5])
def test_continuous_batching_any_order_any_number_in_flight(target, in_flight):
    head = copy_head(target, "jakiro")
    tree = TREES["dynamic-small"]
    alone = [speculative_generate(target, head, p, 30, tree=tree) for p in PROMPTS]
    for order in itertools.islice(itertools.permutations(range(len(PROMPTS))), 0, 120, 37):
        got = dict(generate_many(target, head, (PROMPTS[i] for i in order), in_flight, 30, tree=tree))
        assert sorted(got) == list(range(len(PROMPTS)))
        for arrival, i in enumerate(order):
            assert same(got[arrival], alone[i])


def test_finished_rows_are_refilled_in_place(target, monkeypatch):
    # With requests waiting, a finished sequence's rows take the next one where they are: the
    # caches are never copied to drop or add rows.
    from jakiro_ext.kv_cache import KVCache

    copies = []
    original = KVCache.select_rows

    given = []

    def spy(self, rows, *args, **kwargs):
        copies.append((self.batch, list(rows), len(given)))
        return original(self, rows, *args, **kwargs)

    def requests():
        for p in PROMPTS * 2:
            given.append(p)
            yield p

    monkeypatch.setattr(KVCache, "select_rows", spy)
    got = dict(generate_many(target, copy_head(target, "eagle2"), requests(), 3, 12, tree=TREES["dynamic-small"]))
    assert len(got) == 2 * len(PROMPTS)
    # While requests remain, rows are only ever added (when a prompt ended at its first token as
    # the batch filled up), never dropped; once they ran out, idle rows go in halvings.
    while_waiting = [(batch, rows) for batch, rows, n in copies if n < len(given)]
    assert all(rows[:batch] == list(range(batch)) for batch, rows in while_waiting)
    assert len(copies) <= 3


def test_continuous_batching_asks_a_dry_iterator_again(target):
    # Requests that only appear once an answer finished (follow-up turns) still get a row.
    class FollowUps:
        def __init__(self):
            self.queue, self.given = [PROMPTS[0]], 0

        def __iter__(self):
            return self

        def __next__(self):
            if not self.queue:
                raise StopIteration
            self.given += 1
            return self.queue.pop(0)

    requests = FollowUps()
    outputs = []
    for i, out in generate_many(target, None, requests, 4, 8):
        outputs.append(out.token_ids)
        if requests.given < 3:
            requests.queue.append(torch.cat([PROMPTS[0], torch.tensor(out.token_ids)]))
    assert len(outputs) == 3
    follow_up = torch.cat([PROMPTS[0], torch.tensor(outputs[0])])
    assert outputs[1] == speculative_generate(target, None, follow_up, 8).token_ids


def test_features_of_a_generation(target):
    # keep_features: the hidden states of the prompt and every generated token but the last,
    # equal to a prefill of the whole sequence.
    out = dict(generate_many(target, copy_head(target, "eagle2"), PROMPTS[:2], 2, 12, tree=TREES["dynamic-small"],
                             keep_features=True))
    for i, p in enumerate(PROMPTS[:2]):
        seq = torch.cat([p, torch.tensor(out[i].token_ids)])
        _, hidden = target(seq[:-1].unsqueeze(0), target.new_cache(1, seq.numel()))
        assert out[i].features.shape == (seq.numel() - 1, target.config.hidden_size)
        torch.testing.assert_close(out[i].features, hidden[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind,method,tokens,tree", SAMPLING_CASES, ids=[c[1] for c in SAMPLING_CASES])
def test_sampling_inside_a_batch_follows_the_target_distribution(kind, method, tokens, tree):
    """The sequence of interest, 125 copies of it among other prompts in each batch of 128: its
    verified token is tested with 95% power against a 0.05 shift of a share (power_at_shift),
    the whole generation by one chi-square; the unfiltered sampler is rejected."""
    vocab = 12
    target = tiny_target(vocab=vocab, embed_std=0.03, seed=3)
    head = copy_head(target, kind, scale=5.0)
    ids = torch.tensor([3, 7, 7, 1, 7, 7])
    others = [torch.tensor([1, 2]), torch.tensor([5, 5, 5, 5, 5, 5, 5, 5, 5]), torch.tensor([9])]
    temperature, top_p, top_k = 0.8, 0.9, 6
    expected = exact_distribution(target, ids, temperature, top_p, top_k, tokens)
    assert power_at_shift(tuple(expected.items()), SAMPLES) >= 0.95
    counts, n, accepted = {}, 0, 0
    batch = [others[0], ids, others[1], others[2]] + [ids] * 124  # the sequence of interest among others
    mine = [i for i, x in enumerate(batch) if x is ids]
    for call in range(SAMPLES // len(mine)):
        outs = speculative_generate(target, head, batch, tokens, method=method, tree=tree, temperature=temperature,
                                    top_p=top_p, top_k=top_k, seed=call * len(batch))
        for i in mine:
            key = tuple(outs[i].token_ids)
            counts[key] = counts.get(key, 0) + 1
            accepted += sum(outs[i].stats.accept_lengths)
            n += 1
    assert n == SAMPLES and 0.5 < accepted / n < tokens - 0.5, accepted / n
    assert verified_token_p(counts, expected, n) > 1e-3
    assert chi_square_p(counts, expected, n) > 1e-3
    unfiltered = exact_distribution(target, ids, temperature, 1.0, 0, tokens)
    assert chi_square_p(counts, unfiltered, n) < 1e-6
    # Each sequence samples from its own generator (seed + its index): the same tokens alone.
    last = (SAMPLES // len(mine) - 1) * len(batch)
    for i in (1, mine[-1]):
        alone = speculative_generate(target, head, ids, tokens, method=method, tree=tree, temperature=temperature,
                                     top_p=top_p, top_k=top_k, seed=last + i)
        assert alone.token_ids == outs[i].token_ids


def test_padding_nodes_are_never_accepted():
    # A padded tree's extra nodes repeat node 1 (same parent, same token): verification, greedy or
    # sampling, takes node 1 or nothing, never a copy, even when the copy is the target's choice.
    tree = DraftTree(torch.tensor([4, 4]))
    tree.add_children(torch.zeros(2, 1, dtype=torch.int64), torch.tensor([[[3, 5, 7]], [[3, 6, 7]]]),
                      torch.tensor([[[-0.1, -0.2, -0.3]], [[-0.1, float("-inf"), float("-inf")]]]))
    verify = tree.kept(3)  # the second sequence has 2 real nodes, padded to 3
    assert verify.counts.tolist() == [3, 2] and verify.tokens.tolist() == [[4, 3, 5], [4, 3, 3]]
    assert verify.parents.tolist() == [[-1, 0, 0], [-1, 0, 0]]
    V = 8
    logits = torch.full((2, 3, V), -5.0)
    logits[:, 0, 3] = 5.0  # the target wants token 3 after the root
    for temperature, uniforms in [(0.0, None), (1.0, torch.rand(2, 4, dtype=torch.float64))]:
        path, accepted, _ = ops.verify_tree(verify.parents, verify.tokens, logits, uniforms, temperature)
        assert not bool(((path == 2) & (torch.arange(2) == 1).unsqueeze(1)).any())


def test_bad_batches_are_clear_errors(target):
    head = copy_head(target, "eagle2")
    cases = [
        (dict(input_ids=[PROMPTS[0], []]), ValueError, r"input_ids\[1\] must not be empty"),
        (dict(input_ids=[PROMPTS[0], [1, 999]]), ValueError, r"input_ids\[1\] must be token ids in \[0, 211\)"),
        (dict(input_ids=[PROMPTS[0]] * (MAX_BATCH + 1)), ValueError, r"1 to 1024 prompts \(MAX_BATCH\), got 1025"),
        (dict(input_ids=torch.ones(2, 4, dtype=torch.int64), lengths=[4, 5]), ValueError, r"lengths\[1\] must be in \[1, 4\], got 5"),
        (dict(input_ids=torch.ones(2, 4, dtype=torch.int64), lengths=[0, 4]), ValueError, r"lengths\[0\] must be in \[1, 4\], got 0"),
        (dict(input_ids=torch.ones(3, 4, dtype=torch.int64), lengths=[4, 4]), ValueError, r"one length per row of input_ids \(3\)"),
        (dict(input_ids=PROMPTS[0], lengths=[4]), ValueError, r"lengths is given only with a padded \[B, n\] tensor"),
        (dict(input_ids=PROMPTS[:2], max_new_tokens=[5, 6]), TypeError,
         r"max_new_tokens must be an int, one value for every sequence of a batch \(per-sequence values are not supported\)"),
        (dict(input_ids=PROMPTS[:2], temperature=[0.0, 1.0]), TypeError, r"temperature must be a real number, one value for every"),
        (dict(input_ids=[PROMPTS[0], torch.ones(30, dtype=torch.int64)], max_cache_len=40), ValueError,
         r"prompt 1 has 30 tokens; with a 16-node tree it needs a KV cache of at least 46 positions, but the cache holds 40"),
    ]
    for kwargs, error, message in cases:
        kwargs = {"max_new_tokens": 5, "tree": TREES["dynamic-small"], **kwargs}
        with pytest.raises(error, match=message):
            speculative_generate(target, head, **kwargs)
    with pytest.raises(ValueError, match=r"max_batch_size must be in \[1, 1024\], got 0"):
        generate_many(target, None, PROMPTS, 0)
    with pytest.raises(ValueError, match=r"request 1 must not be empty"):
        list(generate_many(target, None, [PROMPTS[0], []], 2, 4))
    # Nothing is dropped: a batch whose second prompt fails its check runs none of them.
    calls = []
    with pytest.raises(ValueError):
        speculative_generate(target, None, [PROMPTS[0], []], 5, on_tokens=lambda i, t: calls.append(i))
    assert calls == []


@pytest.mark.parametrize("method,kind,tree_name", [("ar", None, "dynamic-small"), ("eagle2", "eagle2", "dynamic-small"),
                                                   ("jakiro", "jakiro", "dynamic-60-5-10"),
                                                   ("jakiro_star", "jakiro", "static"),
                                                   ("gumiho", "gumiho", "dynamic-small")])
def test_a_round_reads_the_device_once(target, method, kind, tree_name):
    # On a GPU every read of a device value by the host stalls the launch queue (issue 15): a
    # round reads its accepted tokens, and nothing else, greedy or sampling, with rows that finish
    # and rows that start while others decode (continuous batching: 5 prompts through 3 rows).
    from jakiro_ext.engine.host_reads import HostReads, counted_rounds

    head = None if kind is None else random_head(target, kind)
    eos = eos_for_different_lengths([speculative_generate(target, None, PROMPTS[0], 8)])
    for temperature in (0.0, 1.0):
        with HostReads() as reads, counted_rounds(reads) as rounds:
            got = dict(generate_many(target, head, iter(PROMPTS), 3, 12, method=method, tree=TREES[tree_name],
                                     temperature=temperature, eos_token_id=eos))
        assert len(got) == len(PROMPTS)
        in_rounds = sum(v for (where, _), v in reads.counts.items() if where == "round")
        assert rounds[0] > 5 and in_rounds == rounds[0], (temperature, rounds[0], dict(reads.counts))


@pytest.mark.parametrize("planted,kind", [(lambda x: x[x > 0], "boolean index"),
                                          (lambda x: x.__setitem__(x > 0, 0), "boolean index"),
                                          (lambda x: torch.repeat_interleave(x.clamp(0, 2).long()), "repeat_interleave"),
                                          (lambda x: torch.bincount(x.clamp(0, 2).long()), "bincount"),
                                          (lambda x: x.nonzero(), "nonzero"), (lambda x: x.sum().item(), "scalar"),
                                          (lambda x: bool(x.sum() > 0), "scalar"), (lambda x: int(x.sum()), "scalar")])
def test_a_read_planted_in_a_round_is_counted(target, planted, kind, monkeypatch):
    """Each of these syncs a GPU: planted in every round (on the round's verified logits), each
    is counted once a round, so the one-read test above cannot miss it (the rounds run in
    inference mode, where a scalar read dispatches other ops than outside it)."""
    from jakiro_ext import ops
    from jakiro_ext.engine.host_reads import HostReads, counted_rounds

    exact = ops.verify_tree

    def with_a_read(parents, tokens, logits, *args):
        planted(logits[..., 0].flatten().clone())
        return exact(parents, tokens, logits, *args)

    monkeypatch.setattr(ops, "verify_tree", with_a_read)
    with HostReads() as reads, counted_rounds(reads) as rounds:
        speculative_generate(target, random_head(target, "eagle2"), PROMPTS[0], 8, method="eagle2",
                             tree=TREES["dynamic-small"])
    assert rounds[0] >= 3 and reads.counts["round", kind] == rounds[0], dict(reads.counts)


def test_a_draining_batch_counts_how_much_nearer_each_round_brings_its_slowest_sequence():
    # What the live tree choice weighs a round by: with requests waiting for rows, the mean of its
    # sequences' new tokens (a finished row is taken at once); with none (the call ends with its
    # slowest sequence), how much the most any sequence has left of its budget dropped, at most
    # the farthest any went: a tree moving the rows on unevenly makes them finish apart.
    from jakiro_ext.engine.policy import progress as round_progress
    from jakiro_ext.engine.round import RoundResult

    def seq(emitted, done=False):  # what a sequence of a 64-token budget has left of it
        return 0 if done else 64 - emitted

    before, after, accepted = [seq(10), seq(10), seq(9)], [seq(13), seq(11), seq(10)], [2, 0, 0]

    def progress(draining, before, after, accepted):
        return round_progress(RoundResult(None, len(accepted), accepted, before, after, draining, 0.0, 1.0, 0.0, 1, 0))

    assert progress(False, before, after, accepted) == pytest.approx(1 + 2 / 3)
    assert progress(True, before, after, accepted) == 1.0  # the slowest, 55 left, went 1 further
    # The slowest ended (EOS) this round: the drop to the next slowest, capped at the farthest any went.
    assert progress(True, [seq(48), seq(9)], [seq(50), seq(10, done=True)], [1, 0]) == 2.0
    assert progress(True, [seq(10)], [seq(13)], [2]) == 3.0  # one sequence: its own tokens


def test_the_batch_knows_when_no_request_waits_for_a_row(monkeypatch):
    from jakiro_ext.engine.batch import DecodeBatch

    seen, round_ = [], DecodeBatch.round

    def recording(self):
        seen.append(self.draining)
        round_(self)

    monkeypatch.setattr(DecodeBatch, "round", recording)
    target = tiny_target()
    x = [prompt(5 + s, seed=s) for s in range(3)]

    def draining(run):
        seen.clear()
        run()
        return list(seen)

    # Every prompt in a row from the start: draining all along.
    assert draining(lambda: speculative_generate(target, None, x, 6)) == [True] * 5
    # Two rows, three prompts: the third waits until the first two finish (5 rounds of plain
    # decoding), then the batch drains; a list is known empty once its last prompt is taken, an
    # iterator once asked in vain.
    for given in (x, iter(x)):
        assert draining(lambda: list(generate_many(target, None, given, 2, 6))) == [False] * 5 + [True] * 5
    # Two prompts in two rows: a list drains from the start; an iterator is never asked in vain.
    assert draining(lambda: list(generate_many(target, None, x[:2], 2, 6))) == [True] * 5
    assert draining(lambda: list(generate_many(target, None, iter(x[:2]), 2, 6))) == [False] * 5
    # A prompt appended to the list after the call (a follow-up turn) waits for a row like the others.
    queue = list(x[:2])

    def appended():
        answers = generate_many(target, None, queue, 2, 6)
        queue.append(x[2])
        list(answers)

    assert draining(appended) == [False] * 5 + [True] * 5


def test_the_draft_lag_keeps_each_rows_last_pairs():
    # Rounds of plain decoding leave each row's draft behind by their (token, feature) pairs, held
    # as they came and written to the ring when it is read or its rows move (or a window's worth):
    # the rows in step and apart (a new sequence in a row, not behind), a row past the window: what
    # the draft catches up on is each row's last pairs in order.
    from jakiro_ext.engine.draft_lag import DRAFT_WINDOW, DraftLag

    g = torch.Generator().manual_seed(0)
    lag, pairs = DraftLag(2, DRAFT_WINDOW), {0: [], 1: []}

    def defer(rounds):
        for _ in range(rounds):
            tokens, features = torch.randint(0, 100, (2, 1), generator=g), torch.randn(2, 1, 3, generator=g)
            lag.defer(tokens, features)
            for b in range(2):
                pairs[b].append((int(tokens[b, 0]), features[b, 0]))

    def caught_up(rebuilt):
        pending = lag.take([True, True])
        for b in range(2):
            want = pairs[b][-DRAFT_WINDOW:]
            k = pending.counts[b]
            assert k == len(want) and pending.tokens[b, :k].tolist() == [t for t, _ in want]
            assert torch.equal(pending.features[b, :k], torch.stack([f for _, f in want]))
            pairs[b].clear()
        assert pending.rebuilt == rebuilt

    defer(5)  # in step
    caught_up([])
    defer(3)
    lag.restart(0)  # row 0 now a new sequence: its pairs so far are not its own
    pairs[0].clear()
    defer(2)
    caught_up([])
    defer(4)
    lag.select([0, -1], torch.tensor([0, 0]))  # row 1 now a new sequence, not behind
    pairs[1].clear()
    defer(DRAFT_WINDOW + 3)  # apart by 4, row 0 past the window
    caught_up([0, 1])
    assert lag.take([True, True]) is None
