"""``train``: a draft head trained on a corpus's (or a training set's) target features; the steps
are :mod:`jakiro_ext.training`'s, this command reports them and saves the head."""
from __future__ import annotations

import json
import sys
import time
from typing import Optional
from pathlib import Path

import torch

from jakiro_ext import atomic
from jakiro_ext.cli import common
from jakiro_ext.cli.common import activity, set_threads
from jakiro_ext.models.heads.config import TRAINING_FILE, default_feature_layers
from jakiro_ext.training.acceptance import acceptance_profile
from jakiro_ext.training.distributed import init_distributed
from jakiro_ext.training.features import attach_target_probs
from jakiro_ext.training.run import (is_corpus, new_eagle3_head, new_head, read_training_data, training_summary,
                                     use_layer_features)
from jakiro_ext.training.settings import TrainConfig
from jakiro_ext.training.train import train_head


def train_config(args) -> TrainConfig:
    """The run's settings, as the loss uses them: a head on the target's layers learns from the
    token loss alone (weight 1, its contrastive branch at --w-token2 / --w-token of it), without
    feature losses or input noise (training.json records that, not the options' defaults)."""
    losses = dict(w_feature=args.w_feature, w_token=args.w_token, w_feature2=args.w_feature2, w_token2=args.w_token2,
                  noise=args.noise)
    if layered(args):
        if args.w_token <= 0:
            raise ValueError(f"--w-token {args.w_token}: a head on the target's layers learns from the token loss alone "
                             "(its weight must be > 0)")
        losses = dict(w_feature=0.0, w_token=1.0, w_feature2=0.0, w_token2=args.w_token2 / args.w_token, noise=0.0)
    return TrainConfig(epochs=args.epochs, steps=args.steps, lr=args.lr, warmup_steps=args.warmup_steps,
                       batch_sequences=args.batch, max_seq_len=args.max_seq_len, **losses,
                       ttt_steps=args.ttt_steps if args.ttt_steps is not None else 2 if layered(args) else 0,
                       minutes=args.minutes, max_epochs=args.max_epochs, mlp_input=args.mlp_input,
                       compute_dtype=args.compute_dtype, seed=args.seed, eval_every=args.eval_every,
                       checkpoint_every=args.checkpoint_every, eval_doublings=args.eval_doublings)


def layered(args) -> bool:
    """Whether the head to train reads the target's layers fused (eagle3, or --fused)."""
    return args.kind == "eagle3" or args.fused


def held_out_summary(final_eval: dict, sequences: int) -> str:
    """The held-out evaluation in a sentence: how often the head's draft is the sequence's own
    token, 1, 2, ... steps ahead along a path drafted right so far (``eval_acc{s}``)."""
    if not sequences or not final_eval:
        return "no held-out evaluation (--eval-every-nth 0): the head has no acceptance profile for the tree choice"
    return (f"held out ({sequences} sequences): its draft token is right {accuracy_ahead(final_eval)} of the time; the "
            f"full record is in training.json, the acceptance profile the tree choice reads in acceptance.json")


def accuracy_ahead(evals: dict) -> str:
    """'0.61 (1 ahead), 0.41 (2 ahead)': the ``eval_acc{s}`` of an evaluation, by steps ahead."""
    ahead = sorted((int(k[len("eval_acc"):]), v) for k, v in evals.items() if k[len("eval_acc"):].isdigit())
    return ", ".join(f"{v:.2f} ({s} ahead)" for s, v in ahead)


