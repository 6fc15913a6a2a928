"""The long training run's learning curve, kept across machines: tokens seen, the training loss
and top-1 accuracy (means over the steps since the previous evaluation), the learning rate, and
the held-out acc1..acc4 with the contrastive branch's acc2..acc4, at every evaluation; one CSV
row per evaluation and head, and a chart (held-out acc1 and acc2 against tokens seen, all heads
on one chart, the training acc1 dashed).

    python benchmarks/long_run_curve.py --run jakiro=/work/run/jakiro/checkpoint.pt \\
        [--run eagle2=...] [--tokens-before jakiro=17.8e6 ...]
    python benchmarks/long_run_curve.py --run jakiro=runs/jakiro-long/head

A run is a checkpoint (``train --checkpoint-every``) or a head directory written from one by
``checkpoint_head.py`` (its ``training.json`` keeps the run's evaluations and what the head saw
before the run). ``--tokens-before``: what the head had seen before this run (its init), added
to the tokens axis so that heads continued from different points compare at equal tokens seen
(for a checkpoint; a head directory keeps its own). The rows already in the CSV are
kept, except a head's rows past the point its run started from: a run continued from an earlier
point (a checkpoint that does not outlive its machine, a new stretch from a committed head)
replaces the curve after that point. Writes ``results/long_run_curve.csv`` and ``.png``."""
import argparse
import csv
import json
import os

import torch

from common import RESULTS, save_figure, write_csv

EVAL_KEYS = ("eval_acc1", "eval_acc2", "eval_acc3", "eval_acc4",
             "eval_acc2_contrastive", "eval_acc3_contrastive", "eval_acc4_contrastive")
COLUMNS = ["head", "total_steps", "step", "tokens_seen", "run_tokens", "lr", "train_loss", "train_acc1",
           *(k.replace("eval_", "held_out_") for k in EVAL_KEYS)]


def curve(history, before: float):
    """One row per evaluation in ``history`` (the checkpoint's per-step records)."""
    rows, since = [], []
    for record in history:
        since.append(record)
        if not any(k in record for k in EVAL_KEYS):
            continue
        row = dict(step=record["step"], tokens_seen=int(record["tokens_seen"] + before),
                   run_tokens=int(record["tokens_seen"]), lr=record["lr"],
                   train_loss=round(sum(r["loss"] for r in since) / len(since), 4),
                   train_acc1=round(sum(r["acc1"] for r in since) / len(since), 4))
        row.update({k.replace("eval_", "held_out_"): round(record[k], 4) for k in EVAL_KEYS if k in record})
        rows.append(row)
        since = []
    return rows


def run_rows(path: str, before):
    """(tokens seen before the run, its curve rows with ``total_steps``) of a checkpoint (``before``
    as given, else 0) or a head directory written by checkpoint_head.py (its own figure)."""
    if os.path.isdir(path):
        with open(os.path.join(path, "training.json")) as f:
            run = json.load(f)["from_checkpoint"]
        if "evaluations" not in run:
            raise SystemExit(f"{path}/training.json keeps no evaluations (written before checkpoint_head.py kept them)")
        return run["tokens_seen_before"], [dict(r, total_steps=run["total_steps"]) for r in run["evaluations"]]
    state = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    before = before or 0.0
    return before, [dict(r, total_steps=state["total"]) for r in curve(state["history"], before)]


def merged(kept, name: str, before: float, new):
    """``kept`` (the CSV's rows) without ``name``'s rows past ``before``, then ``new``; by head, then
    tokens seen."""
    rows = [r for r in kept if r["head"] != name or float(r["tokens_seen"]) <= before]
    rows += [dict(head=name, **r) for r in new]
    return sorted(rows, key=lambda r: (r["head"], float(r["tokens_seen"])))


def read_rows(path: str):
    if not os.path.exists(path):
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", action="append", required=True, help="NAME=checkpoint.pt, or NAME=a head directory from checkpoint_head.py")
    ap.add_argument("--tokens-before", action="append", default=[], help="NAME=tokens the head saw before the run")
    ap.add_argument("--out", default=os.path.join(RESULTS, "long_run_curve.csv"))
    args = ap.parse_args()
    before = {k: float(v) for k, v in (item.split("=", 1) for item in args.tokens_before)}
    rows = read_rows(args.out)
    for item in args.run:
        name, path = item.split("=", 1)
        start, new = run_rows(path, before.get(name))
        rows = merged(rows, name, start, new)
        for row in new:
            print(name, row)
    write_csv(args.out, rows, fieldnames=COLUMNS)

    import matplotlib
    import matplotlib.ticker
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(r["head"] for r in rows):
        mine = [r for r in rows if r["head"] == name]
        x = [float(r["tokens_seen"]) / 1e6 for r in mine]
        line, = ax.plot(x, [float(r["held_out_acc1"]) for r in mine], marker="o", label=f"{name} held-out acc1")
        ax.plot(x, [float(r["held_out_acc2"]) for r in mine], marker="s", color=line.get_color(), alpha=0.6,
                label=f"{name} held-out acc2")
        ax.plot(x, [float(r["train_acc1"]) for r in mine], linestyle="--", color=line.get_color(), alpha=0.5,
                label=f"{name} training acc1")
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.xaxis.set_minor_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel("tokens seen (millions, the init's included)")
    ax.set_ylabel("top-1 accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, os.path.splitext(args.out)[0] + ".png", dpi=120)


if __name__ == "__main__":
    main()
