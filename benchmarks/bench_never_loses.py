"""Speculation that never loses: Jakiro with the shipped head and the tree left to the engine
(chosen round by round from live timing, :mod:`jakiro_ext.engine.adaptive`) against plain
decoding, at several batch sizes, greedy and sampling, with the cached round costs as the engine
would find them:

* ``fresh``: measured on the idle machine (deleted, then measured by the run's first call);
* ``loaded``: measured while two other processes kept both cores busy (the cache a user gets
  who first ran the engine during a build), then used on the idle machine.

The live choice runs twice with one head: its first call (``live``: the head's chooser starts
from nothing) and the next (``warm``: it starts from what the first measured). For each, also the
cost model's fixed tree from the same cache (what the engine ran before the live choice). SmolLM2-135M-Instruct in float32, the packaged prompts (chat template), batches of
B consecutive prompts through ``generate_many``; tokens/s = new tokens / wall time, prefills
included, the median of ``--repeats`` alternating runs of the four (runs of a few seconds move by
several percent from one to the next); greedy runs check every sequence's tokens against plain
decoding. Writes ``results/never_loses.csv``."""
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
    ap.add_argument("--prompts", type=int, default=8, help="prompts per run (at least the batch size)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="alternating runs of each method; medians reported")
    ap.add_argument("--out", default=os.path.join(RESULTS, "never_loses.csv"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from jakiro_ext.cli.common import HEADS_DIR, chat_ids, load_head
    from jakiro_ext.engine import tree_cost
    from jakiro_ext.engine.generate import default_tree, generate_many
    from jakiro_ext.methods import METHODS
    from jakiro_ext.models.default import DEFAULT_MODEL, load_default_target

    target, tokenizer = load_default_target(torch.float32)
    prompts = [chat_ids(tokenizer, json.loads(line)["prompt"], True).flatten()
               for line in (Path(HEADS_DIR).parent / "data" / "prompts.jsonl").read_text().splitlines() if line.strip()]

    def fresh_head():  # a new head: its live measurements start from nothing
        return load_head(METHODS["jakiro"].shipped_head, None, target, DEFAULT_MODEL)

    def run(head, method, batch, temperature, tree=None):
        n = max(batch, args.prompts)
        t0 = time.perf_counter()
        tokens, outs = 0, {}
        for i, out in generate_many(target, head, iter(prompts[:n]), batch, args.max_new_tokens, method=method,
                                    tree=tree, temperature=temperature, top_p=0.9 if temperature else 1.0,
                                    eos_token_id=tokenizer.eos_token_id):
            tokens += out.stats.new_tokens
            outs[i] = out.token_ids
        return tokens / (time.perf_counter() - t0), outs

    rows = []
    for batch in args.batch_sizes:
        for cache in args.caches:
            path = tree_cost.costs_path(target, fresh_head(), "jakiro", batch)
            path.unlink(missing_ok=True)
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
                rates = {"plain": [], "live": [], "warm": [], "fixed": []}
                for _ in range(args.repeats):  # alternating: machine noise hits every method alike
                    plain, plain_outs = run(None, "ar", batch, temperature)
                    path.write_text(measured)  # as the engine finds it (a live run deletes costs that disagree)
                    head = fresh_head()
                    live, live_outs = run(head, "jakiro", batch, temperature)
                    warm, warm_outs = run(head, "jakiro", batch, temperature)  # the head's chooser from the last call
                    fixed_rate, fixed_outs = run(fresh_head(), "jakiro", batch, temperature, fixed)
                    if temperature == 0:
                        assert live_outs == warm_outs == plain_outs == fixed_outs, "greedy tokens differ from plain decoding"
                    for name, value in zip(rates, (plain, live, warm, fixed_rate)):
                        rates[name].append(value)
                plain, live, warm, fixed_rate = (statistics.median(v) for v in rates.values())
                row = dict(batch=batch, temperature=temperature, costs=cache, ar_tokens_per_s=round(plain, 1),
                           live_tokens_per_s=round(live, 1), live_vs_ar=round(live / plain, 3),
                           warm_tokens_per_s=round(warm, 1), warm_vs_ar=round(warm / plain, 3),
                           fixed_tree=f"{fixed.total_tokens}/{fixed.depth}/{fixed.top_k}",
                           fixed_tokens_per_s=round(fixed_rate, 1), fixed_vs_ar=round(fixed_rate / plain, 3),
                           machine=machine(), threads=args.threads)
                rows.append(row)
                print(f"B={batch} T={temperature} costs {cache:8s} ar {plain:6.1f}  live {live:6.1f} "
                      f"({live / plain:.2f}x)  warm {warm:6.1f} ({warm / plain:.2f}x)  fixed {row['fixed_tree']} {fixed_rate:6.1f} ({fixed_rate / plain:.2f}x)",
                      flush=True)
                write_csv(args.out, rows)  # after every configuration: a stopped run keeps what it measured


if __name__ == "__main__":
    main()
