"""A training checkpoint's head as a head directory: the weights of ``checkpoint.pt`` (written by
``train --checkpoint-every``) in the configuration of the head the run started from, saved (bf16
by default) with a ``training.json`` saying where the run stands (step of total, tokens seen, the
learning rate, the tokens the head saw before the run, the run's evaluations): what a
continuation on another machine needs (``train --init-from DIR`` with a short warm-up) and what
the learning curve needs (``long_run_curve.py --run NAME=DIR``) when the checkpoint itself (fp32
weights and the optimizer's moments) is not kept.

    python benchmarks/checkpoint_head.py CHECKPOINT INIT_HEAD_DIR OUT_DIR --tokens-before N [--dtype float32]

``--tokens-before``: what the init head had seen (for a stretch of the long run, the number its
README's table of stretches gives: asked for, not read from the init's ``training.json``, since
OUT_DIR may be that same directory, already holding an earlier export of this run).
"""
import argparse
import json

import torch

from jakiro_ext.models.heads.draft_head import DraftHead
from long_run_curve import curve


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("checkpoint")
    ap.add_argument("init_head", help="the head directory the run started from (its configuration)")
    ap.add_argument("out")
    ap.add_argument("--tokens-before", type=float, required=True, help="tokens the init head had seen")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = ap.parse_args()
    state = torch.load(args.checkpoint, map_location="cpu", weights_only=False)
    head = DraftHead.load(args.init_head).float()
    head.load_state_dict(state["head"])
    head.acceptance = None  # the init's profile is not this head's (profile it with train's evaluation)
    last = state["history"][-1]
    run = {"from_checkpoint": {"step": state["step"], "total_steps": state["total"],
                               "tokens_seen_in_run": last["tokens_seen"], "tokens_seen_before": args.tokens_before,
                               "lr": last["lr"], "config": state["config"],
                               "evaluations": curve(state["history"], args.tokens_before)}}
    head.save(args.out, dtype=getattr(torch, args.dtype), extra_files={"training.json": json.dumps(run, indent=1) + "\n"})
    print(f"{args.out}: step {state['step']} of {state['total']}, {last['tokens_seen']:,} tokens seen in the run")


if __name__ == "__main__":
    main()
