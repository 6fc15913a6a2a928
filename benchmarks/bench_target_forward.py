"""The default target (SmolLM2-135M-Instruct) against what this machine allows, from one run.

Measured here, not assumed: the read bandwidth (a sum over 512 MiB) and the matrix-multiply peak
(torch.mm 2048^3) of fp32 and bf16. The machine is shared and its bandwidth drifts, so the
bandwidth is sampled beside every timed quantity and each fraction uses the samples taken next
to it. Per dtype:

* decoding step: plain decoding (``method="ar"``) after a 512-token prompt, the whole generation
  loop per token, against its floor (weight bytes / read bandwidth); and what the loop adds to a
  forward (mask, verification, compaction, bookkeeping, Python): its wall time minus its target
  forwards, timed where the loop calls them;
* tree forwards of T = 1, 2, 4, 8, 16, 32, 60 tokens after the 512: relative to T = 1 and to their
  roofline max(weight bytes / bandwidth, 2 x linear parameters x T / matmul peak);
* one draft layer of the shipped Jakiro head (4 frontier rows, its 8192-token draft vocabulary,
  the top-k pass included) relative to a target decoding step;
* a batched decoding step of 64 sequences (what training-set generation runs): GFLOP/s of its
  projections against the matmul peak;
* tokens/s of plain decoding next to transformers' greedy ``generate`` on the same prompt.

Writes ``results/target_forward.csv`` and ``results/target_forward.png`` (the tree-cost curve,
next to ``results/target_forward_before.csv``: the engine before issue 12)."""
import csv
import os
import sys
import statistics
import time

import torch

from common import RESULTS, Table, machine, parse_args, save_figure, timeit

PREFIX = 512
TREE_SIZES = (1, 2, 4, 8, 16, 32, 60)
BATCH = 64
DECODE_TOKENS = 48
PROMPT_TEXT = ("The history of the printing press begins with movable type in East Asia and continues with "
               "Gutenberg's press in Mainz, which spread across Europe within fifty years and changed how "
               "knowledge was kept, copied and argued over. ")


class Machine:
    """Read-bandwidth samples (a 512 MiB sum) and the matmul peaks, measured in this run."""

    def __init__(self):
        self._buffer = torch.ones(128 * 2**20)
        self.samples = []

    def bandwidth(self) -> float:
        """One sample: GB/s of the best of 3 sums."""
        best = min(self._time(lambda: self._buffer.sum()) for _ in range(3))
        gbs = self._buffer.numel() * 4 / best / 1e9
        self.samples.append(gbs)
        return gbs

    @staticmethod
    def _time(fn) -> float:
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    @staticmethod
    def matmul_peak(dtype: torch.dtype) -> float:
        a, b = torch.randn(2048, 2048).to(dtype), torch.randn(2048, 2048).to(dtype)
        t = timeit(lambda: a @ b, reps=8)
        return 2 * 2048**3 / (t["median_ms"] * 1e-3) / 1e9


def paired(machine: Machine, fn, rounds: int):
    """Medians over `rounds` of (ms of fn(), bandwidth sampled right before it)."""
    pairs = []
    for _ in range(rounds):
        bw = machine.bandwidth()
        pairs.append((fn(), bw))
    return statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs), pairs


def model_sizes(target):
    weight_bytes = sum(p.numel() * p.element_size() for p in target.parameters())  # tied weights once
    linear_params = sum(m.weight.numel() for m in target.modules() if isinstance(m, torch.nn.Linear))
    return weight_bytes, linear_params


