"""The scaling curve of draft-head training: held-out acc1..acc4 against the tokens seen, for heads
trained with equal compute, with a power-law fit and what ten and a hundred times the compute
would give.

The runs come from ``bench_head_recipes.py`` with ``--eval-doublings`` (an evaluation each time the
tokens seen double) and ``--checkpoint-every`` (the checkpoint keeps every step's training
accuracy), for example::

    python bench_head_recipes.py --data ../corpus/SmolLM2-135M-Instruct --shards 8 --out runs \\
        --variants eagle2 jakiro --minutes 55 --eval-every 600 --eval-doublings 250000 \\
        --checkpoint-every 200 --tag _long
    python bench_head_recipes.py --data ../corpus/SmolLM2-135M-Instruct --shards 8 --out short \
        --variants eagle2 jakiro --minutes 8
    python bench_scaling_curve.py --runs runs --variants eagle2 jakiro \
        --endpoints eagle2=short/eagle2 jakiro=short/jakiro

The fit: the held-out miss rate falls as a power of the tokens seen, ``1 - acc_k = c * T^-a``
(least squares in log-log). Two fits per head and depth:
- ``within_run``: over the run's own evaluations from ``--fit-from`` tokens on (past the
  warm-up). The learning rate decays over the run (cosine), so a middle evaluation is below what
  a run of that length would reach, and the end gains from the decay: this fit's exponent mixes
  the schedule with the tokens.
- ``endpoints``: over the final evaluations of runs of different lengths, each decayed to its
  end (``--endpoints HEAD=DIR``: shorter runs of the same kind, on the same data and held-out
  set, with the same schedule), and this run's end: what a longer run would give.
Data against compute: beside each evaluation stand the epochs seen and the training accuracy
over the steps just before it (the same batches' acc1, on the target's features with the
training noise): a held-out curve that keeps its slope through repeated epochs, with no
widening gap to the training accuracy, says the data is not what runs out first.

Writes ``results/scaling_curve.csv`` (one row per head and evaluation), ``results/scaling_curve_fit.csv``
(one row per head, depth and fit: exponent, and the fitted accuracy at 1x, 10x, 100x the run's
tokens)
and ``results/scaling_curve.png``.
"""
import argparse
import json
import math
import os

import torch

from common import RESULTS, save_figure, write_csv

DEPTHS = ("acc1", "acc2", "acc3", "acc4")
TRAIN_WINDOW = 50  # training steps averaged for the training accuracy beside an evaluation


def read_run(run_dir):
    """A finished run's evaluations, each with the epochs seen and the training acc1 just before it."""
    summary = json.load(open(os.path.join(run_dir, "training.json")))
    steps = torch.load(os.path.join(run_dir, "checkpoint.pt"), map_location="cpu", weights_only=False)["history"]
    per_epoch = summary["train"]["tokens_seen"] / max(summary["train"]["epochs_seen"], 1e-9)
    rows = []
    for e in summary["eval_history"]:
        before = [r["acc1"] for r in steps[max(0, e["step"] - TRAIN_WINDOW):e["step"]] if "acc1" in r]
        rows.append(dict(step=e["step"], tokens_seen=e["tokens_seen"], epochs=round(e["tokens_seen"] / per_epoch, 3),
                         **{k: round(e["eval_" + k], 4) for k in DEPTHS if "eval_" + k in e},
                         train_acc1=round(sum(before) / len(before), 4) if before else None))
    return summary, rows


def end_point(run_dir):
    """A finished run's final evaluation and tokens seen."""
    summary = json.load(open(os.path.join(run_dir, "training.json")))
    t = summary["train"]
    return dict(step=t["total_steps"], tokens_seen=t["tokens_seen"], epochs=t["epochs_seen"],
                **{k: round(summary["final_eval"]["eval_" + k], 4) for k in DEPTHS})


