"""Draft-head recipes at equal data, parameters and wall-clock budget: each variant trains with
``python -m jakiro_ext train --minutes M --threads 1`` on the same token corpus (two at a time,
one thread each, side by side, so that both see the same machine), and the held-out evaluation
(acc1..acc4 drafting from the head's own features, and the contrastive branch's) is collected
into ``results/head_recipes.csv``. The heads stay in ``--out`` (one directory per variant) for
the end-to-end benchmark (``bench_end_to_end.py --jakiro-head DIR --eagle2-head DIR``).

Variants (name: kind, phases of the budget with their extra train options):
- ``eagle2``, ``jakiro``: today's recipe (the next feature and its tokens, teacher-forced);
- ``eagle2_ttt``, ``jakiro_ttt``: the training-time test from the start, 3 steps unrolled on the
  head's own features (EAGLE-3), for Jakiro with the contrastive branch at every step;
- ``eagle2_then_ttt``, ``jakiro_then_ttt``: the recipe for 2/3 of the budget, then the
  training-time test for 1/3 from that head (a step of the test costs ~5.6x one of the recipe);
- ``jakiro_8x``: 8 experts of half the width (the same parameters).
"""
import argparse
import json
import os
import shlex
import subprocess
import sys
import time

from common import RESULTS, write_csv

TTT = ["--ttt-steps", "3"]
VARIANTS = {  # name: (kind, [(fraction of the budget, extra options, starts from the previous phase)])
    "eagle2": ("eagle2", [(1.0, [], False)]),
    "jakiro": ("jakiro", [(1.0, [], False)]),
    "eagle2_ttt": ("eagle2", [(1.0, TTT, False)]),
    "jakiro_ttt": ("jakiro", [(1.0, TTT, False)]),
    "eagle2_then_ttt": ("eagle2", [(2 / 3, [], False), (1 / 3, TTT + ["--lr", "5e-4", "--warmup-steps", "10"], True)]),
    "jakiro_then_ttt": ("jakiro", [(2 / 3, [], False), (1 / 3, TTT + ["--lr", "5e-4", "--warmup-steps", "10"], True)]),
    "jakiro_8x": ("jakiro", [(1.0, ["--experts", "8"], False)]),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="the token corpus")
    ap.add_argument("--out", required=True, help="a directory for the heads (one sub-directory per variant)")
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--variants", nargs="+", default=["jakiro", "eagle2", "jakiro_then_ttt", "eagle2_then_ttt"],
                    choices=list(VARIANTS))
    ap.add_argument("--parallel", type=int, default=2, help="runs side by side (one thread each)")
    ap.add_argument("--lr", default="2e-3")
    args = ap.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    pending = list(args.variants)
    running = {}
    while pending or running:
        while pending and len(running) < args.parallel:
            name = pending.pop(0)
            kind, phases = VARIANTS[name]
            os.makedirs(args.out, exist_ok=True)
            commands, previous = [], None
            for i, (fraction, extra, from_previous) in enumerate(phases):
                out = os.path.join(args.out, name if i == len(phases) - 1 else f"{name}.phase{i}")
                cmd = [sys.executable, "-m", "jakiro_ext", "train", "--kind", kind, "--out", out, "--data", args.data,
                       "--minutes", f"{args.minutes * fraction:.2f}", "--threads", "1", "--lr", args.lr,
                       "--warmup-steps", "50", "--eval-every", "1000000", "--checkpoint-every", "100", *extra]
                if from_previous:
                    cmd += ["--init-from", previous]
                commands.append(" ".join(shlex.quote(c) for c in cmd))
                previous = out
            log = open(os.path.join(args.out, f"{name}.log"), "w")
            running[name] = (subprocess.Popen(["bash", "-c", " && ".join(commands)], cwd=root, stdout=log,
                                              stderr=subprocess.STDOUT), log)
            print(f"started {name}: {' && '.join(commands)}", flush=True)
        time.sleep(5)
        for name, (proc, log) in list(running.items()):
            if proc.poll() is not None:
                log.close()
                del running[name]
                if proc.returncode:
                    sys.exit(f"{name} failed (exit {proc.returncode}): see {os.path.join(args.out, name + '.log')}")
                print(f"finished {name}", flush=True)
    rows = []
    for name in args.variants:
        summary = json.loads(open(os.path.join(args.out, name, "training.json")).read())
        phases = [json.loads(open(os.path.join(args.out, f"{name}.phase{i}", "training.json")).read())
                  for i in range(len(VARIANTS[name][1]) - 1)] + [summary]
        t = summary["train"]
        row = dict(variant=name, kind=summary["kind"], ttt_steps=t["ttt_steps"], minutes=args.minutes,
                   steps="+".join(str(p["train"]["total_steps"]) for p in phases),
                   tokens_seen=sum(p["train"]["tokens_seen"] for p in phases),
                   seconds=round(sum(p["train"]["seconds"] for p in phases), 1),
                   **{k.replace("eval_", ""): round(v, 4) for k, v in sorted(summary["final_eval"].items())})
        print(row)
        rows.append(row)
    os.makedirs(RESULTS, exist_ok=True)
    fields = list(dict.fromkeys(k for r in rows for k in r))
    write_csv(os.path.join(RESULTS, "head_recipes.csv"), rows, fields)


if __name__ == "__main__":
    main()
