"""The training path on a device, end to end, on a tiny random target (seconds): the target's
features by batched prefill, the token loss's cached labels, the three kinds of head trained
with a checkpoint and held-out evaluations, the acceptance profile, save and load. The first
steps' losses are checked against the same steps on the CPU (bf16 products on both), the
losses must fall, and the loaded head must evaluate as the trained one did.

    python scripts/gpu/check_training.py --device cuda

Exit 0 when every check held; each failure is printed with what was expected and seen. Without
the compiled library, set JAKIRO_USE_REFERENCE=1 (the target then runs the reference ops)."""
import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

from jakiro_ext.models import LlamaModel
from jakiro_ext.models.heads.draft_head import DraftHead
from jakiro_ext.training.acceptance import acceptance_profile
from jakiro_ext.training.examples import Example
from jakiro_ext.training.features import attach_target_probs, prefill_features
from jakiro_ext.training.loss import evaluate
from jakiro_ext.training.run import new_head
from jakiro_ext.training.settings import TrainConfig
from jakiro_ext.training.train import train_head

KINDS = {"eagle2": {}, "jakiro": dict(experts=4), "gumiho": dict(layers=2, mlp_heads=2, mlp_blocks=2)}


def tiny_target(vocab: int = 300) -> LlamaModel:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                                   rms_norm_eps=1e-5)
    return LlamaModel.from_hf(transformers.LlamaForCausalLM(cfg).eval())


def examples_on(target: LlamaModel, device: str, count: int = 40):
    """Sequences of a repeating random pattern (learnable), features by batched prefill on ``device``."""
    g = torch.Generator().manual_seed(1)
    sequences = []
    for i in range(count):
        period = 3 + i % 5
        pattern = torch.randint(0, target.config.vocab_size, (period,), generator=g)
        n = 12 + (7 * i) % 50
        sequences.append(pattern.repeat(n // period + 1)[:n])
    features = prefill_features(target.to(device), sequences, batch_tokens=512)
    return [Example(s, f.to(torch.bfloat16), torch.arange(s.numel()) >= 4, conversation=i)
            for i, (s, f) in enumerate(zip(sequences, features))]


def train_one(kind: str, device: str, target: LlamaModel, train, held_out, steps: int, workdir: Path) -> dict:
    head, _ = new_head(target.to(device), "tiny", kind, train, draft_vocab=200, seed=3, **KINDS[kind])
    cfg = TrainConfig(steps=steps, lr=3e-3, warmup_steps=5, batch_sequences=8, eval_every=steps // 2,
                      checkpoint_every=steps // 3, compute_dtype="bfloat16")
    attach_target_probs(train + held_out, head, cfg.token_loss_top, progress=False)
    t0 = time.perf_counter()
    history = train_head(head, train, cfg, held_out, workdir / f"{kind}-{device}.pt")
    seconds = time.perf_counter() - t0
    head.acceptance = acceptance_profile(head, held_out, cfg.max_seq_len, depth=3, ranks=4)
    head.save(workdir / f"{kind}-{device}", torch.float32)
    loaded = DraftHead.load(workdir / f"{kind}-{device}", target.to(device))
    return dict(history=history, seconds=seconds, eval=evaluate(head, held_out, cfg),
                loaded_eval=evaluate(loaded, held_out, cfg), profile=head.acceptance, cfg=cfg)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    failures = []

    def check(ok: bool, what: str) -> None:
        print(("ok   " if ok else "FAIL ") + what, flush=True)
        if not ok:
            failures.append(what)

    target = tiny_target()
    cpu_examples = examples_on(target, "cpu")
    dev_examples = examples_on(target, args.device)
    worst = max(float((a.features.float() - b.features.float()).abs().max()) for a, b in zip(cpu_examples, dev_examples))
    check(worst < 0.05, f"features on {args.device} are the CPU's (bf16): max |difference| {worst:.4f} < 0.05")
    with tempfile.TemporaryDirectory() as tmp:
        for kind in KINDS:
            runs = {}
            for device in dict.fromkeys(["cpu", args.device]):
                examples = cpu_examples if device == "cpu" else dev_examples
                runs[device] = train_one(kind, device, target, examples[:32], examples[32:], args.steps, Path(tmp))
            run = runs[args.device]
            losses = [r["loss"] for r in run["history"]]
            first = sum(losses[:3]) / 3
            last = sum(losses[-3:]) / 3
            check(all(math.isfinite(x) for x in losses) and last < 0.9 * first,
                  f"{kind} on {args.device}: {len(losses)} steps in {run['seconds']:.1f} s, loss {first:.3f} -> {last:.3f}"
                  " (finite, falls by 10% or more)")
            cpu_first = [r["loss"] for r in runs["cpu"]["history"][:3]]
            gap = max(abs(a - b) / abs(b) for a, b in zip(losses[:3], cpu_first))
            check(gap < 0.05, f"{kind}: the first steps' losses on {args.device} {[round(x, 4) for x in losses[:3]]} "
                              f"are the CPU's {[round(x, 4) for x in cpu_first]} within 5% (worst {gap:.3%})")
            check(run["eval"] == run["loaded_eval"],
                  f"{kind}: the saved and loaded head evaluates as trained ({run['loaded_eval']} == {run['eval']})")
            evals = [r for r in run["history"] if any(k.startswith("eval_") for k in r)]
            check(len(evals) >= 2 and len(run["profile"]["depth_rank"]) == 3,
                  f"{kind}: {len(evals)} held-out evaluations, an acceptance profile of 3 depths")
    print(f"{'all checks held' if not failures else f'{len(failures)} checks failed'} ({args.device})", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
