"""A prompt's prefill by chunk size: the time to the first token's logits (the cache allocated,
every layer run, the last token's logits) for prompts of ``--lengths`` tokens, with the prompt run
as one forward (chunk 0) or as chunks of ``--chunks`` tokens (``LlamaModel.prefill_chunk``), and
the memory the prefill added at its peak (the process's peak resident set, reset before each
prefill, over what was resident before it). SmolLM2-135M-Instruct, random prompts, medians of
``--reps``. The chunk size with the best time at the longest prompts is the default
(``jakiro_ext.models.llama.PREFILL_CHUNK``). Writes ``results/prefill_chunks.csv``."""
import argparse
import os
import statistics
import time

import torch

from common import RESULTS, machine, write_csv


def resident_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # 5: reset the peak resident set (VmHWM)
        f.write("5")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="128,512,2048,4096,8192")
    ap.add_argument("--chunks", default="0,128,256,512,1024")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--out", default=os.path.join(RESULTS, "prefill_chunks.csv"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from jakiro_ext.models.default import load_default_target

    target, _ = load_default_target(getattr(torch, args.dtype))
    gen = torch.Generator().manual_seed(0)
    rows = []
    for chunk in [int(c) for c in args.chunks.split(",")]:
        target.prefill_chunk = chunk
        target(torch.randint(0, 1000, (1, 300), generator=gen), target.new_cache(1, 300), last_logits_only=True)
        for n in [int(x) for x in args.lengths.split(",")]:
            seconds, added = [], []
            for _ in range(args.reps):
                ids = torch.randint(0, target.config.vocab_size, (1, n), generator=gen)
                before = resident_mb("VmRSS")
                reset_peak()
                t0 = time.perf_counter()
                target(ids, target.new_cache(1, n), last_logits_only=True)
                seconds.append(time.perf_counter() - t0)
                added.append(resident_mb("VmHWM") - before)
            s = statistics.median(seconds)
            rows.append(dict(dtype=args.dtype, chunk=chunk, prompt_tokens=n, ttft_ms=round(s * 1e3, 1),
                             prompt_tokens_per_s=round(n / s, 1), peak_added_mb=round(max(added), 1),
                             machine=machine(), threads=args.threads))
            print(f"chunk {chunk:5d}, {n:5d} tokens: {s * 1e3:8.1f} ms ({n / s:7.1f} tokens/s), "
                  f"peak +{max(added):.0f} MB", flush=True)
    write_csv(args.out, rows)


if __name__ == "__main__":
    main()
