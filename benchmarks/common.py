"""Shared pieces of the kernel microbenchmarks: timing, the machine's memory bandwidth,
correctness diffs, CSV output."""
from __future__ import annotations

import argparse
import csv
import os
import platform
import statistics
import time
from typing import Callable, Dict, List

import torch

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def parse_args(description: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch intra-op threads")
    p.add_argument("--reps", type=int, default=30, help="timed repetitions per measurement")
    p.add_argument("--quick", action="store_true", help="fewer shapes and repetitions (a smoke run)")
    p.add_argument("--out", default=None, help="CSV path (default benchmarks/results/<script>.csv)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.quick:
        args.reps = 5
    return args


def timeit(fn: Callable[[], object], reps: int, warmup: int = 3, max_seconds: float = 20.0) -> Dict[str, float]:
    """Median and 20/80 % quantiles of the wall time of fn(), in milliseconds."""
    for _ in range(warmup):
        fn()
    times: List[float] = []
    deadline = time.perf_counter() + max_seconds
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
        if time.perf_counter() > deadline and len(times) >= 3:
            break
    q = statistics.quantiles(times, n=5) if len(times) >= 2 else times * 4
    return {"median_ms": statistics.median(times), "p20_ms": q[0], "p80_ms": q[3], "reps": len(times)}


_BANDWIDTH: Dict[int, float] = {}


def memory_bandwidth_gbs(threads: int) -> float:
    """Measured read bandwidth (GB/s) of this machine with `threads` torch threads: the median
    time of summing a 512 MiB float32 tensor (far beyond the caches)."""
    if threads not in _BANDWIDTH:
        x = torch.ones(128 * 2**20)
        t = timeit(lambda: x.sum(), reps=15, warmup=2)
        _BANDWIDTH[threads] = x.numel() * 4 / (t["median_ms"] * 1e-3) / 1e9
    return _BANDWIDTH[threads]


def max_abs_diff(a, b) -> float:
    if isinstance(a, (tuple, list)):
        return max(max_abs_diff(x, y) for x, y in zip(a, b))
    if not a.is_floating_point():
        return 0.0 if torch.equal(a, b) else float("inf")
    finite = torch.isfinite(b)
    return float((a.float() - b.float())[finite].abs().max()) if finite.any() else 0.0


def machine() -> str:
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cpus, torch {torch.__version__}"


class Table:
    """Rows printed as they come and written to CSV at the end."""

    def __init__(self, name: str, args: argparse.Namespace):
        self.path = args.out or os.path.join(RESULTS, f"{name}.csv")
        self.rows: List[Dict[str, object]] = []
        print(f"# {name}: {machine()}, threads={args.threads}, "
              f"read bandwidth {memory_bandwidth_gbs(args.threads):.1f} GB/s")

    def add(self, **row):
        self.rows.append(row)
        print("  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)

    def save(self):
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        keys = list(dict.fromkeys(k for r in self.rows for k in r))
        with open(self.path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(self.rows)
        print(f"wrote {self.path}")
