"""Named parts of a training step for the profiler (``benchmarks/bench_train_step.py``).

``scope(name)`` marks a part of the forward pass; the profiler attributes each part's
backward to it through the autograd sequence numbers of its forward ops. Outside a profiler
run a scope costs a few microseconds."""
from __future__ import annotations

from torch.profiler import record_function

PREFIX = "part: "


def scope(name: str) -> record_function:
    """A profiler range named ``part: <name>``."""
    return record_function(PREFIX + name)
