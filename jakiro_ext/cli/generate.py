"""``generate``: one prompt, streamed; ``demo``: plain decoding against Jakiro, tokens compared."""
from __future__ import annotations

import json
import sys
from typing import List

from jakiro_ext.cli.common import Runner, activity, chat_ids, check_generation_args, print_stats


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
    """Plain decoding and Jakiro on one prompt: the same tokens, and each run's statistics."""
    if args.temperature != 0:
        raise ValueError("demo compares greedy decodings (temperature 0); use generate to sample")
    runner = Runner(args, ["ar", "jakiro"], check_generation_args(args))
    ids = chat_ids(runner.tokenizer, args.prompt, True)
    print(f"prompt: {args.prompt!r} ({ids.numel()} tokens), {runner.name} {args.dtype}, greedy\n")
    ar = runner.run("ar", ids)
    jakiro = runner.run("jakiro", ids)
    print(runner.tokenizer.decode(jakiro.token_ids, skip_special_tokens=True), "\n")
    print_stats("ar", ar)
    print_stats("jakiro", jakiro)
    if ar.token_ids != jakiro.token_ids:
        print("FAILED: Jakiro's tokens differ from plain greedy decoding", file=sys.stderr)
        return 1
    print(f"\nidentical tokens; speedup {jakiro.stats.tokens_per_s / ar.stats.tokens_per_s:.2f}x")
    return 0
