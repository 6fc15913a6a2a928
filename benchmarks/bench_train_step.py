"""Where a draft-head training step's time goes, and how many tokens a second it trains.

For each head kind (eagle2, jakiro, gumiho, shaped as ``python -m jakiro_ext train`` shapes them)
and each recipe (``--recipes``: ``before``, fp32 products and the target's distributions computed
at every step, as the step was; ``fp32``, the distributions computed once (cached); ``bf16``,
cached and the products in bfloat16 with float32 master weights), the same batches of the
packaged corpus's first sequences are trained for a few steps:

- unprofiled, timed step by step after a warm-up: tokens/s (the real, unpadded tokens of a
  batch over its step's time) and tokens/s per thread;
- under ``torch.profiler``: each part's forward time (the ``part:`` ranges of the training
  code, :mod:`jakiro_ext.profiling`) and backward time (each backward function is charged to
  the part whose forward op made it, by autograd sequence number), the optimizer, the data, and
  what is left (Python and the small ops between the parts).

The CPU, its threads and its bf16 matmul peak against its fp32 one are written with the
results (``results/train_step.csv`` and ``results/train_step_parts.csv``). Nothing else may run
on the machine meanwhile.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections import defaultdict

import torch

from common import RESULTS, write_csv

KINDS = ("eagle2", "jakiro", "gumiho")


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def matmul_gflops(dtype: torch.dtype, rows: int = 4096) -> float:
    a, w = torch.randn(rows, 576).to(dtype), torch.randn(1536, 576).to(dtype)
    for _ in range(3):
        a @ w.T
    t, n = time.perf_counter(), 20
    for _ in range(n):
        a @ w.T
    return 2 * rows * 576 * 1536 * n / (time.perf_counter() - t) / 1e9


def examples_of(target, corpus: str, count: int):
    from jakiro_ext.training.corpus import read_corpus_meta, read_shard
    from jakiro_ext.training.examples import Example
    from jakiro_ext.training.features import prefill_features

    meta = read_corpus_meta(corpus)
    shard = meta["shards"][0]
    sequences = read_shard(os.path.join(corpus, shard["name"]), shard.get("sha256"))[:count]
    features = prefill_features(target, [q.tokens for q in sequences])
    return [Example(q.tokens, f.to(torch.bfloat16), torch.arange(q.tokens.numel()) >= q.prompt_length, q.conversation)
            for q, f in zip(sequences, features)]


def make_head(target, kind: str, examples, experts: int = 4):
    from jakiro_ext.models.heads.config import DraftConfig
    from jakiro_ext.models.heads.draft_head import DraftHead
    from jakiro_ext.training.trainset import select_draft_vocab

    moe = kind == "jakiro"
    width = target.config.intermediate_size // (experts if moe else 1)
    config = DraftConfig.for_target(target.config, kind, num_experts=experts, intermediate_size=width)
    config.draft_vocab_size = 8192
    head = DraftHead(config).init_weights(seed=0)
    head.set_draft_vocab(select_draft_vocab(examples, 8192)[0])
    return head.bind(target)


def batch_tokens(examples, cfg, steps: int):
    """The real tokens of each of the first ``steps`` batches train_head takes."""
    from jakiro_ext.training.train import shuffled_batches

    per_epoch = -(-len(examples) // cfg.batch_sequences)
    out = []
    for step in range(steps):
        batches = shuffled_batches(examples, cfg, step // per_epoch)
        out.append(sum(min(examples[i].tokens.numel(), cfg.max_seq_len) for i in batches[step % per_epoch]))
    return out


def prepared_head(target, kind, examples, recipe: str, k: int = 32):
    """A fresh head; for the recipes after ``before``, the examples carry the target's
    distributions (computed here, outside the timed steps, as the train command caches them)."""
    head = make_head(target, kind, examples)
    for ex in examples:
        ex.top_probs = None
    if recipe != "before":
        from jakiro_ext.training.features import attach_target_probs

        attach_target_probs(examples, head, k, progress=False)
    return head


def timed_run(target, kind, examples, cfg, warmup: int, recipe: str):
    from jakiro_ext.training.train import train_head

    stamps = []
    head = prepared_head(target, kind, examples, recipe)
    train_head(head, examples, cfg, on_step=lambda s, r, n: stamps.append(time.perf_counter()))
    tokens = batch_tokens(examples, cfg, cfg.steps)
    seconds = stamps[-1] - stamps[warmup - 1]
    return sum(tokens[warmup:]) / seconds, seconds / (cfg.steps - warmup)


def profiled_run(target, kind, examples, cfg, warmup: int, recipe: str):
    """Per part: forward and backward milliseconds a step (mean over the profiled steps)."""
    from torch.profiler import ProfilerActivity, profile, schedule

    from jakiro_ext.profiling import PREFIX
    from jakiro_ext.training.train import train_head

    active = cfg.steps - warmup
    with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=0, warmup=warmup, active=active, repeat=1)) as prof:
        train_head(prepared_head(target, kind, examples, recipe), examples, cfg, on_step=lambda s, r, n: prof.step())
    events = prof.events()

    def part_of(e):
        while e is not None:
            if e.name.startswith(PREFIX):
                return e.name[len(PREFIX):]
            e = e.cpu_parent
        return None

    forward, backward = defaultdict(float), defaultdict(float)
    by_sequence = {}
    step_us = 0.0
    for e in events:
        if e.name.startswith("ProfilerStep"):
            step_us += e.cpu_time_total
        elif e.name.startswith(PREFIX) and part_of(e.cpu_parent) is None:  # outermost ranges only
            forward[e.name[len(PREFIX):]] += e.cpu_time_total
        if e.sequence_nr >= 0 and not e.name.startswith("autograd::"):
            by_sequence.setdefault(e.sequence_nr, part_of(e))
    for e in events:
        if e.name.startswith("autograd::engine::evaluate_function:"):
            backward[by_sequence.get(e.sequence_nr) or "unattributed"] += e.cpu_time_total
    total_backward = forward.pop("backward", 0.0)
    rows = {}
    for name in set(forward) | set(backward):
        if name in ("data", "optimizer"):
            continue
        rows[name] = (forward.get(name, 0.0), backward.get(name, 0.0))
    attributed_backward = sum(b for _, b in rows.values())
    rows["backward (autograd engine)"] = (0.0, max(total_backward - attributed_backward, 0.0))
    rows["optimizer"] = (forward.get("optimizer", 0.0), 0.0)
    rows["data"] = (forward.get("data", 0.0), 0.0)
    accounted = sum(f + b for f, b in rows.values())
    rows["other (Python, small ops)"] = (max(step_us - accounted, 0.0), 0.0)
    return {k: (f / active / 1e3, b / active / 1e3) for k, (f, b) in rows.items()}, step_us / active / 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                     "corpus", "SmolLM2-135M-Instruct"))
    ap.add_argument("--sequences", type=int, default=96, help="corpus sequences the steps draw from")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--steps", type=int, default=12, help="steps of a run (the first --warmup untimed)")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    ap.add_argument("--recipes", nargs="+", default=["before", "fp32", "bf16"], choices=["before", "fp32", "bf16"])
    ap.add_argument("--no-profile", action="store_true", help="only the timed runs")
    ap.add_argument("--batch", type=int, default=8, help="sequences a step")
    ap.add_argument("--tag", default="", help="appended to the CSV names")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from jakiro_ext.cli.common import load_target
    from jakiro_ext.training.settings import TrainConfig

    target, _, _ = load_target("float32", "cpu", None)
    examples = examples_of(target, args.corpus, args.sequences)
    machine = dict(cpu=cpu_name(), threads=args.threads, fp32_gflops=round(matmul_gflops(torch.float32)),
                   bf16_gflops=round(matmul_gflops(torch.bfloat16)))
    print(machine, file=sys.stderr)
    summary, parts = [], []
    for kind in args.kinds:
        for recipe in args.recipes:
            cfg = TrainConfig(steps=args.steps, lr=2e-3, warmup_steps=50, batch_sequences=args.batch,
                              compute_dtype="bfloat16" if recipe == "bf16" else "float32")
            tokens_s, step_s = timed_run(target, kind, examples, cfg, args.warmup, recipe)
            summary.append(dict(kind=kind, recipe=recipe, batch=args.batch, tokens_per_s=round(tokens_s),
                                tokens_per_s_per_thread=round(tokens_s / args.threads), step_ms=round(step_s * 1e3, 1),
                                **machine))
            print(summary[-1], file=sys.stderr)
            if args.no_profile:
                continue
            table, profiled_ms = profiled_run(target, kind, examples, cfg, args.warmup, recipe)
            for name, (f, b) in sorted(table.items(), key=lambda kv: -sum(kv[1])):
                if f + b < 0.05:
                    continue
                parts.append(dict(kind=kind, recipe=recipe, part=name, forward_ms=round(f, 1), backward_ms=round(b, 1),
                                  share=round((f + b) / profiled_ms, 3)))
                print(f"  {name:28s} fwd {f:8.1f} ms  bwd {b:8.1f} ms  {100 * (f + b) / profiled_ms:5.1f}%", file=sys.stderr)
    os.makedirs(RESULTS, exist_ok=True)
    write_csv(os.path.join(RESULTS, f"train_step{args.tag}.csv"), summary, list(summary[0]))
    if parts:
        write_csv(os.path.join(RESULTS, f"train_step_parts{args.tag}.csv"), parts, list(parts[0]))


if __name__ == "__main__":
    main()
