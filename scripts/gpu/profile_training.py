"""Where a training step's time goes on a device, at the default model's shapes with random
weights (nothing to carry): an EAGLE-2 and a Jakiro head (draft vocabulary 8192), batches of
``--batch`` sequences of 200-500 tokens, the step timed and profiled (torch.profiler: the ops by
host time and by device time), and the target's batched prefill of 8192 tokens timed.

    python scripts/gpu/profile_training.py --device cuda --out DIR
"""
import argparse
import os
import sys
import time

import torch
import transformers

from jakiro_ext.models import LlamaModel
from jakiro_ext.training.examples import Example
from jakiro_ext.training.features import attach_target_probs, prefill_features
from jakiro_ext.training.run import new_head
from jakiro_ext.training.settings import TrainConfig
from jakiro_ext.training.train import train_head


def smollm2_shaped(device: str, layers: int) -> LlamaModel:
    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                                   num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True,
                                   rms_norm_eps=1e-5, rope_theta=100000.0)
    torch.manual_seed(0)
    return LlamaModel.from_hf(transformers.LlamaForCausalLM(cfg).eval()).to(device)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--layers", type=int, default=30, help="the target's layers (for the prefill timing)")
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    target = smollm2_shaped(args.device, args.layers)
    g = torch.Generator().manual_seed(1)
    examples = []
    for i in range(8 * args.batch):
        n = int(torch.randint(200, 500, (1,), generator=g))
        tokens = torch.randint(0, 49152, (n,), generator=g)
        examples.append(Example(tokens, torch.randn(n, 576, generator=g).to(torch.bfloat16), torch.arange(n) >= 50, i))
    # The prefill that makes the features: one batch of 8192 padded tokens (16 x 512), timed.
    sequences = [torch.randint(0, 49152, (512,), generator=g) for _ in range(16)]
    prefill_features(target, sequences[:2], batch_tokens=8192)
    sync()
    t0 = time.perf_counter()
    prefill_features(target, sequences, batch_tokens=8192)
    sync()
    prefill_s = time.perf_counter() - t0
    print(f"prefill of 8192 tokens ({args.layers} layers): {prefill_s * 1e3:.0f} ms = {8192 / prefill_s:.0f} tokens/s",
          flush=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]
                                + ([torch.profiler.ProfilerActivity.CUDA] if args.device == "cuda" else [])) as prof:
        prefill_features(target, sequences[:4], batch_tokens=8192)
        sync()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    with open(os.path.join(args.out, "profile_prefill.txt"), "w") as f:
        f.write(table)
    print(table[:3000], flush=True)
    for kind in ("eagle2", "jakiro"):
        head, _ = new_head(target, "random", kind, examples, draft_vocab=8192, seed=0)
        cfg = TrainConfig(steps=args.steps, lr=2e-3, warmup_steps=5, batch_sequences=args.batch)
        attach_target_probs(examples, head, cfg.token_loss_top, progress=False)
        train_head(head, examples, TrainConfig(steps=3, warmup_steps=1, batch_sequences=args.batch))  # warm
        sync()
        t0 = time.perf_counter()
        history = train_head(head, examples, cfg)
        sync()
        step_s = (time.perf_counter() - t0) / args.steps
        tokens = history[-1]["tokens_seen"] / len(history)
        print(f"{kind}: {step_s * 1e3:.1f} ms a step of {tokens:.0f} tokens = {tokens / step_s:.0f} tokens/s", flush=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]
                                    + ([torch.profiler.ProfilerActivity.CUDA] if args.device == "cuda" else [])) as prof:
            train_head(head, examples, TrainConfig(steps=5, warmup_steps=1, batch_sequences=args.batch))
            sync()
        for sort in ("self_cpu_time_total", "self_device_time_total" if args.device == "cuda" else "cpu_time_total"):
            table = prof.key_averages().table(sort_by=sort, row_limit=30)
            with open(os.path.join(args.out, f"profile_{kind}_{sort}.txt"), "w") as f:
                f.write(table)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)[:4000], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
