"""Speculation that never loses: Jakiro with the shipped head and the tree left to the engine
(chosen round by round from live timing, :mod:`jakiro_ext.engine.adaptive`) against plain
decoding, at several batch sizes, greedy and sampling, with the cached round costs as the engine
would find them:

* ``fresh``: measured on the idle machine (deleted, then measured by the run's first call);
* ``loaded``: measured while two other processes kept both cores busy (the cache a user gets
  who first ran the engine during a build), then used on the idle machine, and deleted after their
  configuration (not left in the cache for the engine's next call).

Four arms decode the same calls: plain decoding; ``live``: a new head for every call (its chooser
starts from the cost file as measured and what the last choosers kept beside it, as a new process
would: every call is a first call); ``warm``: one head
for the whole configuration (its chooser carries over from call to call, after one call to warm
it); ``fixed``: the cost model's fixed tree from the same cache (what the engine ran before the
live choice). A head is loaded before every arm's call (the live and fixed arms decode with it):
a load's memory traffic slows the call after it, whichever arm. SmolLM2-135M-Instruct in float32 (``--dtype``: bfloat16, or its GGUF file's Q4_1 blocks); a call is B consecutive packaged prompts (chat
template, cycling through them) through ``generate_many``; ``--groups`` calls, each run by the
four arms in turn (the order rotated) before the next, ``--repeats`` times: the machine drifts by
a quarter within minutes (its memory bandwidth is shared), so the arms are interleaved a call at a
time. tokens/s = new tokens / wall time over all of an arm's calls, prefills included; the worst
ratio to plain decoding over the repetitions is reported too. Greedy runs check every sequence's
tokens against plain decoding. Sampling runs ignore EOS: every sequence gets
``--max-new-tokens`` (each arm draws its own tokens, and answers ending at different lengths would
weigh the prefills differently). Writes ``results/never_loses.csv``."""
import argparse
import json
import multiprocessing
import os
import statistics
import time
from pathlib import Path

import torch

from common import RESULTS, machine, write_csv


