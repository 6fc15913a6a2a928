"""``generate``: one prompt, streamed; ``demo``: plain decoding against Jakiro, tokens compared."""
from __future__ import annotations

import json
import os
import sys
import time
from typing import List

from jakiro_ext.cli.bench import read_prompts
from jakiro_ext.cli.common import PROMPTS_FILE, Runner, activity, chat_ids, check_generation_args, print_stats


# ----------------------------------------------------------------------------- commands
def cmd_generate(args) -> int:
    runner = Runner(args, [args.method], check_generation_args(args))
    ids = chat_ids(runner.tokenizer, args.prompt, not args.no_chat_template)
    tokens: List[int] = []
    shown = [""]

    def stream(new: List[int]) -> None:
        tokens.extend(new)
        text = runner.tokenizer.decode(tokens, skip_special_tokens=True)
        print(text[len(shown[0]):], end="", flush=True)
        shown[0] = text

    try:
        out = runner.run(args.method, ids, None if args.json else stream)
    except KeyboardInterrupt:
        if not args.json:
            print()
        activity.saved = f"{len(tokens)} tokens had been generated" if not args.json else ""
        raise
    text = runner.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    if args.json:
        print(json.dumps(dict(method=args.method, text=text, token_ids=out.token_ids, **out.stats.as_dict())))
    else:
        print()
        print_stats(args.method, out)
    return 0


def cmd_demo(args) -> int:
    """Plain decoding and Jakiro: the demo's question answered (the same tokens both ways, each
    run's statistics), and the speedup over it and one packaged prompt of each category, the
    methods alternated prompt by prompt after an untimed short run of each (a first call
    allocates, and the tree choice measures the machine's round costs once)."""
    if args.temperature != 0:
        raise ValueError("demo compares greedy decodings (temperature 0); use generate to sample")
    runner = Runner(args, ["ar", "jakiro"], check_generation_args(args))
    ids = chat_ids(runner.tokenizer, args.prompt, True)
    seen, prompts = set(), [ids]
    for row in read_prompts(PROMPTS_FILE, None):  # the first of each category
        if row.get("category") not in seen:
            seen.add(row.get("category"))
            prompts.append(chat_ids(runner.tokenizer, row["prompt"], True))
    print(f"prompt: {args.prompt!r} ({ids.numel()} tokens), {runner.name} {args.dtype}, greedy; then "
          f"{len(prompts) - 1} packaged prompts (one of each category), timed\n")
    for method in ("ar", "jakiro"):  # warm-up, untimed
        runner.run(method, ids, max_new_tokens=8)
    busy = machine_load()
    runs = {"ar": [], "jakiro": []}
    for i, prompt in enumerate(prompts):  # alternated: the machine's drift hits both alike
        for method in ("ar", "jakiro") if i % 2 == 0 else ("jakiro", "ar"):
            runs[method].append(runner.run(method, prompt))
    ar, jakiro = runs["ar"][0], runs["jakiro"][0]
    print(runner.tokenizer.decode(jakiro.token_ids, skip_special_tokens=True), "\n")
    print_stats("ar", ar)
    print_stats("jakiro", jakiro)
    if any(a.token_ids != j.token_ids for a, j in zip(runs["ar"], runs["jakiro"])):
        print("FAILED: Jakiro's tokens differ from plain greedy decoding", file=sys.stderr)
        return 1
    rate = {m: sum(o.stats.new_tokens for o in outs) / sum(o.stats.wall_time_s for o in outs) for m, outs in runs.items()}
    tau = sum(o.stats.new_tokens for o in runs["jakiro"]) / sum(o.stats.target_forwards for o in runs["jakiro"])
    print(f"\nidentical tokens on all {len(prompts)} prompts; Jakiro decodes {rate['jakiro'] / rate['ar']:.2f}x as fast "
          f"as plain decoding over them ({rate['jakiro']:.1f} against {rate['ar']:.1f} tokens/s; tau {tau:.2f})")
    print("tau: tokens per target forward (plain decoding: 1); histogram: rounds by how many drafted tokens the "
          "target accepted (0, 1, 2, ...)")
    if busy:
        print(f"note: {busy} during the runs' start: speedups measured now are lower than on an idle machine")
    return 0


def machine_load(seconds: float = 0.5) -> str:
    """Other processes' use of the CPUs, in a clause ("" under half a core, or where /proc/stat is
    not there): the CPUs' busy time over ``seconds`` while this process sleeps (a load average
    would count this process's own loading of the model)."""
    def sample():
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:]]
        return sum(ticks), ticks[3] + ticks[4]  # (all, idle + iowait)

    try:
        total0, idle0 = sample()
        time.sleep(seconds)
        total1, idle1 = sample()
    except (OSError, ValueError, IndexError):
        return ""
    cores = os.cpu_count() or 1
    busy = (1 - (idle1 - idle0) / max(total1 - total0, 1)) * cores
    return f"other processes kept {busy:.1f} of {cores} cores busy" if busy > 0.5 else ""