def fit_power_law(tokens, acc):
    """Least squares of log(1 - acc) = log c - a log T; returns (c, a)."""
    xs = [math.log(t) for t in tokens]
    ys = [math.log(1 - v) for v in acc]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return math.exp(my - slope * mx), -slope


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", required=True, help="bench_head_recipes.py's --out directory")
    ap.add_argument("--variants", nargs="+", default=["eagle2", "jakiro"])
    ap.add_argument("--fit-from", type=float, default=500_000, help="fit over the evaluations from this many tokens on")
    ap.add_argument("--endpoints", nargs="*", default=[], metavar="HEAD=DIR",
                    help="finished shorter runs of a head's kind on the same data (each decayed to its end)")
    ap.add_argument("--tag", default="", help="appended to the output names")
    args = ap.parse_args()
    curve, fits, series = [], [], {}
    for name in args.variants:
        summary, rows = read_run(os.path.join(args.runs, name))
        t = summary["train"]
        for r in rows:
            curve.append(dict(head=name, kind=summary["kind"], **r))
        series[name] = rows
        fitted = [r for r in rows if r["tokens_seen"] >= args.fit_from]
        if len(fitted) < 3:
            raise SystemExit(f"{name}: {len(fitted)} evaluations from {args.fit_from:.0f} tokens on; a fit needs 3")
        ends = [end_point(d) for h, d in (e.split("=", 1) for e in args.endpoints) if h == name] + [rows[-1]]
        for r in ends[:-1]:
            curve.append(dict(head=name, kind=summary["kind"], endpoint_of_a_shorter_run=True, **r))
        total = t["tokens_seen"]
        for fit, points in (("within_run", fitted), ("endpoints", ends)):
            if fit == "endpoints" and len(points) < 2:
                continue
            for k in DEPTHS:
                c, a = fit_power_law([r["tokens_seen"] for r in points], [r[k] for r in points])
                fits.append(dict(head=name, depth=k, fit=fit, points=len(points), minutes=t["minutes"],
                                 seconds=t["seconds"], tokens_seen=total, epochs_seen=t["epochs_seen"],
                                 exponent=round(a, 4), measured=rows[-1][k],
                                 **{f"fit_{m}x": round(1 - c * (m * total) ** -a, 4) for m in (1, 10, 100)}))
                print(fits[-1])
    os.makedirs(RESULTS, exist_ok=True)
    write_csv(os.path.join(RESULTS, f"scaling_curve{args.tag}.csv"), curve,
              list(dict.fromkeys(k for r in curve for k in r)))
    write_csv(os.path.join(RESULTS, f"scaling_curve_fit{args.tag}.csv"), fits, list(fits[0]))

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, k in zip(axes, ("acc1", "acc2")):
        for i, (name, rows) in enumerate(series.items()):
            color = f"C{i}"
            ax.plot([r["tokens_seen"] for r in rows], [r[k] for r in rows], "o-", color=color, label=f"{name} held-out")
            if k == "acc1":
                ax.plot([r["tokens_seen"] for r in rows], [r["train_acc1"] for r in rows], ":", color=color,
                        label=f"{name} training")
            ends = [r for r in curve if r["head"] == name and r.get("endpoint_of_a_shorter_run")]
            if ends:
                ax.plot([r["tokens_seen"] for r in ends], [r[k] for r in ends], "s", color=color, mfc="none",
                        label=f"{name}: end of a shorter run")
            f = next((f for f in fits if f["head"] == name and f["depth"] == k and f["fit"] == "endpoints"),
                     next(f for f in fits if f["head"] == name and f["depth"] == k))
            total = f["tokens_seen"]
            c = (1 - f["fit_1x"]) * total ** f["exponent"]
            xs = [args.fit_from * 2 ** (j / 4) for j in range(int(4 * math.log2(100 * total / args.fit_from)) + 1)]
            ax.plot(xs, [1 - c * x ** -f["exponent"] for x in xs], "--", color=color, alpha=0.6,
                    label=f"{name} {f['fit']} fit (1-acc ~ T^-{f['exponent']:.2f})")
        ax.set_xscale("log")
        ax.set_xlabel("tokens seen")
        ax.set_ylabel(f"held-out {k}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Draft-head training on the CPU: accuracy against tokens seen (dashed: fit to 100x)")
    save_figure(fig, os.path.join(RESULTS, f"scaling_curve{args.tag}.png"))


if __name__ == "__main__":
    main()
