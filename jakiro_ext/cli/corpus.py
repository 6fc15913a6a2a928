"""``corpus``: the target answers prompts, tokens committed in shards; ``calibrate``: a head's
acceptance profile, measured on held-out corpus shards."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from jakiro_ext import atomic
from jakiro_ext.cli import common
from jakiro_ext.cli.common import activity, set_threads
from jakiro_ext.models.default import DEFAULT_MODEL
from jakiro_ext.models.heads.config import ACCEPTANCE_FILE
from jakiro_ext.models.heads.draft_head import DraftHead
from jakiro_ext.training.acceptance import acceptance_profile
from jakiro_ext.training.corpus import generate_corpus, read_corpus_meta
from jakiro_ext.training.feature_cache import feature_cache_dir
from jakiro_ext.training.features import corpus_examples
from jakiro_ext.training.sharegpt import load_sharegpt


def cmd_corpus(args) -> int:
    """Generate (or extend, or resume) a self-distilled token corpus."""
    set_threads(args.threads)
    atomic.check_output_dir(args.out, 0, "the corpus")  # writable, before anything is loaded
    activity.now = "loading the target model"
    target, tokenizer, _ = common.load_target("float32")
    conversations = None
    if args.conversations:
        conversations = load_sharegpt(Path(args.conversations))
    activity.now = f"generating the corpus {args.out}"
    try:
        meta = _generate_corpus(args, target, tokenizer, conversations)
    except KeyboardInterrupt:
        shards = read_corpus_meta(args.out)["shards"] if Path(args.out, "corpus.json").exists() else []
        activity.saved = (f"{args.out} holds {len(shards)} shards, {sum(s['answer_tokens'] for s in shards)} answer "
                          "tokens, the finished sequences included; the same command resumes")
        raise
    shards = meta["shards"]
    print(f"{args.out}: {len(shards)} shards, {sum(s['sequences'] for s in shards)} sequences, "
          f"{sum(s['answer_tokens'] for s in shards)} answer tokens", file=sys.stderr)
    return 0


def _generate_corpus(args, target, tokenizer, conversations) -> dict:

    return generate_corpus(args.out, target, tokenizer, DEFAULT_MODEL, args.answer_tokens, conversations,
                           max_prompt_tokens=args.max_prompt_tokens, max_new_tokens=args.max_new_tokens,
                           max_turns=args.max_turns, batch=args.generation_batch,
                           source=Path(args.conversations).name if args.conversations else None,
                           feature_dir=None if args.no_feature_cache else feature_cache_dir(args.out))


def cmd_calibrate(args) -> int:
    """Record a head's acceptance profile (what the tree choice needs) on a token corpus's
    held-out conversations, beside its weights (acceptance.json)."""
    set_threads(args.threads)
    if args.eval_every_nth < 1:
        raise ValueError(f"--eval-every-nth must be >= 1, got {args.eval_every_nth}")
    args.data = common.corpus_option(args.data)
    target, _, _ = common.load_target("float32")
    head = DraftHead.load(args.head, target)
    examples, _ = corpus_examples(args.data, target, feature_layers=getattr(head, "feature_layers", None) or ())
    held_out = [ex for ex in examples if ex.conversation % args.eval_every_nth == 0]
    profile = dict(acceptance_profile(head, held_out),
                   data=f"{len(held_out)} held-out sequences of {Path(args.data).name}")
    atomic.write_text(Path(args.head) / ACCEPTANCE_FILE, json.dumps(profile, indent=1) + "\n")
    row = lambda r: " ".join(f"{p:.3f}" for p in r[:4])  # noqa: E731
    print(f"{args.head}: acceptance by depth (ranks 0-3) on {profile['positions']} positions of {DEFAULT_MODEL}'s "
          "answers:\n" + "\n".join(f"  depth {d + 1}: {row(r)}" for d, r in enumerate(profile["depth_rank"])))
    return 0
