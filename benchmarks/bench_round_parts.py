"""Where a decoding round's time goes, in place: plain decoding and fixed trees of the shipped heads
on the default model (float32, bfloat16 or its GGUF file's own Q4_1 blocks), greedy, batch 1, over
packaged prompts, the arms taking turns prompt by prompt; every tree's tokens checked against
plain decoding's. Per arm: tokens/s, its ratio to plain decoding, tau (new tokens a round) and
the milliseconds of a round split into its parts as the engine runs them (wall clock around the
engine's own calls): the target's forward (verifying the tree), drafting the tree, the draft's
catch-up on the accepted tokens, verification's acceptance (``jakiro::verify_tree``), the caches'
commit, and the rest (the round's and the call's host work). Also the target's forward by its
rows (what a tree's extra rows cost in place, beside the draft's work, not back to back).

Parts are timed in place because the same calls cost more there than alone: the weights' stream
between them leaves the host's working set cold (a microbenchmark of a part underestimates it).
Writes ``results/round_parts_<dtype>.csv``.

    python benchmarks/bench_round_parts.py --dtype gguf --arms eagle2:2/1/1 jakiro:2/1/1 jakiro:3/1/1
"""
import argparse
import collections
import json
import os
import statistics
import time
from pathlib import Path

import torch

from common import RESULTS, machine, write_csv

PARTS = ("target_forward", "drafting", "catch_up", "verify_tree", "commit")


def timed(owner, name: str, part: str, clock: dict) -> None:
    """Wrap ``owner.name`` so that its wall time inside a round (``clock['in_round']``) adds to
    ``clock[part]``; ``part`` None: it is the round, sets that flag while it runs and counts
    ``clock['rounds']``. A target forward's time also adds to ``clock['rows', T]`` (T: its
    tokens a row), its count to ``clock['count', T]``."""
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        if part is None:
            clock["in_round"] = True
            try:
                out = inner(*args, **kwargs)
            finally:
                clock["in_round"] = False
            clock["rounds"] += out is not None  # (None: no round ran, a sequence was done)
            return out
        t0 = time.perf_counter()
        out = inner(*args, **kwargs)
        if clock["in_round"]:
            seconds = time.perf_counter() - t0
            clock[part] += seconds
            if part == "target_forward":
                tokens = args[1] if len(args) > 1 else kwargs["tokens"]
                clock["rows", tokens.shape[1]] += seconds
                clock["count", tokens.shape[1]] += 1
        return out
    setattr(owner, name, wrapper)


