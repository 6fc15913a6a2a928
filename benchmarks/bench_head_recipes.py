"""Draft-head recipes at equal data and CPU time (or equal steps, ``--steps``: about equal tokens
seen): each variant trains with ``python -m jakiro_ext train --minutes M --threads 1`` on the same
shards of the token corpus (two at a time, one thread each, side by side, so that both see the
same machine), evaluated on the same held-out answers (acc1..acc4 drafting from the head's own
features, as the engine drafts) every ``--eval-every`` steps: the slope, not only the end point.

Each head is then judged by what it buys, not by acc1 alone: the tree cost model
(:mod:`jakiro_ext.engine.tree_cost`, this machine's measured costs of a round at 2 threads, and the
head's acceptance profile measured on the held-out answers) gives the best dynamic tree's
expected tokens/s and its ratio to plain decoding; with ``--measure-prompts N``, also what it
measures end to end: greedy decoding of the first N packaged prompts (float32, batch 1, the tree
chosen live, the engine's default) beside plain decoding, the arms taking turns prompt by prompt
(the order rotated), tokens/s over plain decoding's and tau (every head's tokens checked
against plain decoding's). Results: ``results/head_recipes.csv`` (one
row per variant) and ``results/head_recipes_curves.csv`` (held-out accuracy against tokens seen).
The heads stay in ``--out`` (one directory per variant).
"""
import argparse
import json
import os
import shlex
import subprocess
import sys
import time

from common import CLI_CWD, RESULTS, save_figure, write_csv

TTT = ["--ttt-steps", "1"]
# name: (kind, [(fraction of the budget, extra train options, starts from the previous phase)])
VARIANTS = {
    "eagle2": ("eagle2", [(1.0, [], False)]),
    "jakiro": ("jakiro", [(1.0, [], False)]),
    # the step: fp32 products (compared with bf16's at the same tokens seen)
    "eagle2_fp32": ("eagle2", [(1.0, ["--compute-dtype", "float32"], False)]),
    # the same steps (and so the same schedule and tokens) with bf16 and fp32 products
    "eagle2_441_steps_bf16": ("eagle2", [(1.0, ["--minutes", "0", "--steps", "441", "--compute-dtype", "bfloat16"],
                                          False)]),
    "eagle2_441_steps_fp32": ("eagle2", [(1.0, ["--minutes", "0", "--steps", "441", "--compute-dtype", "float32"],
                                          False)]),
    # the loss
    "eagle2_token_only": ("eagle2", [(1.0, ["--w-feature", "0", "--w-token", "1"], False)]),
    "eagle2_token_1": ("eagle2", [(1.0, ["--w-token", "1"], False)]),
    "jakiro_token_1": ("jakiro", [(1.0, ["--w-token", "1", "--w-token2", "0.5"], False)]),
    # the initialisation
    "eagle2_init_target": ("eagle2", [(1.0, ["--init-from-target"], False)]),
    "jakiro_init_target": ("jakiro", [(1.0, ["--init-from-target"], False)]),
    # depth, learning rate, tokens per step
    "eagle2_2layers": ("eagle2", [(1.0, ["--layers", "2"], False)]),
    "eagle2_lr5e-3": ("eagle2", [(1.0, ["--lr", "5e-3"], False)]),
    "eagle2_batch16": ("eagle2", [(1.0, ["--batch", "16"], False)]),
    # the training-time test in the last third of the budget
    "eagle2_then_ttt": ("eagle2", [(2 / 3, [], False), (1 / 3, TTT + ["--lr", "5e-4", "--warmup-steps", "10"], True)]),
    # Jakiro: 8 experts of half the width (the same parameters), the contrastive branch's weight
    "jakiro_8x": ("jakiro", [(1.0, ["--experts", "8"], False)]),
    # Jakiro in the released code's shape: experts as wide as the hidden size, 2 of them (both
    # active), and 4 with 2 active (its ablation's direction)
    "jakiro_2x576": ("jakiro", [(1.0, ["--experts", "2", "--intermediate-size", "576"], False)]),
    "jakiro_4x576": ("jakiro", [(1.0, ["--experts", "4", "--intermediate-size", "576"], False)]),
    "jakiro_contrastive_1": ("jakiro", [(1.0, ["--w-feature2", "1", "--w-token2", "0.1"], False)]),
    # EAGLE-3: the target's layers 2, L / 2 and L - 3 fused, the training-time test (2 steps), the
    # token loss alone, its own LM head; and the same head reading the top feature alone
    "eagle3": ("eagle3", [(1.0, [], False)]),
    "eagle3_top": ("eagle3", [(1.0, ["--feature-layers", "30", "30", "30"], False)]),
    # EAGLE-2's and Jakiro's (paper-shape) layers on the same fused features, trained as EAGLE-3 is
    "eagle2_fused": ("eagle2", [(1.0, ["--fused"], False)]),
    "jakiro_2x576_fused": ("jakiro", [(1.0, ["--fused", "--experts", "2", "--intermediate-size", "576"], False)]),
}


