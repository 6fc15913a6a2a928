"""The measurements the GPU path is judged by (bf16, batch 1), in one run:

1. ``linear``: jakiro::linear at 1..64 rows (a decoding step to a 64-node tree's verification)
   against torch's linear (cuBLAS), with the weights streamed from HBM: distinct copies of each
   weight, together over 4x the L2 (at least 256 MiB), called in turn, so that every call reads
   its weight from memory. Per shape (Llama-3-8B's and SmolLM2-135M's projections and LM heads)
   and row count: the time a call, the weight's read rate as a fraction of the measured copy
   bandwidth and of the rated HBM bandwidth, ours over cuBLAS (the same bytes over each one's time:
   "time-equivalent bandwidth"), and the CUDA-core kernel (JAKIRO_GPU_TENSOR_CORES=0) beside them.
   Row invariance: the elements of rows [0, r) that differ from the same rows of the 64-row call
   (``ours_rows_differ`` must be 0; ``cublas_rows_differ`` shows why cuBLAS cannot verify a tree).
   ``blocks``: the same for Llama-3-8B's shapes at 1, 16 and 64 rows with the split of K aimed at
   other block counts (JAKIRO_GPU_LINEAR_BLOCKS; the default is 512): what the constant should be.
2. ``forward``: a random-weight target of Llama-3-8B's shape, bf16: the target's forward of a tree
   of T = 1, 16, 32, 64 tokens after a 512-token prefix, tensor cores on and off; relative to the
   one-token forward, and the one-token forward's weight bytes over its time against HBM (plain
   decoding's floor).
3. ``attention``: jakiro::tree_attention alone at Llama-3-8B's heads (32 query, 8 KV, 128 dims),
   bf16, after 512 and 4096 keys, for a decoding step and 16- and 64-token trees: the default
   (fixed splits of each row's run; a bf16 tree and a one-token step alike on tensor cores, each
   row's last 64-79 keys summed in float), the same on CUDA cores, even parts of the keys as they
   lie (not batch-invariant: what the fixed splits cost against), and SDPA over the dense mask.

    python scripts/gpu/tensor_cores.py --device cuda --out tensor_cores.csv
    python scripts/gpu/tensor_cores.py --device cpu --dry-run      (tiny shapes: the script itself)
"""
import argparse
import contextlib
import math
import os
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "benchmarks"))
sys.path.insert(0, HERE)

import common  # noqa: E402
from common import memory_bandwidth_gbs, peak_hbm_gbs, timeit, write_csv  # noqa: E402
from e2e import random_target  # noqa: E402
from jakiro_ext import ops  # noqa: E402
from jakiro_ext.ops import reference  # noqa: E402

LINEAR_SHAPES = {  # name: (N out features, K in features)
    "llama3-8b qkv": (6144, 4096), "llama3-8b o": (4096, 4096), "llama3-8b gate_up": (28672, 4096),
    "llama3-8b down": (4096, 14336), "llama3-8b lm_head": (128256, 4096),
    "smollm2 qkv": (960, 576), "smollm2 gate_up": (3072, 576), "smollm2 down": (576, 1536),
    "smollm2 lm_head": (49152, 576),
}
DRY_SHAPES = {"tiny qkv": (96, 64), "tiny down": (64, 160)}
ROWS = (1, 2, 4, 8, 16, 32, 48, 60, 64)
TREE_SIZES = (1, 16, 32, 64)
PREFIX = 512


