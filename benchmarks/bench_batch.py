"""Throughput of batched decoding on SmolLM2-135M-Instruct: the engine's plain decoding (``ar``),
EAGLE-2 and Jakiro with the shipped heads, at batch sizes 1 to 64, and where speculation stops
paying.

Prompts: MT-bench and Spec-Bench first turns with the chat template, taken across categories
(``bench_end_to_end.load_questions``); at batch size B the first max(B, --min-prompts) prompts
run in batches of B (consecutive prompts). tokens/s = every sequence's new tokens / the batches'
wall time (and decode tokens/s: the tokens after each prompt's first / the wall time less the
prompts' prefills, which run one by one). Each speculative method runs every tree of a small grid (the tree chosen by measured
cost for that batch size, the batch-1 choice, and smaller ones) and its best measured tree per
batch size is reported, with the cost model's choice beside it: a bigger batch leaves less idle
compute for the extra tree tokens, so the tree that pays shrinks.
Greedy runs check that every sequence's tokens equal plain decoding's.

Writes ``results/batch.csv`` (every run), ``results/batch_summary.csv`` (each method's best tree
per batch size and temperature, with its speedup over ``ar`` at that batch size) and
``results/batch.png``.
"""
import argparse
import os
import time

import torch

from bench_end_to_end import load_questions
from common import RESULTS, save_figure, write_csv