def cmd_train(args) -> int:
    """Build (or reuse) the training set of target features, then train one head and save it."""
    from tqdm import tqdm

    set_threads(args.threads)
    if args.fused and args.kind not in ("eagle2", "jakiro"):
        raise ValueError(f"--fused makes an eagle2 or jakiro head read the target's layers, got --kind {args.kind}"
                         + (" (an eagle3 head always reads them)" if args.kind == "eagle3" else ""))
    if args.feature_layers and not layered(args):
        raise ValueError(f"--feature-layers {args.feature_layers}: the layers an eagle3 or --fused head reads; "
                         f"a {args.kind} head reads the final hidden state (add --fused)")
    if args.fused and args.init_from_target:
        raise ValueError("--init-from-target starts a head as the target's last layer on its final hidden state; "
                         "a --fused head reads other features (start it from random weights)")
    train_config(args)  # (its checks, before anything is loaded)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available (torch.cuda.is_available() is False)")
    out = Path(args.out)
    # Writable before anything is loaded: the checkpoints go into --out, the head is written
    # beside it and swapped in.
    atomic.check_output_dir(out, 0, "the checkpoints")
    atomic.check_output_dir(out.resolve().parent, 0, "the head's new directory while it is written")
    args.data = common.corpus_option(args.data)
    if args.data and not Path(args.data).exists() and (args.shards is not None or args.feature_dtype != "float32"):
        raise FileNotFoundError(f"--data {args.data}: no token corpus there (seen from {Path.cwd()}); --shards and "
                                f"--feature-dtype read a corpus: give its path from here, or the name of a packaged one "
                                f"(SmolLM2-135M-Instruct)")
    ranks = init_distributed(args.device)  # several processes under torchrun: data-parallel
    main = ranks.rank == 0
    say = (lambda text: print(text, file=sys.stderr)) if main else (lambda text: None)
    activity.now = "loading the target model"
    target, tokenizer, name = common.load_target("float32", ranks.device, args.target)

    t0 = time.perf_counter()
    activity.now = ("reading the corpus and computing its missing features" if is_corpus(args.data)
                    else "building or reading the training set")
    data = read_training_data(args.data, target, tokenizer, name, ranks, args.shards, args.source, args.max_tokens,
                              args.max_prompt_tokens, args.max_new_tokens, args.generation_batch, args.corpus,
                              getattr(torch, args.feature_dtype))
    train, held_out = data.split(args.eval_every_nth)
    meta = data.meta
    say(f"training set {data.directory}: {meta['sequences']} sequences, {meta['tokens']} tokens "
        f"({meta['learned_tokens']} learned); {len(train)} for training, {len(held_out)} held out"
        + (f"; {ranks.world} processes, each {args.batch // ranks.world}+ sequences of every batch" if ranks.world > 1 else ""))

    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    if args.kind == "eagle3":
        if args.init_from or args.init_from_target:
            raise ValueError("--init-from and --init-from-target start EAGLE-1/2, Jakiro and Gumiho heads, not eagle3")
        head, coverage = new_eagle3_head(target, name, train, eos, args.draft_vocab, args.seed, args.intermediate_size or 0,
                                         args.feature_layers or ())
    else:
        head, coverage = new_head(target, name, args.kind, train, eos, args.experts, args.intermediate_size, args.layers,
                                  args.mlp_heads, args.mlp_blocks, args.draft_vocab, args.seed, args.init_from_target,
                                  args.init_from, (args.feature_layers or default_feature_layers(target.config.num_layers))
                                  if args.fused else ())
    if args.draft_vocab:
        say(f"draft vocabulary: {args.draft_vocab} tokens cover {coverage:.2%} of the learned tokens")
    if main:  # room for the checkpoints (fp32 weights and two Adam moments, the previous one kept) and the head
        params = sum(p.numel() for p in head.parameters() if p.requires_grad)
        checkpoint_bytes = 3 * 4 * params if args.checkpoint_every else 0
        atomic.check_output_dir(out, 3 * checkpoint_bytes + 2 * 4 * params, "the checkpoints and the head")
    cfg = train_config(args)
    if cfg.w_token or cfg.w_token2 or layered(args):  # the token loss's labels, computed once (cached for a corpus)
        activity.now = "computing the target's distributions the token loss learns from"
        # (An EAGLE-3 head's LM head is still the target's rows here: the labels are the target's.)
        attach_target_probs(data.examples, head, cfg.token_loss_top, data.feature_dir, progress=main, ranks=ranks)
    if layered(args):
        activity.now = "reading or computing the target layers' features the head reads"
        use_layer_features(data, target, head.feature_layers, ranks)
    if cfg.minutes:
        say(f"training for {cfg.minutes:g} minutes (the steps are set from the first steps' speed)")
    bar = tqdm(total=cfg.total_steps(len(train)) or None, desc=f"train {args.kind}", unit="step", disable=not main)

    def on_step(step: int, record: dict, planned: Optional[int]) -> None:
        # What an interrupt reports, set before the bar shows the step (a signal sent on seeing it
        # finds the message saying so). A budget in minutes: its steps as planned so far.
        if planned is not None and bar.total != planned:
            bar.total = planned
        activity.now = f"training the {args.kind} head (step {step + 2} of {bar.total or '?'})"
        bar.n = step + 1
        bar.set_postfix({k: f"{v:.3f}" for k, v in record.items()
                         if k in ("loss", "acc1", "acc2", "acc2_contrastive", "acc3_mlp")})
        evals = {k: round(v, 4) for k, v in record.items() if k.startswith("eval_")}
        if evals:
            bar.write(f"step {step + 1}: held out, its draft token is right {accuracy_ahead(evals)} of the time")

    t_train = time.perf_counter()
    checkpoint = out / "checkpoint.pt" if args.checkpoint_every else None
    activity.now = f"training the {args.kind} head"
    try:
        history = train_head(head, train, cfg, held_out, checkpoint, on_step, ranks)
    except KeyboardInterrupt:
        if checkpoint is not None and checkpoint.exists():
            step = torch.load(checkpoint, mmap=True, weights_only=False)["step"]
            activity.saved = f"{checkpoint} holds the first {step} steps; the same command resumes from there"
        else:
            activity.saved = "no checkpoint was kept (--checkpoint-every 0)"
        raise
    finally:
        bar.close()
    if not main:  # rank 0 writes the head
        ranks.close()
        return 0
    train_s = time.perf_counter() - t_train
    summary = training_summary(args.kind, name, data, train, held_out, cfg, history, train_s, ranks, args.draft_vocab,
                               coverage, args.init_from, args.init_from_target)
    if held_out:  # how often its drafts are accepted, by depth and rank: what the tree choice needs
        head.acceptance = dict(acceptance_profile(head, held_out, cfg.max_seq_len),
                               data=f"{len(held_out)} held-out sequences of {data.directory.name}")
    activity.now = f"saving the head to {out}"
    head.save(out, getattr(torch, args.save_dtype),
              extra_files={TRAINING_FILE: json.dumps(summary, indent=2, default=str) + "\n"})
    t = summary["train"]
    print(f"saved the {args.kind} head to {out}: {time.perf_counter() - t0:.0f} s in all, {train_s:.0f} s training "
          f"({t['total_steps']} steps, {t['epochs_seen']} epochs, {t['tokens_seen']:,} tokens seen)", file=sys.stderr)
    print(held_out_summary(summary["final_eval"], len(held_out)), file=sys.stderr)
    ranks.close()
    return 0