@contextlib.contextmanager
def env(name: str, value: str):
    """os.environ[name] = value for the calls inside (the kernels' settings are read at each call)."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


def cuda_cores():
    """The CUDA-core kernels for the calls inside."""
    return env("JAKIRO_GPU_TENSOR_CORES", "0")


def stream_bytes(device: torch.device, dry: bool) -> int:
    if dry:
        return 1 << 20
    if device.type == "cuda":
        return max(4 * torch.cuda.get_device_properties(device).L2_cache_size, 256 << 20)
    return 256 << 20


def streamed_copies(N: int, K: int, g: torch.Generator, args) -> list:
    """Distinct bf16 weights [N, K], together over stream_bytes: called in turn, each call reads
    its weight from memory."""
    copies = max(1, min(4096, math.ceil(stream_bytes(args.device, args.dry_run) / (N * K * 2))))
    return [(torch.randn(N, K, generator=g, device=args.device) * K**-0.5).to(torch.bfloat16) for _ in range(copies)]


def linear_rows(args, rows_out: list, copy_gbs: float, rated_gbs: float) -> None:
    device, dtype = args.device, torch.bfloat16
    shapes = DRY_SHAPES if args.dry_run else LINEAR_SHAPES
    rows_list = (1, 16, 64) if args.dry_run else ROWS
    for name, (N, K) in shapes.items():
        g = torch.Generator(device=device).manual_seed(0)
        nbytes = N * K * 2
        weights = streamed_copies(N, K, g, args)
        copies = len(weights)
        x64 = torch.randn(64, K, generator=g, device=device).to(dtype)
        full_ours, full_cublas = ops.linear(x64, weights[0]), F.linear(x64, weights[0])
        for r in rows_list:
            x = x64[:r]
            row = dict(part="linear", shape=name, N=N, K=K, rows=r, copies=copies,
                       ours_rows_differ=int((ops.linear(x, weights[0]) != full_ours[:r]).sum()),
                       cublas_rows_differ=int((F.linear(x, weights[0]) != full_cublas[:r]).sum()),
                       max_abs_diff_vs_fp32=float((full_ours[:r].float() - x.float() @ weights[0].float().t()).abs().max()))
            arms = {"ours": lambda: [ops.linear(x, w) for w in weights],
                    "cublas": lambda: [F.linear(x, w) for w in weights]}
            for arm, fn in arms.items():
                row[f"{arm}_us"] = timeit(fn, args.reps)["median_ms"] * 1e3 / copies
            with cuda_cores():
                row["cuda_cores_us"] = timeit(arms["ours"], args.reps)["median_ms"] * 1e3 / copies
            for arm in ("ours", "cublas", "cuda_cores"):
                gbs = nbytes / (row[f"{arm}_us"] * 1e-6) / 1e9
                row[f"{arm}_gbs"] = gbs
                row[f"{arm}_of_copy_bandwidth"] = gbs / copy_gbs
                row[f"{arm}_of_rated_hbm"] = gbs / rated_gbs if rated_gbs else float("nan")
            row["ours_over_cublas"] = row["cublas_us"] / row["ours_us"]
            row["cuda_cores_over_cublas"] = row["cublas_us"] / row["cuda_cores_us"]
            rows_out.append(row)
            print(f"linear {name:20s} rows {r:2d}: ours {row['ours_us']:8.1f} us ({row['ours_of_copy_bandwidth']:.0%} "
                  f"of copy), cuBLAS {row['cublas_us']:8.1f} us, CUDA cores {row['cuda_cores_us']:8.1f} us, ours/cuBLAS "
                  f"{row['ours_over_cublas']:.2f}x; rows differing from the 64-row call: ours {row['ours_rows_differ']}, "
                  f"cuBLAS {row['cublas_rows_differ']}", flush=True)
        del weights
        if device.type == "cuda":
            torch.cuda.empty_cache()


def block_targets(args, rows_out: list, copy_gbs: float, rated_gbs: float) -> None:
    device = args.device
    shapes = DRY_SHAPES if args.dry_run else {k: v for k, v in LINEAR_SHAPES.items() if k.startswith("llama3-8b")}
    targets = (1, 4) if args.dry_run else (128, 256, 396, 512, 792, 1024, 2048, 4096)
    for name, (N, K) in shapes.items():
        g = torch.Generator(device=device).manual_seed(0)
        weights = streamed_copies(N, K, g, args)
        copies = len(weights)
        for r in (1, 16, 64):
            x = torch.randn(r, K, generator=g, device=device).to(torch.bfloat16)
            for blocks in targets:
                with env("JAKIRO_GPU_LINEAR_BLOCKS", str(blocks)):
                    us = timeit(lambda: [ops.linear(x, w) for w in weights], args.reps)["median_ms"] * 1e3 / copies
                gbs = N * K * 2 / (us * 1e-6) / 1e9
                rows_out.append(dict(part="blocks", shape=name, N=N, K=K, rows=r, copies=copies, target_blocks=blocks,
                                     ours_us=us, ours_gbs=gbs, ours_of_copy_bandwidth=gbs / copy_gbs,
                                     ours_of_rated_hbm=gbs / rated_gbs if rated_gbs else float("nan")))
                print(f"blocks {name:20s} rows {r:2d} target {blocks:5d}: {us:8.1f} us ({gbs / copy_gbs:.0%} of copy)",
                      flush=True)
        del weights
        if device.type == "cuda":
            torch.cuda.empty_cache()


def tree_forwards(args, rows_out: list, copy_gbs: float, rated_gbs: float) -> None:
    device = args.device
    shape, prefix, sizes = ("tiny", 16, (1, 4, 8)) if args.dry_run else ("llama3-8b", PREFIX, TREE_SIZES)
    target = random_target(shape, torch.bfloat16, device.type)
    weight_bytes = sum(p.numel() * p.element_size() for n, p in target.named_parameters() if "embed" not in n)
    g = torch.Generator(device=device).manual_seed(1)
    cache = target.new_cache(1, prefix + max(sizes))
    prompt = torch.randint(0, target.config.vocab_size, (1, prefix), generator=g, device=device)
    with torch.no_grad():
        target(prompt, cache, last_logits_only=True)
    cache.commit(prefix)
    one = {}
    for T in sizes:
        parents = torch.tensor([[-1] + [(i - 1) // 3 for i in range(1, T)]])  # a 3-ary tree
        depths = torch.zeros(1, T, dtype=torch.int64)
        for i in range(1, T):
            depths[0, i] = depths[0, parents[0, i]] + 1
        mask, depths = ops.build_tree_mask(parents).to(device), depths.to(device)
        tokens = torch.randint(0, target.config.vocab_size, (1, T), generator=g, device=device)
        row = dict(part="forward", shape=shape, rows=T, prefix=prefix)
        for arm, switch in (("ours", contextlib.nullcontext), ("cuda_cores", cuda_cores)):
            with switch(), torch.no_grad():
                ms = timeit(lambda: target(tokens, cache, mask, depths), args.reps)["median_ms"]
            one.setdefault(arm, ms)
            row[f"{arm}_us"] = ms * 1e3
            row[f"{arm}_over_one_token"] = ms / one[arm]
            gbs = weight_bytes / (ms * 1e-3) / 1e9
            row[f"{arm}_gbs"] = gbs
            row[f"{arm}_of_copy_bandwidth"] = gbs / copy_gbs
            row[f"{arm}_of_rated_hbm"] = gbs / rated_gbs if rated_gbs else float("nan")
        rows_out.append(row)
        print(f"forward {shape} T={T:2d}: tensor cores {row['ours_us'] / 1e3:7.2f} ms ({row['ours_over_one_token']:.2f}x "
              f"one token; weights at {row['ours_of_rated_hbm']:.0%} of rated HBM), CUDA cores "
              f"{row['cuda_cores_us'] / 1e3:7.2f} ms ({row['cuda_cores_over_one_token']:.2f}x)", flush=True)


def tree_attention_costs(args, rows_out: list) -> None:
    device, dtype = args.device, torch.bfloat16
    Hq, Hkv, D, prefixes, sizes = (4, 2, 16, (16, 40), (1, 4, 8)) if args.dry_run else (32, 8, 128, (512, 4096), (1, 16, 64))
    g = torch.Generator(device=device).manual_seed(2)
    for prefix in prefixes:
        capacity = prefix + max(sizes)
        k, v = (torch.randn(1, Hkv, capacity, D, generator=g, device=device).to(dtype) for _ in range(2))
        for T in sizes:
            parents = torch.tensor([[-1] + [(i - 1) // 3 for i in range(1, T)]])  # a 3-ary tree
            mask = ops.build_tree_mask(parents).to(device)
            q = torch.randn(1, T, Hq, D, generator=g, device=device).to(dtype)
            lens = torch.tensor([prefix], device=device)
            even = max(1, (prefix + T) // 256)
            # SDPA's dense mask: every query row sees the prefix and its tree row's ancestors.
            seen = torch.zeros(T, capacity, dtype=torch.bool, device=device)
            seen[:, :prefix] = True
            seen[:, prefix:prefix + T] = reference.unpack_tree_mask(mask, T)[0].to(device)
            kq, vq = (x.repeat_interleave(Hq // Hkv, dim=1) for x in (k, v))
            arms = {"fixed_splits": lambda: ops.tree_attention(q, k, v, lens, mask),
                    "even_parts": lambda: ops.tree_attention(q, k, v, lens, mask, num_splits=even),
                    "sdpa": lambda: F.scaled_dot_product_attention(q.transpose(1, 2), kq, vq, attn_mask=seen)}
            row = dict(part="attention", shape=f"{Hq}q {Hkv}kv {D}d", rows=T, prefix=prefix, even_splits=even)
            for arm, fn in arms.items():
                row[f"{arm}_us"] = timeit(fn, args.reps)["median_ms"] * 1e3
            with cuda_cores():
                row["fixed_splits_cuda_cores_us"] = timeit(arms["fixed_splits"], args.reps)["median_ms"] * 1e3
            rows_out.append(row)
            print(f"attention prefix {prefix:5d} T={T:2d}: fixed splits {row['fixed_splits_us']:7.1f} us (CUDA cores "
                  f"{row['fixed_splits_cuda_cores_us']:7.1f}), even parts {row['even_parts_us']:7.1f} us, "
                  f"SDPA {row['sdpa_us']:7.1f} us", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--parts", nargs="+", default=["linear", "forward", "attention", "blocks"],
                    choices=["linear", "forward", "attention", "blocks"])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes, two repetitions (checks the script)")
    ap.add_argument("--out", default="tensor_cores.csv")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device")
    if args.dry_run:
        args.reps = 2
    args.device = common.DEVICE = torch.device(args.device)
    copy_gbs = memory_bandwidth_gbs(torch.get_num_threads())
    rated = peak_hbm_gbs() if args.device.type == "cuda" else 0.0
    device_name = torch.cuda.get_device_name() if args.device.type == "cuda" else "cpu"
    print(f"{device_name}: copy bandwidth {copy_gbs:.0f} GB/s, rated HBM {rated:.0f} GB/s", flush=True)
    rows = []
    if "linear" in args.parts:
        linear_rows(args, rows, copy_gbs, rated)
    if "forward" in args.parts:
        tree_forwards(args, rows, copy_gbs, rated)
    if "attention" in args.parts:
        tree_attention_costs(args, rows)
    if "blocks" in args.parts:
        block_targets(args, rows, copy_gbs, rated)
    for r in rows:
        r.update(device=device_name, copy_gbs=copy_gbs, rated_hbm_gbs=rated)
    fields = []
    for r in rows:
        fields += [k for k in r if k not in fields]
    write_csv(args.out, rows, fieldnames=fields)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
