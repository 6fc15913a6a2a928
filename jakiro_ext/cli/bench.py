"""``bench``: decode prompts with each method, report tokens/s, tau and the speedup over plain decoding."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch

from jakiro_ext import atomic
from jakiro_ext.cli.common import Runner, activity, chat_ids, check_generation_args
from jakiro_ext.methods import BASELINE, METHODS


def read_prompts(path: Path, limit: Optional[int]) -> List[dict]:
    """``{"prompt": ...}`` lines or Spec-Bench ``{"turns": [...]}`` lines (first turn); any
    other content is a ValueError naming the file and line."""
    try:
        content = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    prompts = []
    for n, line in enumerate(content.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{n}: not a JSON object: {exc}") from None
        if isinstance(row, dict) and isinstance(row.get("prompt"), str):
            text = row["prompt"]
        elif (isinstance(row, dict) and isinstance(row.get("turns"), list) and row["turns"]
              and isinstance(row["turns"][0], str)):
            text = row["turns"][0]
        else:
            got = sorted(row) if isinstance(row, dict) else type(row).__name__
            raise ValueError(f"{path}:{n}: expected a 'prompt' string or a non-empty 'turns' list of strings, got {got}")
        if not isinstance(row.get("category", ""), str):
            raise ValueError(f"{path}:{n}: 'category' must be a string, got {row['category']!r}")
        prompts.append(dict(id=row.get("question_id", n), category=row.get("category", ""), prompt=text, line=n))
    prompts = prompts[:limit] if limit else prompts
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts


def summarize(rows: List[dict], seconds: Optional[float] = None) -> dict:
    """Pooled tokens/s and tau of runs; ``seconds``: the wall time of the batches that ran them
    (default: the runs' own times, one prompt at a time)."""
    tokens = sum(r["new_tokens"] for r in rows)
    seconds = sum(r["wall_time_s"] for r in rows) if seconds is None else seconds
    forwards = sum(r["target_forwards"] for r in rows)
    return dict(tokens_per_s=tokens / seconds if seconds else 0.0, tau=tokens / forwards if forwards else 0.0,
                new_tokens=tokens, target_forwards=forwards, wall_time_s=seconds, prompts=len(rows))


def cmd_bench(args) -> int:
    from tqdm import tqdm

    methods = list(dict.fromkeys(args.method or [BASELINE, "jakiro"]))
    if BASELINE in methods:  # first, so every other run of a prompt is compared with it
        methods.remove(BASELINE)
        methods.insert(0, BASELINE)
    tree = check_generation_args(args)
    prompts = read_prompts(Path(args.prompts), args.limit)
    runner = Runner(args, methods, tree)
    prompt_ids = [chat_ids(runner.tokenizer, p["prompt"], not args.no_chat_template) for p in prompts]
    limit = runner.target.config.max_position_embeddings
    for p, ids in zip(prompts, prompt_ids):  # all of them before any run
        if ids.numel() >= limit:
            raise ValueError(f"{args.prompts}:{p['line']}: prompt {p['id']} has {ids.numel()} tokens, but the target's "
                             f"context holds {limit} positions (max_position_embeddings): leave it out or shorten it")
    for m in methods:  # untimed warm-up: the first call of each path pays one-off costs
        runner.run(m, prompt_ids[0], max_new_tokens=4)
    per_prompt = []
    runs: Dict[str, List[dict]] = {m: [] for m in methods}
    batch_seconds: Dict[str, float] = {m: 0.0 for m in methods}
    size = args.batch_size
    bar = tqdm(total=len(prompts) * len(methods), desc="bench", unit="run", file=sys.stderr)
    try:
        def benchmarking(first: int) -> str:
            return f"benchmarking prompts {first + 1}-{min(first + size, len(prompts))} of {len(prompts)}"
        activity.now = benchmarking(0)
        for first in range(0, len(prompts), size):  # batches of consecutive prompts (one at a time by default)
            group, ids = prompts[first:first + size], prompt_ids[first:first + size]
            rows = [dict(id=p["id"], category=p["category"], prompt_tokens=int(x.numel()), methods={})
                    for p, x in zip(group, ids)]
            reference, seconds = None, {}
            for m in methods:  # side by side, batch by batch
                t0 = time.perf_counter()
                outs = runner.run(m, ids) if size > 1 else [runner.run(m, ids[0])]
                seconds[m] = time.perf_counter() - t0 if size > 1 else outs[0].stats.wall_time_s
                for i, (out, p, row) in enumerate(zip(outs, group, rows)):
                    stats = dict(out.stats.as_dict(), category=p["category"])
                    if m == BASELINE:
                        stats["token_ids"] = out.token_ids
                    elif reference is not None and args.temperature == 0:
                        stats["same_tokens_as_ar"] = out.token_ids == reference[i]
                    row["methods"][m] = stats
                if m == BASELINE:
                    reference = [row["methods"][BASELINE].pop("token_ids") for row in rows]
                tau = sum(o.stats.new_tokens for o in outs) / max(1, sum(o.stats.target_forwards for o in outs))
                if m != methods[-1]:
                    bar.update(len(group))
                    bar.set_postfix_str(f"{m} tau {tau:.2f}")
            with atomic.signals_held():  # recorded whole before the bar counts it: a SIGINT comes before or after
                per_prompt += rows  # a batch counts once every method has run it
                for m in methods:
                    runs[m] += [row["methods"][m] for row in rows]
                    batch_seconds[m] += seconds[m]
                bar.update(len(group))
                bar.set_postfix_str(f"{methods[-1]} tau {tau:.2f}")
                if first + size < len(prompts):  # (with the count: a SIGINT now names the next batch)
                    activity.now = benchmarking(first + size)
    except KeyboardInterrupt:
        bar.close()
        if per_prompt:
            bench_report(args, methods, runner, runs, per_prompt, batch_seconds, complete=False)
            activity.saved = f"the statistics of the {len(per_prompt)} prompts finished are printed"
        raise
    bar.close()
    bench_report(args, methods, runner, runs, per_prompt, batch_seconds)
    return 0


def bench_report(args, methods: List[str], runner: Runner, runs: Dict[str, List[dict]], per_prompt: List[dict],
                 batch_seconds: Dict[str, float], complete: bool = True) -> None:
    """The benchmark's summary: one JSON object (``--json``) or the per-prompt table and the totals."""
    size = args.batch_size
    summary = {m: summarize(r, batch_seconds[m]) for m, r in runs.items()}
    for m, s in summary.items():
        categories = sorted({r["category"] for r in runs[m]})
        if size > 1:  # a batch mixes categories: its time is not theirs
            categories = []
        s["per_category"] = {c: summarize([r for r in runs[m] if r["category"] == c]) for c in categories}
        if BASELINE in summary:
            s["speedup_vs_ar"] = s["tokens_per_s"] / summary[BASELINE]["tokens_per_s"]
            for c, cs in s["per_category"].items():
                cs["speedup_vs_ar"] = cs["tokens_per_s"] / summary[BASELINE]["per_category"][c]["tokens_per_s"]
            # Pooled tokens/s weighs long answers more; the mean over categories weighs each equally.
            if categories:
                s["mean_category_speedup_vs_ar"] = (sum(cs["speedup_vs_ar"] for cs in s["per_category"].values())
                                                    / len(categories))
        if args.temperature == 0 and m != BASELINE and BASELINE in summary:
            s["all_same_tokens_as_ar"] = all(r.get("same_tokens_as_ar", False) for r in runs[m])
    config = dict(prompts=str(args.prompts), dtype=args.dtype, max_new_tokens=args.max_new_tokens,
                  temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                  tree={m: runner.tree_said(m) for m in methods if METHODS[m].drafts},
                  threads=torch.get_num_threads(), batch_size=size, complete=complete)
    if args.json:
        print(json.dumps(dict(config=config, methods=summary, per_prompt=per_prompt)))
        return
    print(f"{'prompt':>8s} {'category':14s} " + " ".join(f"{m + ' tok/s':>18s} {'tau':>5s}" for m in methods))
    for row in per_prompt:
        cells = " ".join(f"{row['methods'][m]['tokens_per_s']:18.1f} {row['methods'][m]['tau']:5.2f}" for m in methods)
        print(f"{str(row['id']):>8s} {row['category'][:14]:14s} {cells}")
    print("\noverall" + (f" (speedup vs {BASELINE})" if BASELINE in summary else ""))
    for m, s in summary.items():
        extra = f"  speedup {s['speedup_vs_ar']:.2f}x" if "speedup_vs_ar" in s else ""
        same = "" if "all_same_tokens_as_ar" not in s else f"  tokens identical to ar: {s['all_same_tokens_as_ar']}"
        print(f"  {m:12s} {s['tokens_per_s']:7.1f} tokens/s  tau {s['tau']:.2f}  {s['new_tokens']} tokens{extra}{same}")
