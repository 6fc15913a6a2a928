"""Shared pieces of the kernel microbenchmarks: timing, the machine's memory bandwidth,
correctness diffs, CSV output.

Every benchmark runs on the CPU (default) or, with ``--device cuda``, on a GPU: then the ops
run their CUDA kernels, times come from CUDA events around each call, and the bandwidth is the
GPU's measured device-to-device copy rate, next to its rated HBM bandwidth (``PEAK_HBM_GBS``)."""
from __future__ import annotations

import argparse
import csv
import os
import statistics
import time
from typing import Callable, Dict, List

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
# Where the benchmarks start `python -m jakiro_ext`: from a checkout's root it would import the
# source tree (without the compiled library) instead of the installed package.
CLI_CWD = HERE
DEVICE = torch.device("cpu")  # set by parse_args

# Rated HBM bandwidth (GB/s) of the GPUs the targets are stated for (SXM parts).
PEAK_HBM_GBS = {"H100": 3350.0, "H200": 4800.0, "A100": 2039.0, "MI250": 3277.0}


def parse_args(description: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch intra-op threads")
    p.add_argument("--reps", type=int, default=30, help="timed repetitions per measurement")
    p.add_argument("--quick", action="store_true", help="fewer shapes and repetitions (a smoke run)")
    p.add_argument("--out", default=None, help="CSV path (default benchmarks/results/<script>[_cuda].csv)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the ops run")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.quick:
        args.reps = 5
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device")
    global DEVICE
    DEVICE = args.device = torch.device(args.device)
    return args


def on_device(*tensors):
    """The benchmark's inputs, built on the CPU (same values everywhere), moved to DEVICE."""
    moved = tuple(t.to(DEVICE) for t in tensors)
    return moved[0] if len(moved) == 1 else moved


def peak_hbm_gbs() -> float:
    """Rated HBM bandwidth of the current GPU (0 when unknown)."""
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_HBM_GBS.items() if k in name), 0.0)


def timeit(fn: Callable[[], object], reps: int, warmup: int = 3, max_seconds: float = 20.0) -> Dict[str, float]:
    """Median and 20/80 % quantiles of the time of fn(), in milliseconds: wall time on the CPU,
    CUDA events around each call on a GPU."""
    for _ in range(warmup):
        fn()
    cuda = DEVICE.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    times: List[float] = []
    deadline = time.perf_counter() + max_seconds
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        if time.perf_counter() > deadline and len(times) >= 3:
            break
    q = statistics.quantiles(times, n=5, method="inclusive") if len(times) >= 2 else times * 4  # (exclusive extrapolates)
    return {"median_ms": statistics.median(times), "p20_ms": q[0], "p80_ms": q[3], "reps": len(times)}


_BANDWIDTH: Dict[int, float] = {}


def memory_bandwidth_gbs(threads: int, fresh: bool = False) -> float:
    """Measured read bandwidth (GB/s) of this machine with `threads` torch threads: the median
    time of summing a 512 MiB float32 tensor (far beyond the caches). On a GPU: bytes read and
    written by a 1 GiB device-to-device copy. Measured once per process unless ``fresh``."""
    if DEVICE.type == "cuda":
        if -1 not in _BANDWIDTH:
            src = torch.empty(2**30, dtype=torch.uint8, device=DEVICE)
            dst = torch.empty_like(src)
            t = timeit(lambda: dst.copy_(src), reps=20, warmup=3)
            _BANDWIDTH[-1] = 2 * src.numel() / (t["median_ms"] * 1e-3) / 1e9
        return _BANDWIDTH[-1]
    if fresh or threads not in _BANDWIDTH:
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
    if DEVICE.type == "cuda":
        return f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    from jakiro_ext.machine import cpu_name

    return f"{cpu_name()}, {os.cpu_count()} cpus, torch {torch.__version__}"


class Table:
    """Rows printed as they come and written to CSV at the end."""

    def __init__(self, name: str, args: argparse.Namespace):
        suffix = "_cuda" if DEVICE.type == "cuda" else ""
        self.path = args.out or os.path.join(RESULTS, f"{name}{suffix}.csv")
        self.rows: List[Dict[str, object]] = []
        if DEVICE.type == "cuda":
            print(f"# {name}: {machine()}, copy bandwidth {memory_bandwidth_gbs(0):.0f} GB/s, "
                  f"rated HBM {peak_hbm_gbs():.0f} GB/s")
        else:
            print(f"# {name}: {machine()}, threads={args.threads}, "
                  f"read bandwidth {memory_bandwidth_gbs(args.threads):.1f} GB/s")

    def add(self, **row):
        self.rows.append(row)
        print("  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)

    def save(self):
        write_csv(self.path, self.rows, list(dict.fromkeys(k for r in self.rows for k in r)))
        print(f"wrote {self.path}")


def write_csv(path: str, rows: List[Dict[str, object]], fieldnames=None, **options) -> None:
    """A results table, written atomically (a kill leaves the previous one whole). Its columns: every
    key of any row, in order of appearance (a row without one leaves it empty)."""
    from jakiro_ext import atomic

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def write(tmp):
        with open(tmp, "w", newline="") as f:
            columns = fieldnames or list(dict.fromkeys(k for row in rows for k in row))
            w = csv.DictWriter(f, fieldnames=columns, **{"restval": "", **options})
            w.writeheader()
            w.writerows(rows)
    atomic.write_file(path, write)


def save_figure(fig, path: str, **options) -> None:
    """A figure (PNG), written atomically."""
    from jakiro_ext import atomic

    atomic.write_file(path, lambda tmp: fig.savefig(tmp, format="png", **options))