def burn(stop):
    x = 0
    while not stop.is_set():
        for i in range(100000):
            x += i * i


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--caches", nargs="+", default=["fresh", "loaded"], choices=["fresh", "loaded"])
    ap.add_argument("--groups", type=int, default=8, help="calls of B prompts per repetition")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "gguf"],
                    help="the target's weights: float32, bfloat16, or the GGUF file's own blocks (Q4_1)")
    ap.add_argument("--repeats", type=int, default=2, help="passes over the calls")
    ap.add_argument("--out", default=os.path.join(RESULTS, "never_loses.csv"))
    ap.add_argument("--trace", help="also write every live choice's rounds here (CSV: configuration, arm, call, "
                                    "round, tree, rows, seconds, tokens, catch-up seconds, mean context)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from jakiro_ext.engine import adaptive
    trace, where = [], {}
    if args.trace:  # each round the chooser records, with where it ran
        record = adaptive.TreeChooser.record

        def traced(self, candidate, rows, seconds, tokens, catch_up=0.0, context=None, left=None):
            tree = "plain" if candidate.tree is None else adaptive.tree_key(candidate.tree)
            trace.append(dict(where, round=self.round, tree=tree, rows=rows, seconds=round(seconds, 5),
                              tokens=round(tokens, 3), catch_up=round(catch_up, 5),
                              context=None if context is None else round(context, 1)))
            record(self, candidate, rows, seconds, tokens, catch_up, context, left)
        adaptive.TreeChooser.record = traced

    from jakiro_ext.cli.common import HEADS_DIR, chat_ids, load_head
    from jakiro_ext.engine import policy, tree_cost
    from jakiro_ext.engine.generate import generate_many
    from jakiro_ext.engine.policy import default_tree
    from jakiro_ext.methods import METHODS
    from jakiro_ext.models.default import DEFAULT_MODEL, load_default_target

    target, tokenizer = load_default_target(args.dtype if args.dtype == "gguf" else getattr(torch, args.dtype))
    prompts = [chat_ids(tokenizer, json.loads(line)["prompt"], True).flatten()
               for line in (Path(HEADS_DIR).parent / "data" / "prompts.jsonl").read_text().splitlines() if line.strip()]

    def fresh_head():  # a new head: its live measurements start from nothing
        return load_head(METHODS["jakiro"].shipped_head, None, target, DEFAULT_MODEL)

    def run(head, method, group, temperature, tree=None):
        """(new tokens, seconds, token ids by prompt) of one call."""
        t0 = time.perf_counter()
        tokens, outs = 0, {}
        for i, out in generate_many(target, head, group, len(group), args.max_new_tokens, method=method,
                                    tree=tree, temperature=temperature, top_p=0.9 if temperature else 1.0,
                                    eos_token_id=None if temperature else tokenizer.eos_token_id):
            tokens += out.stats.new_tokens
            outs[i] = out.token_ids
        return tokens, time.perf_counter() - t0, outs

    rows = []
    for batch in args.batch_sizes:
        for cache in args.caches:
            path = tree_cost.costs_path(target, fresh_head(), "jakiro", batch)
            path.unlink(missing_ok=True)
            policy.live_path(path).unlink(missing_ok=True)  # (what earlier choosers kept: this run's to measure)
            stop = multiprocessing.Event()
            burners = [multiprocessing.Process(target=burn, args=(stop,)) for _ in range(2 if cache == "loaded" else 0)]
            for p in burners:
                p.start()
            tree_cost.load_costs(target, fresh_head(), "jakiro", batch=batch, progress=False)
            stop.set()
            for p in burners:
                p.join()
            measured = path.read_text()
            fixed = default_tree(target, fresh_head(), "jakiro", batch=batch)
            for temperature in args.temperatures:
                warm_head = fresh_head()
                path.write_text(measured)  # (a live run deletes costs that disagree)
                where.update(batch=batch, temperature=temperature, costs=cache, arm="warm", call=-1)
                run(warm_head, "jakiro", prompts[:batch], temperature)  # the warm arm's first call, not counted
                # Every arm's call follows a head's load, used or not: a load's memory traffic
                # slows the call after it (plain decoding's by 2-3% on the Q4_1 file, whose
                # weights the Xeon's cache holds), a cost of the load, not of the arm.
                arms = {
                    "plain": lambda group, head: run(None, "ar", group, temperature),
                    "live": lambda group, head: (path.write_text(measured), run(head, "jakiro", group, temperature))[1],
                    "warm": lambda group, head: run(warm_head, "jakiro", group, temperature),
                    "fixed": lambda group, head: run(head, "jakiro", group, temperature, fixed)}
                totals = {name: [[0, 0.0] for _ in range(args.repeats)] for name in arms}
                for r in range(args.repeats):
                    for g in range(args.groups):
                        first = (r * args.groups + g) * batch
                        group = [prompts[(first + i) % len(prompts)] for i in range(batch)]
                        names = list(arms)[g % 4:] + list(arms)[:g % 4]  # the order rotated: drift hits every arm alike
                        outs = {}
                        for name in names:
                            where.update(batch=batch, temperature=temperature, costs=cache, arm=name, call=r * args.groups + g)
                            tokens, seconds, outs[name] = arms[name](group, fresh_head())
                            totals[name][r][0] += tokens
                            totals[name][r][1] += seconds
                        if temperature == 0:
                            assert all(o == outs["plain"] for o in outs.values()), "greedy tokens differ from plain decoding"
                rate = {name: sum(t for t, _ in v) / sum(s for _, s in v) for name, v in totals.items()}
                worst = {name: min(t / s / (p_t / p_s) for (t, s), (p_t, p_s) in zip(v, totals["plain"]))
                         for name, v in totals.items()}
                plain, live, warm, fixed_rate = rate["plain"], rate["live"], rate["warm"], rate["fixed"]
                live_x, warm_x, fixed_x = live / plain, warm / plain, fixed_rate / plain
                row = dict(batch=batch, temperature=temperature, costs=cache, ar_tokens_per_s=round(plain, 1),
                           live_tokens_per_s=round(live, 1), live_vs_ar=round(live_x, 3),
                           warm_tokens_per_s=round(warm, 1), warm_vs_ar=round(warm_x, 3),
                           fixed_tree=f"{fixed.total_tokens}/{fixed.depth}/{fixed.top_k}",
                           fixed_tokens_per_s=round(fixed_rate, 1), fixed_vs_ar=round(fixed_x, 3),
                           live_worst_vs_ar=round(worst["live"], 3), warm_worst_vs_ar=round(worst["warm"], 3),
                           calls=args.groups * args.repeats, dtype=args.dtype,
                           machine=machine(), threads=args.threads)
                rows.append(row)
                print(f"B={batch} T={temperature} costs {cache:8s} ar {plain:6.1f}  live {live:6.1f} "
                      f"({live_x:.2f}x)  warm {warm:6.1f} ({warm_x:.2f}x)  fixed {row['fixed_tree']} {fixed_rate:6.1f} ({fixed_x:.2f}x)",
                      flush=True)
                write_csv(args.out, rows)  # after every configuration: a stopped run keeps what it measured
                if args.trace:
                    write_csv(args.trace, trace)
            if cache == "loaded":  # not left for the engine's next call (it would find them wrong and measure again)
                path.unlink(missing_ok=True)
                policy.live_path(path).unlink(missing_ok=True)


if __name__ == "__main__":
    main()