def expected_rates(names, out_dir):
    """Per variant: the cost model's best tree for its head on this machine (2 threads, fp32,
    batch 1), its expected tokens/s and the ratio to plain decoding's (one target forward a token)."""
    import torch

    from jakiro_ext.cli.common import load_target
    from jakiro_ext.models.heads.draft_head import DraftHead
    from jakiro_ext.engine.tree_cost import choose_tree, load_costs
    from jakiro_ext.methods import method_for_head

    torch.set_num_threads(2)
    target, _, _ = load_target("float32", "cpu", None)
    rates = {}
    for name in names:
        head = DraftHead.load(os.path.join(out_dir, name), target)
        method = method_for_head(head.config.kind).name
        costs = load_costs(target, head, method)
        tree, rows = choose_tree(costs, head.acceptance, method)
        plain = 1.0 / costs["verify"]["1"]
        rates[name] = dict(expected_tokens_s=round(rows[0][0], 1), expected_speedup=round(rows[0][0] / plain, 3),
                           expected_tau=round(1 + rows[0][1], 3), tree=f"{tree.total_tokens},{tree.depth},{tree.top_k}")
    return rates


def measured_rates(names, out_dir, prompts: int, max_new_tokens: int):
    """Per variant: its head's greedy tokens/s over plain decoding's on the first ``prompts``
    packaged prompts (float32, batch 1, 2 threads, the live tree), and its tau; the arms (plain
    decoding and every head) take turns prompt by prompt, the order rotated, so that the
    machine's drift hits them alike, and every head's tokens are checked against plain decoding's."""
    import torch

    from jakiro_ext.cli.common import HEADS_DIR, chat_ids, load_target
    from jakiro_ext.engine.generate import speculative_generate
    from jakiro_ext.methods import method_for_head
    from jakiro_ext.models.heads.draft_head import DraftHead

    torch.set_num_threads(2)
    target, tokenizer, _ = load_target("float32", "cpu", None)
    texts = [json.loads(line)["prompt"] for line in open(os.path.join(HEADS_DIR, "..", "data", "prompts.jsonl"))
             if line.strip()][:prompts]
    arms = [("plain", None)] + [(name, DraftHead.load(os.path.join(out_dir, name), target)) for name in names]
    totals = {name: [0, 0.0, 0, 0] for name, _ in arms}  # tokens after the first, their seconds, new tokens, forwards
    for i, text in enumerate(texts):
        ids = chat_ids(tokenizer, text, True)
        want = speculative_generate(target, None, ids, max_new_tokens, eos_token_id=tokenizer.eos_token_id).token_ids
        for name, head in arms[i % len(arms):] + arms[:i % len(arms)]:
            out = speculative_generate(target, head, ids, max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                                       method=method_for_head(head.config.kind).name if head else "ar")
            if out.token_ids != want:
                sys.exit(f"{name}: its tokens differ from plain decoding's on packaged prompt {i}")
            totals[name][0] += out.stats.new_tokens - 1
            totals[name][1] += out.stats.wall_time_s - out.stats.prefill_s
            totals[name][2] += out.stats.new_tokens
            totals[name][3] += out.stats.target_forwards
    base = totals["plain"][0] / totals["plain"][1]
    return {name: dict(measured_speedup=round(t[0] / t[1] / base, 3), measured_tau=round(t[2] / t[3], 3))
            for name, t in totals.items() if name != "plain"}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="the token corpus")
    ap.add_argument("--shards", type=int, help="its first N shards (default: all)")
    ap.add_argument("--out", required=True, help="a directory for the heads (one sub-directory per variant)")
    ap.add_argument("--minutes", type=float, default=10.0, help="CPU minutes (one thread) of each variant")
    ap.add_argument("--steps", type=int, default=0, help="instead of --minutes: this many steps of each variant (the "
                                                         "same data order, so about the same tokens seen)")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--parallel", type=int, default=2, help="runs side by side (one thread each)")
    ap.add_argument("--lr", default="2e-3")
    ap.add_argument("--feature-dtype", choices=["float32", "bfloat16"], default="float32",
                    help="the target's features (train --feature-dtype; bfloat16: 2.3x faster to compute with AMX)")
    ap.add_argument("--eval-every", type=int, default=150, help="steps between held-out evaluations")
    ap.add_argument("--eval-doublings", type=int, default=0, help="also evaluate at N, 2N, 4N, ... tokens seen "
                                                                  "(a scaling curve)")
    ap.add_argument("--checkpoint-every", type=int, default=0, help="steps between checkpoints (a rerun of the same "
                                                                    "command resumes; 0: none)")
    ap.add_argument("--measure-prompts", type=int, default=0, help="also measure each head end to end on the first N "
                                                                  "packaged prompts (0: the cost model's expectation only)")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="with --measure-prompts: tokens of each answer")
    ap.add_argument("--tag", default="", help="appended to the CSV names")
    ap.add_argument("--report-only", action="store_true", help="only collect the finished variants' results")
    ap.add_argument("--no-report", action="store_true", help="only train (collect later with --report-only)")
    args = ap.parse_args()
    # The runs start in CLI_CWD, so the paths given are made absolute first.
    args.out, args.data = os.path.abspath(args.out), os.path.abspath(args.data)
    pending = [] if args.report_only else list(args.variants)
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
                       *(["--steps", str(round(args.steps * fraction))] if args.steps
                         else ["--minutes", f"{args.minutes * fraction:.2f}"]), "--threads", "1", "--lr", args.lr,
                       "--warmup-steps", "50", "--eval-every", str(args.eval_every),
                       "--eval-doublings", str(args.eval_doublings), "--checkpoint-every", str(args.checkpoint_every),
                       "--feature-dtype", args.feature_dtype, *(["--shards", str(args.shards)] if args.shards else []),
                       *extra]
                if from_previous:
                    cmd += ["--init-from", previous]
                commands.append(" ".join(shlex.quote(c) for c in cmd))
                previous = out
            log = open(os.path.join(args.out, f"{name}.log"), "w")
            running[name] = (subprocess.Popen(["bash", "-c", " && ".join(commands)], cwd=CLI_CWD, stdout=log,
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
    if args.no_report:
        return
    names = [n for n in args.variants if os.path.exists(os.path.join(args.out, n, "training.json"))]
    rates = expected_rates(names, args.out)
    if args.measure_prompts:
        for name, measured in measured_rates(names, args.out, args.measure_prompts, args.max_new_tokens).items():
            rates[name].update(measured)
    rows, curves = [], []
    for name in names:
        summary = json.loads(open(os.path.join(args.out, name, "training.json")).read())
        phases = [json.loads(open(os.path.join(args.out, f"{name}.phase{i}", "training.json")).read())
                  for i in range(len(VARIANTS[name][1]) - 1)] + [summary]
        seen_before = 0
        for p in phases:  # held-out accuracy against the tokens seen (from the first phase's start)
            t = p["train"]
            per_step = t["tokens_seen"] / max(t["total_steps"], 1)
            for e in p["eval_history"]:
                curves.append(dict(variant=name, tokens_seen=seen_before + e.get("tokens_seen", round(e["step"] * per_step)),
                                   **{k.replace("eval_", ""): round(v, 4) for k, v in e.items() if k.startswith("eval_acc")
                                      and "_" not in k.replace("eval_", "")}))
            seen_before += t["tokens_seen"]
        t = summary["train"]
        final = {k.replace("eval_", ""): round(v, 4) for k, v in sorted(summary["final_eval"].items())}
        rows.append(dict(variant=name, kind=summary["kind"], minutes=0 if args.steps else args.minutes,
                         steps="+".join(str(p["train"]["total_steps"]) for p in phases),
                         tokens_seen=sum(p["train"]["tokens_seen"] for p in phases),
                         seconds=round(sum(p["train"]["seconds"] for p in phases), 1),
                         products=t.get("products", ""), **{k: final.get(k) for k in ("acc1", "acc2", "acc3", "acc4")},
                         acc2_contrastive=final.get("acc2_contrastive"), **rates[name]))
        print(rows[-1])
    os.makedirs(RESULTS, exist_ok=True)
    write_csv(os.path.join(RESULTS, f"head_recipes{args.tag}.csv"), rows, list(dict.fromkeys(k for r in rows for k in r)))
    write_csv(os.path.join(RESULTS, f"head_recipes_curves{args.tag}.csv"), curves,
              list(dict.fromkeys(k for r in curves for k in r)))
    chart(curves, os.path.join(RESULTS, f"head_recipes_curves{args.tag}.png"))


def chart(curves, path):
    """Held-out acc1..acc4 against the tokens seen, a line per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(15, 3.8), sharex=True)
    for name in dict.fromkeys(r["variant"] for r in curves):
        pts = sorted((r["tokens_seen"], r) for r in curves if r["variant"] == name)
        for depth, ax in enumerate(axes, 1):
            ys = [(t / 1e6, r.get(f"acc{depth}")) for t, r in pts if r.get(f"acc{depth}") is not None]
            ax.plot([x for x, _ in ys], [y for _, y in ys], marker="o", ms=3, label=name)
    for depth, ax in enumerate(axes, 1):
        ax.set_title(f"held-out acc{depth}")
        ax.set_xlabel("tokens seen (M)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


if __name__ == "__main__":
    main()
