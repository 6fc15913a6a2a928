"""The training loop of a draft head: epochs of shuffled batches, the cosine schedule, evaluation
at chosen steps, and checkpoints that a stopped run resumes from (the loss: :mod:`.loss`).
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import torch

from jakiro_ext import atomic
from jakiro_ext.models.heads.draft_head import DraftHead
from jakiro_ext.profiling import scope
from jakiro_ext.training.distributed import Ranks
from jakiro_ext.training.examples import Batch, Example, batch_length, collate
from jakiro_ext.training.loss import batch_loss, batch_noise, evaluate, reads_layers, scored_rows
from jakiro_ext.training.settings import TrainConfig, compute_dtype

# With a budget in minutes, the steps are set from the time of the first BUDGET_PROBE_STEPS (less
# the first BUDGET_SKIP_STEPS: allocations, a GPU's lazy start), then set again every
# BUDGET_REPLAN_STEPS from the median of the sitting's windows' rates (a transient load, such as a
# test suite run beside it for a few windows, does not move the plan and its learning rate).
BUDGET_PROBE_STEPS = 10
BUDGET_SKIP_STEPS = 2
BUDGET_REPLAN_STEPS = 100


def shuffled_batches(examples: Sequence[Example], cfg: TrainConfig, epoch: int) -> List[List[int]]:
    """One epoch's batches, reproducible from (seed, epoch): shuffled, then grouped by length
    within windows of 16 batches to cut padding, then the batches shuffled."""
    g = torch.Generator().manual_seed(cfg.seed * 100_003 + epoch)
    order = torch.randperm(len(examples), generator=g).tolist()
    window = cfg.batch_sequences * 16
    batches = []
    for w in range(0, len(order), window):
        chunk = sorted(order[w : w + window], key=lambda i: examples[i].tokens.numel())
        batches += [chunk[j : j + cfg.batch_sequences] for j in range(0, len(chunk), cfg.batch_sequences)]
    perm = torch.randperm(len(batches), generator=g).tolist()
    return [batches[i] for i in perm]


class _HeadLoss(torch.nn.Module):
    """The head's batch loss as a module's forward, for DistributedDataParallel to wrap."""

    def __init__(self, head: DraftHead):
        super().__init__()
        self.head = head

    def forward(self, batch: Batch, cfg: TrainConfig, noise: Optional[torch.Tensor], totals: Dict[str, int]):
        return batch_loss(self.head, batch, cfg, noise, totals)


def doubling(first: int, tokens: int) -> int:
    """How many times ``first`` has doubled by ``tokens`` (-1 before ``first``; -1 with ``first`` 0)."""
    return int(math.log2(tokens / first)) if first and tokens >= first else -1


def previous_checkpoint(path: Path) -> Path:
    """Where the checkpoint before the last one is kept (``checkpoint.prev.pt``)."""
    return path.with_name(path.stem + ".prev" + path.suffix)


def write_checkpoint(path: Path, state: dict) -> None:
    """Write a training checkpoint atomically, keeping the one it replaces as
    :func:`previous_checkpoint` (a fallback should the newer be damaged later)."""
    if path.exists():  # the previous one, by a hard link: the checkpoint itself stays in place
        atomic.write_file(previous_checkpoint(path), lambda tmp: atomic.link_or_copy(path, tmp))
    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:  # (a file object: a failed write's OSError reaches the error message)
            torch.save(state, f)

    atomic.write_file(path, write)


def read_checkpoint(path: Path) -> dict:
    """A training checkpoint; a damaged one is a ValueError naming it and the way on."""
    try:
        state = torch.load(path, weights_only=False)
        if not isinstance(state, dict) or not {"head", "optimizer", "schedule", "step", "config"} <= set(state):
            raise ValueError("not a training checkpoint of this package")
    except Exception as exc:  # noqa: BLE001 - truncated, flipped or foreign files all end here
        previous = previous_checkpoint(path)
        way = (f"resume from the previous checkpoint (mv {previous} {path}) or delete it to start over"
               if previous.exists() else "delete it to start over")
        reason = (str(exc).splitlines() or [""])[0]
        raise ValueError(f"checkpoint {path} is damaged ({type(exc).__name__}: {reason}): {way}") from None
    return state


def train_head(head: DraftHead, examples: Sequence[Example], cfg: TrainConfig,
               eval_examples: Sequence[Example] = (), checkpoint: Optional[os.PathLike] = None,
               on_step: Optional[Callable[[int, dict, Optional[int]], None]] = None, ranks: Ranks = Ranks()) -> List[dict]:
    """Optimise the head's own weights (the target's embedding and LM head stay frozen) with
    AdamW, linear warm-up then cosine decay. Returns the history: one dict per step (loss,
    accuracies, lr, and the evaluation's when one ran).

    ``checkpoint``: a file written every ``cfg.checkpoint_every`` steps (head, optimiser, schedule,
    step, history); when it exists the run resumes from it, bit-exactly (the batch order and the
    noise are functions of the seed and the step).

    ``ranks``: with several processes (:func:`init_distributed`, under torchrun) each takes its
    share of every batch (sequences rank, rank + world, ...), padded to the whole batch's length,
    with its rows of the batch's noise; the loss terms are divided by the whole batch's rows and
    DistributedDataParallel sums the gradients, so the steps are those of one process running the
    same batches (to float rounding), on any number of processes, resumed on any other number.
    Rank 0 writes the checkpoint and calls ``on_step``; every process returns the same history."""
    device = head.fc.weight.device
    dtype = compute_dtype(cfg.compute_dtype, device)
    if cfg.batch_sequences < ranks.world:
        raise ValueError(f"a batch of {cfg.batch_sequences} sequences cannot be shared by {ranks.world} processes "
                         "(batch_sequences >= processes)")
    if head.lm_head_weight is None:
        raise ValueError("bind the head to its target first (head.bind(target))")
    if not examples:
        raise ValueError("no training examples")
    if cfg.mlp_input not in ("teacher", "drafted"):
        raise ValueError(f"mlp_input must be 'teacher' or 'drafted', got {cfg.mlp_input!r}")
    if cfg.ttt_steps < 0 or not cfg.ttt_decay > 0:
        raise ValueError(f"ttt_steps must be >= 0 and ttt_decay > 0, got {cfg.ttt_steps} and {cfg.ttt_decay}")
    if cfg.max_epochs < 0 or (cfg.max_epochs and not cfg.minutes):
        raise ValueError(f"max_epochs caps a budget in minutes (set minutes, or give the length as epochs or "
                         f"steps), got max_epochs={cfg.max_epochs} with minutes={cfg.minutes}")
    if cfg.minutes and cfg.warmup_steps < BUDGET_PROBE_STEPS:
        raise ValueError(f"a budget in minutes needs warmup_steps >= {BUDGET_PROBE_STEPS} (the steps are set from "
                         f"their time, before the schedule depends on them), got {cfg.warmup_steps}")
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    model: torch.nn.Module = _HeadLoss(head)
    if ranks.world > 1:  # (experts no token was routed to get no gradient on some processes)
        model = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    UNSET = 10**9
    total = cfg.total_steps(len(examples)) or UNSET  # a budget in minutes: set after the probe steps

    def schedule(step: int) -> float:
        # The warm-up: at most a tenth of a run whose length is known (a short run reaches its peak
        # rate), never under the probe steps; before a budget's length is known, as configured.
        warmup = cfg.warmup_steps if total == UNSET else min(cfg.warmup_steps, max(BUDGET_PROBE_STEPS, total // 10))
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    history: List[dict] = []
    start = 0
    earlier = 0.0  # seconds the steps before ``start`` took (earlier segments of a resumed run)
    if checkpoint is not None:
        atomic.remove_stale_temporaries(Path(checkpoint).parent)
    if checkpoint is not None and Path(checkpoint).exists():
        state = read_checkpoint(Path(checkpoint))
        if cfg.minutes:
            total = state["total"]
        if state["config"] != asdict(cfg) or state["total"] != total or state["examples"] != len(examples):
            raise ValueError(f"{checkpoint} was written by a run with other settings or data:\n  there: {state['config']}, "
                             f"{state['examples']} examples\n  asked: {asdict(cfg)}, {len(examples)} examples\n"
                             "resume with the same settings and data, or delete it")
        saved_vocab = state["head"].get("draft_to_target")
        if saved_vocab is not None and not torch.equal(saved_vocab.cpu(), head.draft_to_target.cpu()):
            raise ValueError(f"{checkpoint} was trained with another draft vocabulary than this head's "
                             "(its LM-head rows would not match the ids): resume with the same data, or delete it")
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["schedule"])
        history, start = state["history"], state["step"]
        # (A checkpoint from before the seconds were kept: its steps at the rate its plan assumed.)
        earlier = state.get("seconds", start * cfg.minutes * 60 / total if cfg.minutes else 0.0)
    per_epoch = math.ceil(len(examples) / cfg.batch_sequences)
    epoch_batches, epoch_of = None, -1
    head.train()
    step, t_start = start, time.perf_counter()
    window = None  # a budget in minutes: where the rate of the steps is measured from
    window_rates: List[float] = []  # seconds a step in this sitting's earlier windows
    saved = [start]

    def save(at: int) -> None:
        if checkpoint is not None and ranks.rank == 0 and saved[0] != at:
            write_checkpoint(Path(checkpoint), {
                "head": head.state_dict(), "optimizer": opt.state_dict(), "schedule": sched.state_dict(),
                "step": at, "history": history, "config": asdict(cfg), "total": total, "examples": len(examples),
                "seconds": earlier + time.perf_counter() - t_start})
            saved[0] = at

    try:
        while step < total:
            if cfg.minutes and step == start + BUDGET_SKIP_STEPS:
                window = (time.perf_counter(), step, 0.0)  # (start time, step, evaluation seconds within)
            if cfg.minutes and step >= start + BUDGET_PROBE_STEPS and (
                    total == UNSET or (step - window[1] >= BUDGET_REPLAN_STEPS and step < 0.9 * total)):
                # The steps that fit in what is left of the budget, at the median rate of this
                # sitting's windows (evaluations left out: their time counts in what is spent); again
                # every BUDGET_REPLAN_STEPS until the last tenth, for a rate that changes for good
                # (a shared GPU) but not for a few windows of load.
                now = time.perf_counter()
                window_rates.append(ranks.max((now - window[0] - window[2]) / (step - window[1])))  # (one for all)
                per_step = sorted(window_rates)[len(window_rates) // 2]
                # What earlier segments took, as they took it: a slow stretch now (a loaded machine)
                # plans the steps left at its rate, not the steps already taken.
                spent = now - t_start + earlier
                total = step + max(1, int((cfg.minutes * 60 - spent) / per_step))
                if cfg.max_epochs:
                    total = min(total, max(step + 1, math.ceil(cfg.max_epochs * len(examples) / cfg.batch_sequences)))
                window = (now, step, 0.0)
            epoch = step // per_epoch
            if epoch != epoch_of:
                epoch_batches, epoch_of = shuffled_batches(examples, cfg, epoch), epoch
            chosen = [examples[i] for i in epoch_batches[(step % per_epoch) % len(epoch_batches)]]
            length = batch_length(chosen, cfg.max_seq_len)
            seen_before = history[-1].get("tokens_seen", 0) if history else 0
            seen = seen_before + sum(min(ex.tokens.numel(), cfg.max_seq_len) for ex in chosen)  # the whole batch's
            # An epoch's last batch may leave a process without a sequence: it runs the first one
            # with a zero weight, as every process must take part in the gradients' reduction.
            share = list(range(len(chosen)))[ranks.rank::ranks.world]
            idle = not share
            share = share or [0]
            with scope("data"):
                batch = collate([chosen[i] for i in share], cfg.max_seq_len, length).to(device)
                # (A head on EAGLE-3's features gets no noise: the training-time test feeds it its own errors.)
                noise = None if reads_layers(head) else batch_noise(cfg, step, len(chosen), length,
                                                                    batch.features.shape[-1], device)
            rows = {k: 0 if idle else n for k, n in scored_rows(batch, cfg, head.config.num_experts > 0,
                                                                getattr(head.config, "num_mlp_heads", 0)).items()}
            names = sorted(rows)
            totals = dict(zip(names, (int(n) for n in ranks.sum([rows[k] for k in names]))))
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                loss, metrics = model(batch, cfg, None if noise is None else noise[share],
                                      totals)
            if idle:
                loss, metrics = loss * 0.0, {k: 0 for k in metrics}
            with atomic.signals_held():  # a step is taken whole: an interrupt comes before or after it
                opt.zero_grad()
                with scope("backward"):
                    (loss * ranks.world).backward()  # DDP averages the processes' gradients; the batch's are their sum
                with scope("optimizer"):
                    torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
                    opt.step()
                    sched.step()
                summed = ranks.sum([float(loss.detach())] + [metrics[f"hits_{k}"] for k in names])
                record = {"step": step + 1, "tokens_seen": seen, "loss": summed[0], "lr": opt.param_groups[0]["lr"],
                          **{k: summed[1 + i] / max(totals[k], 1) for i, k in enumerate(names)}}
                history.append(record)
                step += 1
            last = step == total
            if eval_examples and ((cfg.eval_every and step % cfg.eval_every == 0) or last
                                  or doubling(cfg.eval_doublings, seen) > doubling(cfg.eval_doublings, seen_before)):
                t_eval = time.perf_counter()
                record.update({"eval_" + k: v for k, v in evaluate(head, eval_examples, cfg, ranks=ranks).items()})
                if cfg.minutes and window is not None:
                    window = (window[0], window[1], window[2] + time.perf_counter() - t_eval)
            if on_step and ranks.rank == 0:
                on_step(step - 1, record, None if total == UNSET else total)  # (a budget's steps, as planned now)
            if cfg.checkpoint_every and step % cfg.checkpoint_every == 0 or last:
                save(step)
    except KeyboardInterrupt:  # SIGINT, or SIGTERM as the CLI raises it: the steps taken so far are kept
        save(step)
        raise
    head.eval()
    return history
