"""Choosing the default CPU tree by measurement: Jakiro with the shipped head at temperature 0
over one question of each of the 13 MT-bench / Spec-Bench categories (bench_end_to_end.py,
plain decoding back to back with each run), for several total/depth/top-k trees. Writes
``results/tree_choice.csv``: per tree, Jakiro's tokens/s, tau and speedup over plain decoding
(the mean over categories). The best one becomes ``engine.CPU_TREE``."""
import argparse
import csv
import os
import subprocess
import sys

from common import RESULTS

TREES = [(3, 2, 1), (4, 3, 1), (5, 4, 1), (6, 2, 2), (8, 3, 2), (10, 3, 3), (16, 4, 4)]


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--method", default="jakiro", choices=["eagle2", "jakiro", "jakiro_star"])
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = ap.parse_args()
    here = os.path.dirname(os.path.abspath(__file__))
    rows = []
    for total, depth, top_k in TREES:
        tag = "tree_choice_run"
        subprocess.run([sys.executable, os.path.join(here, "bench_end_to_end.py"), "--per-category", "1", "--no-hf",
                        "--temperatures", "0", "--methods", args.method, "--max-new-tokens", str(args.max_new_tokens),
                        "--dtype", args.dtype, "--total-tokens", str(total), "--depth", str(depth), "--top-k-draft",
                        str(top_k), "--tag", tag], check=True, stdout=subprocess.DEVNULL)
        with open(os.path.join(RESULTS, f"{tag}_summary.csv")) as f:
            overall = next(r for r in csv.DictReader(f) if r["category"] == "overall" and r["method"] == args.method)
        row = dict(method=args.method, dtype=args.dtype, total_tokens=total, depth=depth, top_k=top_k,
                   tokens_per_s=overall["tokens_per_s"], tau=overall["tau"], speedup_vs_ar=overall["speedup_vs_ar"])
        print(row, flush=True)
        rows.append(row)
        for suffix in (".csv", "_summary.csv", ".png"):
            os.remove(os.path.join(RESULTS, f"{tag}{suffix}"))
    with open(os.path.join(RESULTS, "tree_choice.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


if __name__ == "__main__":
    main()