def main():
    args = parse_args(__doc__)
    if args.device.type != "cpu":
        raise SystemExit("bench_target_forward measures the CPU engine")
    from jakiro_ext.cli.common import load_head
    from jakiro_ext.engine.generate import speculative_generate
    from jakiro_ext import ops
    from jakiro_ext.models.default import DEFAULT_MODEL, load_default_hf
    from jakiro_ext.kv_cache import TreeKV
    from jakiro_ext.models.llama import LlamaModel
    from jakiro_ext.ops.masks import causal_tree_mask

    table = Table("target_forward", args)
    mach = Machine()
    peaks = {dtype: Machine.matmul_peak(dtype) for dtype in (torch.float32, torch.bfloat16)}
    print(f"# matmul peak (torch.mm 2048^3): fp32 {peaks[torch.float32]:.0f} GFLOP/s, "
          f"bf16 {peaks[torch.bfloat16]:.0f} GFLOP/s; fp32 products on {512 if ops.cpu_avx512() else 256}-bit "
          f"vectors; bf16 dot products: {'native' if ops.cpu_bf16_dot() else 'widened to fp32'}")
    rounds = 3 if args.quick else 7
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).replace("torch.", "")
        hf, tokenizer = load_default_hf(dtype)
        target = LlamaModel.from_hf(hf, dtype)
        weight_bytes, linear_params = model_sizes(target)
        prompt = torch.tensor(tokenizer.encode(PROMPT_TEXT * 20)[:PREFIX], dtype=torch.int64)
        common = dict(dtype=name, prefix=PREFIX, weight_mb=weight_bytes / 1e6, matmul_peak_gflops=peaks[dtype])

        # 1. The decoding step: the whole loop, per token. What the loop adds besides the forward
        # comes from the same runs: the target's forwards are timed where the loop calls them.
        overheads = []

        def decode_ms():
            times = []
            forward = target.forward

            def timed(*a, **k):
                t = time.perf_counter()
                out = forward(*a, **k)
                times.append(time.perf_counter() - t)
                return out

            target.forward = timed  # an instance attribute: nn.Module.__call__ finds it first
            try:
                s = speculative_generate(target, None, prompt, DECODE_TOKENS, method="ar").stats
            finally:
                del target.forward
            per_token = 1e3 / (s.new_tokens - 1)
            overheads.append((s.wall_time_s - s.prefill_s - sum(times[1:])) * per_token)  # times[0]: the prefill
            return (s.wall_time_s - s.prefill_s) * per_token

        decode_ms()  # warm-up
        overheads.clear()
        step_ms, bw, pairs = paired(mach, decode_ms, rounds)
        overhead_ms = statistics.median(overheads)
        floor_fraction = statistics.median(weight_bytes / (b * 1e9) * 1e3 / ms for ms, b in pairs)

        # The forward alone, on a cache holding the prompt.
        cache = target.new_cache(1, PREFIX + max(TREE_SIZES))
        target(prompt.unsqueeze(0), cache, last_logits_only=True)
        cache.commit(PREFIX)
        g = torch.Generator().manual_seed(0)
        forward = {}
        for T in TREE_SIZES:
            parents = torch.tensor([[-1] + [(i - 1) // 3 for i in range(1, T)]])
            mask = ops.build_tree_mask(parents)
            depths = torch.tensor([[0] + [0] * (T - 1)])
            for i in range(1, T):
                depths[0, i] = depths[0, parents[0, i]] + 1
            tokens = torch.randint(0, target.config.vocab_size, (1, T), generator=g)
            ms, bw_t, _ = paired(mach, lambda: timeit(lambda: target(tokens, cache, mask, depths), args.reps)["median_ms"],
                                 2 if args.quick else 3)
            forward[T] = ms
            roofline_ms = max(weight_bytes / (bw_t * 1e9), 2 * linear_params * T / (peaks[dtype] * 1e9)) * 1e3
            table.add(**common, measure="tree_forward", tree_tokens=T, ms=ms, relative_to_one_token=ms / forward[1],
                      roofline_ms=roofline_ms, roofline_fraction=roofline_ms / ms, bandwidth_gbs=bw_t)
        table.add(**common, measure="decoding_step", tree_tokens=1, ms=step_ms, floor_ms=weight_bytes / (bw * 1e9) * 1e3,
                  floor_fraction=floor_fraction, loop_overhead_ms=overhead_ms, bandwidth_gbs=bw)

        # 3. One draft layer of the shipped Jakiro head: 4 frontier rows and its top-k pass.
        head = load_head("jakiro", None, target, DEFAULT_MODEL)
        draft_cache = head.new_cache(PREFIX + 16)
        draft_cache.commit(PREFIX)
        rows = 4
        itself = ops.pack_bits(torch.eye(rows, dtype=torch.bool)).unsqueeze(0)
        feats = torch.randn(1, rows, target.config.hidden_size, generator=g).to(dtype)
        toks = torch.randint(0, target.config.vocab_size, (1, rows), generator=g)
        pos = torch.full((1, rows), PREFIX)

        def draft_layer():
            step = head(toks, feats, pos, draft_cache, itself, TreeKV())
            return ops.contrastive_topk(step.feature[0], None, None, head.lm_head_weight, 10)

        d = timeit(draft_layer, args.reps)["median_ms"]
        table.add(**common, measure="draft_layer", tree_tokens=rows, ms=d, draft_vocab=head.lm_head_weight.shape[0],
                  relative_to_decoding_step=d / forward[1])

        # 4. A batched decoding step: 64 sequences, one token each, after 128 tokens each.
        batch_cache = target.new_cache(BATCH, 129)
        batch_prompt = prompt[:128].repeat(BATCH, 1)
        target(batch_prompt, batch_cache)
        batch_cache.commit(128)
        last = prompt[128:129].repeat(BATCH, 1)
        bmask, bdepths = causal_tree_mask(BATCH, 1), torch.zeros(BATCH, 1, dtype=torch.int64)
        b = timeit(lambda: target(last, batch_cache, bmask, bdepths), max(3, args.reps // 3))["median_ms"]
        gflops = 2 * linear_params * BATCH / (b * 1e-3) / 1e9
        table.add(**common, measure="batched_step", tree_tokens=BATCH, ms=b, gflops=gflops,
                  matmul_peak_fraction=gflops / peaks[dtype])

        # 5. Plain decoding next to transformers' greedy generate, same prompt, prefill included.
        def engine_tps():
            out = speculative_generate(target, None, prompt, DECODE_TOKENS, method="ar")
            return out.stats.new_tokens / out.stats.wall_time_s

        def hf_tps():
            t = time.perf_counter()
            with torch.no_grad():
                seq = hf.generate(prompt.unsqueeze(0), attention_mask=torch.ones(1, PREFIX, dtype=torch.int64),
                                  max_new_tokens=DECODE_TOKENS, min_new_tokens=DECODE_TOKENS, do_sample=False,
                                  pad_token_id=tokenizer.eos_token_id)
            return (seq.shape[1] - PREFIX) / (time.perf_counter() - t)

        hf_tps()
        ours = statistics.median(engine_tps() for _ in range(3))
        theirs = statistics.median(hf_tps() for _ in range(3))
        table.add(**common, measure="generate_tokens_per_s", tree_tokens=1, engine_tokens_per_s=ours,
                  transformers_tokens_per_s=theirs, speedup_vs_transformers=ours / theirs)
        del hf, target, head
    print(f"# bandwidth samples: median {statistics.median(mach.samples):.1f} GB/s, range "
          f"{min(mach.samples):.1f}-{max(mach.samples):.1f} ({len(mach.samples)} samples); {machine()}")
    table.save()
    chart(table.rows, os.path.join(RESULTS, "target_forward.png"))


def chart(rows, path):
    """Tree-forward cost relative to one token, before (results/target_forward_before.csv) and after."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    before_path = os.path.join(RESULTS, "target_forward_before.csv")
    before = list(csv.DictReader(open(before_path))) if os.path.exists(before_path) else []
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, dtype in zip(axes, ("float32", "bfloat16")):
        old = [r for r in before if r["dtype"] == dtype]
        new = [r for r in rows if r["dtype"] == dtype and r["measure"] == "tree_forward"]
        if old:
            ax.plot([int(r["tree_tokens"]) for r in old], [float(r["forward_ms"]) for r in old], "o--",
                    label="the first fused build")
        ax.plot([r["tree_tokens"] for r in new], [r["ms"] for r in new], "o-", label="now")
        ax.plot([r["tree_tokens"] for r in new], [r["roofline_ms"] for r in new], ":", color="black",
                label="roofline (this run)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tree tokens verified in one forward")
        ax.set_ylabel("forward ms (512-token prefix)")
        ax.set_title(f"SmolLM2-135M-Instruct {dtype}, 2 CPU threads")
        ax.legend()
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
    print(f"wrote {path}")


def replot() -> None:
    """The chart drawn again from the committed CSV (``--replot``), nothing measured."""
    rows = [dict(r, tree_tokens=int(r["tree_tokens"]), ms=float(r["ms"]), roofline_ms=float(r["roofline_ms"]))
            for r in csv.DictReader(open(os.path.join(RESULTS, "target_forward.csv"))) if r["measure"] == "tree_forward"]
    chart(rows, os.path.join(RESULTS, "target_forward.png"))


if __name__ == "__main__":
    replot() if "--replot" in sys.argv else main()