def forward_alone(target, prompt, rows, idle_ms, reps: int = 60) -> list:
    """The target's forward of T tokens (a chain) after ``prompt``, not in a round: back to back
    (median of ``reps``), and after each idle gap of ``idle_ms`` (the host busy-waiting, touching
    nothing: what decays is the machine's, not the working set's)."""
    from jakiro_ext.ops.masks import causal_tree_mask
    cache = target.new_cache(1, prompt.shape[-1] + max(rows) + 1)
    with torch.inference_mode():
        target(prompt.view(1, -1), cache, last_logits_only=True)
        cache.commit(prompt.shape[-1])
        weights = target.prepare()
        out = []
        for T in rows:
            tokens = prompt.view(1, -1)[:, :T]
            mask, depths = causal_tree_mask(1, T, tokens.device), torch.arange(T).view(1, T)
            row = dict(rows=T)
            for idle in (0.0,) + tuple(idle_ms):
                seconds = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    while time.perf_counter() - t0 < idle / 1e3:
                        pass
                    t1 = time.perf_counter()
                    target(tokens, cache, mask, depths, weights=weights)
                    seconds.append(time.perf_counter() - t1)
                name = "back_to_back_ms" if idle == 0 else f"after_{idle:g}ms_idle_ms"
                row[name] = round(1e3 * statistics.median(seconds), 3)
            out.append(row)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="gguf", choices=["float32", "bfloat16", "gguf"],
                    help="the target's weights: float32, bfloat16, or the GGUF file's own blocks (Q4_1)")
    ap.add_argument("--arms", nargs="+", default=["eagle2:2/1/1", "jakiro:2/1/1", "jakiro:3/1/1", "eagle2:3/1/2"],
                    help="METHOD:TOTAL/DEPTH/TOP_K fixed trees (plain decoding always runs)")
    ap.add_argument("--prompts", type=int, default=8, help="packaged prompts")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2, help="passes over the prompts")
    ap.add_argument("--idle-ms", type=float, nargs="*", default=[0.5, 1.0, 3.0],
                    help="the forwards alone are also timed after these idle gaps (ms)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", help="CSV path (default results/round_parts_<dtype>.csv)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from jakiro_ext import ops
    from jakiro_ext.cli.common import HEADS_DIR, chat_ids, load_head
    from jakiro_ext.config import TreeConfig
    from jakiro_ext.engine.batch import DecodeBatch
    from jakiro_ext.engine.drafter import Drafter
    from jakiro_ext.engine.generate import speculative_generate
    from jakiro_ext.engine.state import BatchState
    from jakiro_ext.methods import METHODS
    from jakiro_ext.models.default import DEFAULT_MODEL, load_default_target
    from jakiro_ext.models.llama import LlamaModel

    arms = [("ar", None)]
    for spec in args.arms:
        method, _, tree = spec.partition(":")
        if method not in METHODS or not METHODS[method].drafts or tree.count("/") != 2:
            ap.error(f"--arms: METHOD:TOTAL/DEPTH/TOP_K with a drafting method, got {spec!r}")
        arms.append((method, TreeConfig(*map(int, tree.split("/")))))
    target, tokenizer = load_default_target(args.dtype if args.dtype == "gguf" else getattr(torch, args.dtype))
    heads = {m: load_head(METHODS[m].shipped_head, None, target, DEFAULT_MODEL) for m, tree in arms if tree}
    lines = (Path(HEADS_DIR).parent / "data" / "prompts.jsonl").read_text().splitlines()
    prompts = [chat_ids(tokenizer, json.loads(line)["prompt"], True) for line in lines if line.strip()][:args.prompts]

    clock = collections.defaultdict(float)
    timed(DecodeBatch, "round", None, clock)
    timed(LlamaModel, "forward", "target_forward", clock)
    timed(Drafter, "draft", "drafting", clock)
    timed(Drafter, "catch_up", "catch_up", clock)
    timed(ops, "verify_tree", "verify_tree", clock)
    timed(BatchState, "commit", "commit", clock)

    totals = {i: collections.defaultdict(float) for i in range(len(arms))}
    for i, (method, tree) in enumerate(arms):  # a warm-up call each
        speculative_generate(target, heads.get(method), prompts[0], 16, method=method, tree=tree)
    for r in range(args.repeats):
        for p, ids in enumerate(prompts):
            trees = list(range(1, len(arms)))
            shift = (p + r) % len(trees)  # (the trees' order rotated: drift hits every arm alike)
            plain = None
            for i in [0] + trees[shift:] + trees[:shift]:  # plain decoding first: the trees are checked against it
                method, tree = arms[i]
                clock.clear()
                clock["in_round"] = False
                out = speculative_generate(target, heads.get(method), ids, args.max_new_tokens, method=method,
                                           tree=tree, eos_token_id=tokenizer.eos_token_id)
                if i == 0:
                    plain = out.token_ids
                elif out.token_ids != plain:
                    raise SystemExit(f"{method} {tree}: prompt {p} decoded other tokens than plain decoding")
                s, t = out.stats, totals[i]
                t["tokens"] += s.new_tokens - 1  # (the first comes from the prefill)
                t["seconds"] += s.wall_time_s - s.prefill_s
                for key in ("rounds",) + PARTS + tuple(k for k in clock if isinstance(k, tuple)):
                    t[key] += clock[key]

    plain_rate = totals[0]["tokens"] / totals[0]["seconds"]
    rows = []
    for i, (method, tree) in enumerate(arms):
        t = totals[i]
        per_round = {part: 1e3 * t[part] / t["rounds"] for part in PARTS}
        round_ms = 1e3 * t["seconds"] / t["rounds"]
        forwards = {k[1]: 1e3 * t["rows", k[1]] / t[k] for k in list(t) if isinstance(k, tuple) and k[0] == "count"}
        rows.append(dict(
            arm="plain" if tree is None else method,
            tree="" if tree is None else f"{tree.total_tokens}/{tree.depth}/{tree.top_k}",
            tokens_per_s=round(t["tokens"] / t["seconds"], 1),
            vs_plain=round(t["tokens"] / t["seconds"] / plain_rate, 3),
            tau=round(t["tokens"] / t["rounds"], 3),
            round_ms=round(round_ms, 3),
            **{f"{part}_ms": round(v, 3) for part, v in per_round.items()},
            rest_ms=round(round_ms - sum(per_round.values()), 3),
            forward_ms_by_rows=" ".join(f"{n}:{v:.3f}" for n, v in sorted(forwards.items())),
            dtype=args.dtype, prompts=len(prompts), max_new_tokens=args.max_new_tokens, repeats=args.repeats,
            machine=machine(), threads=args.threads))
        print(" ".join(f"{k}={v}" for k, v in rows[-1].items() if k not in ("machine",)))
    out = args.out or os.path.join(RESULTS, f"round_parts_{args.dtype}.csv")
    write_csv(out, rows)
    alone = forward_alone(target, prompts[0], sorted({1} | {t.total_tokens for _, t in arms if t}), args.idle_ms)
    for row in alone:
        row.update(dtype=args.dtype, machine=machine(), threads=args.threads)
        print(" ".join(f"{k}={v}" for k, v in row.items() if k != "machine"))
    write_csv(out.replace(".csv", "_forward_alone.csv"), alone)


if __name__ == "__main__":
    main()
