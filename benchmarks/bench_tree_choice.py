"""The tree chosen by measured cost (jakiro_ext.engine.tree_cost) against the grid of fixed trees around
it: one method with its head at temperature 0 over one question of each of the 13 MT-bench /
Spec-Bench categories (bench_end_to_end.py, plain decoding back to back with each run). Writes
``results/tree_choice_<method>.csv``: per tree, the model's expected tokens/s and accepted tokens
per round, and the measured tokens/s, tau and speedup over plain decoding (the mean over
categories)."""
import argparse
import csv
import os
import subprocess
import sys

import torch

from common import RESULTS, write_csv


def neighbours(n, d, k):
    """The chosen tree and the fixed trees around it: half and twice the nodes, one layer
    shallower and deeper, one child fewer and more."""
    out = [(n, d, k), (max(2, n // 2), d, k), (min(64, 2 * n), d, k), (n, max(1, d - 1), k), (n, d + 1, k),
           (n, d, max(1, k - 1)), (n, d, k + 1)]
    return list(dict.fromkeys(out))


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--method", default="jakiro", choices=["eagle2", "jakiro", "jakiro_star"])
    ap.add_argument("--head", help="the head directory (default: the shipped one)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from jakiro_ext.cli.common import load_head
    from jakiro_ext.methods import METHODS
    from jakiro_ext.models.default import DEFAULT_MODEL, load_default_target
    from jakiro_ext.engine.tree_cost import choose_tree, expected_accepted, load_costs, rate

    kind = METHODS[args.method].shipped_head
    target, _ = load_default_target(getattr(torch, args.dtype))
    head = load_head(kind, args.head, target, DEFAULT_MODEL)
    if not head.acceptance:
        sys.exit("the head has no acceptance profile (acceptance.json): train it with a held-out set")
    costs = load_costs(target, head, args.method)
    chosen, _ = choose_tree(costs, head.acceptance, args.method)
    min_depth = 2 if args.method == "jakiro" else 1
    trees = [t for t in neighbours(chosen.total_tokens, chosen.depth, chosen.top_k) if t[1] >= min_depth]
    here = os.path.dirname(os.path.abspath(__file__))
    rows = []
    for total, depth, top_k in trees:
        tag = "tree_choice_run"
        accepted = expected_accepted(head.acceptance, total, depth, top_k, args.method)
        predicted = rate(costs, total, depth, top_k, accepted) if f"{depth},{top_k}" in costs["draft"] else float("nan")
        subprocess.run([sys.executable, os.path.join(here, "bench_end_to_end.py"), "--per-category", "1", "--no-hf",
                        "--temperatures", "0", "--methods", args.method, "--max-new-tokens", str(args.max_new_tokens),
                        "--dtype", args.dtype, "--threads", str(args.threads), "--total-tokens", str(total),
                        "--depth", str(depth), "--top-k-draft", str(top_k), "--tag", tag,
                        f"--{kind.replace('_', '-')}-head", args.head or os.path.join(
                            os.path.dirname(here), "jakiro_ext", "heads", f"{DEFAULT_MODEL}-{kind}")],
                       check=True, stdout=subprocess.DEVNULL)
        with open(os.path.join(RESULTS, f"{tag}_summary.csv")) as f:
            summary = list(csv.DictReader(f))
        overall = next(r for r in summary if r["category"] == "overall" and r["method"] == args.method)
        ar = next(r for r in summary if r["category"] == "overall" and r["method"] == "ar")
        row = dict(method=args.method, dtype=args.dtype, chosen=(total, depth, top_k) == trees[0], total_tokens=total,
                   depth=depth, top_k=top_k, expected_tokens_per_s=round(predicted, 1),
                   expected_accepted=round(accepted, 3), tokens_per_s=overall["tokens_per_s"], tau=overall["tau"],
                   ar_tokens_per_s=ar["tokens_per_s"], speedup_vs_ar=overall["speedup_vs_ar"])
        print(row, flush=True)
        rows.append(row)
        for suffix in (".csv", "_summary.csv", ".png"):
            os.remove(os.path.join(RESULTS, f"{tag}{suffix}"))
    write_csv(os.path.join(RESULTS, f"tree_choice_{args.method}.csv"), rows)


if __name__ == "__main__":
    main()
