"""End-to-end speed on the prompts packaged with jakiro_ext (``jakiro_ext/data/prompts.jsonl``: 40
chat prompts, 8 categories), batch 1, float32: the CLI's ``bench`` command run for every method
(each prompt decoded by every method back to back, so machine noise hits them alike), at
temperature 0 (greedy; every method's tokens must equal plain decoding's) and at temperature 1
with top-p 0.9. tokens/s are pooled (total tokens / total seconds); tau counts every target
forward, the prompt's included.

Writes ``results/packaged_prompts.csv`` (one row per temperature and method, with the machine).
"""
import argparse
import json
import os
import subprocess
import sys

from common import CLI_CWD, RESULTS, machine, write_csv

METHODS = ("ar", "eagle2", "jakiro", "jakiro_star", "gumiho")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--limit", type=int, help="only the first N prompts")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--top-p", type=float, default=0.9, help="nucleus sampling above temperature 0")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tag", default="packaged_prompts", help="output file name stem")
    args = ap.parse_args()
    rows, where = [], machine()
    for temperature in args.temperatures:
        cmd = [sys.executable, "-m", "jakiro_ext", "bench", "--json", "--max-new-tokens", str(args.max_new_tokens),
               "--temperature", str(temperature), "--threads", str(args.threads),
               *(["--top-p", str(args.top_p)] if temperature > 0 else []),
               *(["--limit", str(args.limit)] if args.limit else []), *[a for m in args.methods for a in ("--method", m)]]
        print(" ".join(cmd), flush=True)
        run = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True, cwd=CLI_CWD)
        result = json.loads(run.stdout)
        config = result["config"]
        for method, s in result["methods"].items():
            if method != "ar" and temperature == 0 and not s["all_same_tokens_as_ar"]:
                sys.exit(f"{method}: tokens differ from plain decoding at temperature 0")
            tree = config["tree"].get(method)
            rows.append(dict(temperature=temperature, method=method, prompts=len(result["per_prompt"]),
                             max_new_tokens=args.max_new_tokens, top_p=config["top_p"],
                             tree="" if tree is None else f"{tree['total_tokens']}/{tree['depth']}/{tree['top_k']}",
                             tokens_per_s=round(s["tokens_per_s"], 2), tau=round(s["tau"], 3),
                             speedup_vs_ar=round(s["speedup_vs_ar"], 3),
                             all_same_tokens_as_ar=s.get("all_same_tokens_as_ar", ""), threads=config["threads"],
                             machine=where))
            print(rows[-1], flush=True)
    os.makedirs(RESULTS, exist_ok=True)
    write_csv(os.path.join(RESULTS, f"{args.tag}.csv"), rows, list(rows[0]))


if __name__ == "__main__":
    main()