METHODS = ("eagle2", "jakiro")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--min-prompts", type=int, default=16, help="prompts run at the small batch sizes")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--sampled-batch-sizes", type=int, nargs="+", default=[1, 16],
                    help="batch sizes also run at temperatures > 0")
    ap.add_argument("--top-p", type=float, default=0.9, help="nucleus sampling above temperature 0")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tag", default="batch")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from tqdm import tqdm

    from jakiro_ext.cli.common import chat_ids, load_head
    from jakiro_ext.config import CPU_TREE, TreeConfig
    from jakiro_ext.engine.generate import speculative_generate
    from jakiro_ext.models.default import DEFAULT_MODEL, load_default_hf
    from jakiro_ext.models.llama import LlamaModel
    from jakiro_ext.engine.tree_cost import auto_tree

    hf, tokenizer = load_default_hf(torch.float32)
    target = LlamaModel.from_hf(hf, torch.float32)
    del hf
    heads = {k: load_head(k, None, target, DEFAULT_MODEL) for k in METHODS}
    # Each method's grid at batch size B: the tree chosen by measured cost for B (the costs are
    # measured at B once and cached), the batch-1 choice, then smaller trees (one drafted token
    # per round; for jakiro one plus its contrastive candidate).
    smallest = {"eagle2": [TreeConfig(3, 1, 2), TreeConfig(2, 1, 1)], "jakiro": [TreeConfig(4, 2, 2), TreeConfig(3, 2, 1)]}
    chosen = {(m, b): auto_tree(target, heads[m], m, b) or CPU_TREE for m in METHODS for b in args.batch_sizes}
    grid = {}
    for m in METHODS:
        for b in args.batch_sizes:
            trees = [chosen[m, b]] + ([chosen[m, 1]] if b <= 4 and (m, 1) in chosen else []) + smallest[m]
            grid[m, b] = [t for i, t in enumerate(trees) if t not in trees[:i]]
    name = lambda t: f"{t.total_tokens}/{t.depth}/{t.top_k}"  # noqa: E731
    print("trees chosen by cost: " + "; ".join(f"{m} B={b} {name(t)}" for (m, b), t in chosen.items()), flush=True)
    eos = tokenizer.eos_token_id
    largest = max(max(args.batch_sizes), args.min_prompts)
    questions = load_questions(per_category=largest)
    # Round-robin over categories, so any prefix mixes them.
    by_category = {}
    for q in questions:
        by_category.setdefault(q["category"], []).append(q)
    mixed = [q for group in zip(*by_category.values()) for q in group][:largest]
    prompts = [chat_ids(tokenizer, q["turns"][0]) for q in mixed]

    def run(method, tree, batch, temperature):
        head = heads.get(method)
        t0 = time.perf_counter()
        out = speculative_generate(target, head, batch, args.max_new_tokens, method=method, tree=tree,
                                   temperature=temperature, top_p=args.top_p if temperature > 0 else 1.0,
                                   eos_token_id=eos, seed=0)
        outs = out if isinstance(out, list) else [out]
        seconds = time.perf_counter() - t0
        return outs, seconds, seconds - sum(o.stats.prefill_s for o in outs)  # prompts are prefilled one by one

    for m in ("ar",) + METHODS:  # warm-up
        run(m, chosen.get((m, 1)), prompts[:2], 0.0)
    configs = [(t, b) for t in args.temperatures for b in args.batch_sizes
               if t == 0 or b in args.sampled_batch_sizes]
    rows = []
    bar = tqdm(total=sum(1 + sum(len(grid[m, b]) for m in METHODS) for _, b in configs), desc="batch", unit="run")
    for temperature, size in configs:
        subset = prompts[:max(size, args.min_prompts)]
        batches = [subset[i:i + size] for i in range(0, len(subset), size)]
        reference = None
        for method, tree in [("ar", None)] + [(m, t) for m in METHODS for t in grid[m, size]]:
            tokens, seconds, decode_seconds, forwards, outputs = 0, 0.0, 0.0, 0, []
            for batch in batches:
                outs, dt, decode = run(method, tree, batch if size > 1 else batch[0], temperature)
                seconds += dt
                decode_seconds += decode
                tokens += sum(o.stats.new_tokens for o in outs)
                forwards += sum(o.stats.target_forwards for o in outs)
                outputs += [o.token_ids for o in outs]
            if method == "ar":
                reference = outputs
            rows.append(dict(temperature=temperature, batch_size=size, prompts=len(subset), method=method,
                             tree="" if tree is None else name(tree),
                             chosen_by_cost=tree is not None and tree == chosen[method, size],
                             new_tokens=tokens, seconds=round(seconds, 3), tokens_per_s=round(tokens / seconds, 2),
                             decode_tokens_per_s=round((tokens - len(outputs)) / decode_seconds, 2),
                             tau=round(tokens / forwards, 3),
                             same_tokens_as_ar=(outputs == reference) if temperature == 0 and method != "ar" else ""))
            bar.update(1)
            bar.set_postfix_str(f"T={temperature} B={size} {method} {rows[-1]['tree']} {rows[-1]['tokens_per_s']} tok/s")
    bar.close()

    os.makedirs(RESULTS, exist_ok=True)
    from jakiro_ext.machine import cpu_name

    machine = f"{cpu_name()}, {args.threads} threads"
    for r in rows:
        r["machine"] = machine
    write_csv(os.path.join(RESULTS, f"{args.tag}.csv"), rows)
    summary = []
    for temperature, size in configs:
        here = [r for r in rows if r["temperature"] == temperature and r["batch_size"] == size]
        ar = next(r for r in here if r["method"] == "ar")
        for method in ("ar",) + METHODS:
            best = max((r for r in here if r["method"] == method), key=lambda r: r["tokens_per_s"])
            by_cost = next((r for r in here if r["method"] == method and r["chosen_by_cost"]), best)
            summary.append(dict(best, speedup_vs_ar=round(best["tokens_per_s"] / ar["tokens_per_s"], 3),
                                decode_speedup_vs_ar=round(best["decode_tokens_per_s"] / ar["decode_tokens_per_s"], 3),
                                tree_by_cost=by_cost["tree"], tokens_per_s_by_cost=by_cost["tokens_per_s"]))
    write_csv(os.path.join(RESULTS, f"{args.tag}_summary.csv"), summary)
    chart(summary, os.path.join(RESULTS, f"{args.tag}.png"))
    for r in summary:
        print(r)


def write_csv(path, rows):
    write_csv(path, rows)


def chart(summary, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for temperature, style in ((0.0, "-"), (1.0, "--")):
        for method, color in (("ar", "gray"), ("eagle2", "tab:blue"), ("jakiro", "tab:red")):
            pts = sorted((r["batch_size"], r["tokens_per_s"], r["speedup_vs_ar"]) for r in summary
                         if r["temperature"] == temperature and r["method"] == method)
            if not pts:
                continue
            label = f"{method} T={temperature:g}"
            left.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", color=color, label=label)
            if method != "ar":
                right.plot([p[0] for p in pts], [p[2] for p in pts], style, marker="o", color=color, label=label)
    right.axhline(1.0, color="gray", lw=0.8)
    for ax, title in ((left, "throughput (tokens/s, best tree)"), (right, "speedup over ar at the same batch size")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_title(title)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle("SmolLM2-135M-Instruct, float32, CPU: batched speculative decoding")
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


if __name__ == "__main__":
    main()
