"""Capture once, replay many times: the decoding round's device work as a CUDA graph.

A round launches hundreds of small kernels (every op of every draft layer and of the target's
layers); on a GPU at small batch sizes launching them costs more than running them. A CUDA graph
records the launches once and replays them with one call. Its rules are what :class:`Replay`
enforces: the captured function is run once more on every replay as *recorded*, not as
written, so it must read nothing from the host (no ``.item()``/``tolist()``: the engine reads
the device once per round, after the replay), allocate its inputs nowhere but in the static
buffers given to it, and depend on the host only through values fixed for the capture (shapes,
settings), which are part of its key.

Two ways to replay, with the same rules:
- ``"cuda"``: ``torch.cuda.CUDAGraph`` (warm-up on a side stream, capture into a memory pool of
  its own, replay);
- ``"recorded"``: every op the function dispatches (aten ops and ``torch.ops.jakiro`` alike) is
  recorded with its arguments, and a replay runs the recorded ops again, on the same static
  tensors, with no Python of the function in between. It runs anywhere, the CPU included: it is
  how the tests hold the engine's captured round to the rules of a CUDA graph without a GPU (a
  host value baked into a capture that should have changed gives other tokens there too).
"""
from __future__ import annotations

from typing import Any, Callable, Hashable, Optional, Sequence, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

MODES = ("cuda", "recorded")


class _Recorder(TorchDispatchMode):
    """Records every op dispatched while active: (op, args, kwargs, output). Holding the
    arguments and outputs keeps them alive, so their ids stay theirs during a replay."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.calls.append((func, args, kwargs, out))
        return out


class _Recorded:
    """A recorded call: replays its ops on the same static inputs and long-lived tensors (weights,
    caches), each intermediate replaced by its new value. ``first``: the recorded run's outputs."""

    def __init__(self, fn: Callable, inputs: Sequence[torch.Tensor]):
        recorder = _Recorder()
        with recorder:
            self.outputs, self.host = fn(*inputs)
        self.calls = recorder.calls
        self.first = tuple(self.outputs)

    def replay(self):
        new = {}  # id of a captured intermediate -> its value in this replay

        def current(x):
            return new.get(id(x), x) if isinstance(x, torch.Tensor) else x
        for func, args, kwargs, out in self.calls:
            result = func(*tree_map(current, args), **tree_map(current, kwargs))
            for old, value in zip(tree_flatten(out)[0], tree_flatten(result)[0]):
                if isinstance(old, torch.Tensor):
                    new[id(old)] = value
        return tuple(current(t) for t in self.outputs)


class _CudaGraph:
    """A call captured as a CUDA graph: its outputs are static tensors, rewritten by each replay.
    ``first``: the outputs of the eager warm-up run (a capture runs nothing), this call's result:
    the call's effects happen once, so the device's error word is read (and cleared) once."""

    def __init__(self, fn: Callable, inputs: Sequence[torch.Tensor]):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: lazy allocations, handles and tables outside the capture
            self.first = tuple(fn(*inputs)[0])
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        # A pool of its own: capturing into the pool of a graph already freed trips the caching
        # allocator's assertion (use_count > 0), as a re-capture for a new key would.
        with torch.cuda.graph(self.graph, pool=torch.cuda.graph_pool_handle()):
            self.outputs, self.host = fn(*inputs)

    def replay(self):
        self.graph.replay()
        return tuple(self.outputs)


class Replay:
    """``fn(*inputs) -> (tuple of output tensors, host value)`` captured for a key and replayed:
    ``inputs`` are pytrees (tuples, named tuples, lists, None) whose tensors are copied into the
    capture's static buffers on each call and whose other leaves (objects: caches, a drafter) are
    constants of the capture, part of its key with ``key``. Returns the outputs (static: valid
    until the next call) and the host value the capture returned (e.g. how many forwards it ran).
    A new key captures anew and drops the old capture (what it pointed to may be gone: a grown
    cache, another batch)."""

    def __init__(self, fn: Callable[..., Tuple[Tuple[torch.Tensor, ...], Any]], mode: str):
        if mode not in MODES:
            raise ValueError(f"graph mode must be one of {MODES}, got {mode!r}")
        if mode == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("CUDA graphs need a CUDA device; none is available")
        self.fn, self.mode = fn, mode
        self.key: Optional[Hashable] = None
        self.static: Tuple[Any, ...] = ()
        self.captured = None
        self.captures = 0  # how many times it captured (tests, statistics)

    def __call__(self, key: Hashable, inputs: Sequence[Any]):
        leaves, spec = tree_flatten(list(inputs))
        constants = tuple(id(x) for x in leaves if not isinstance(x, torch.Tensor))
        key = (key, spec, constants)
        if key != self.key or self.captured is None:
            self.captured = None  # (frees the old capture's memory first)
            # (the constants themselves are kept here: their ids in the key stay theirs)
            self.static = tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in leaves)
            static = tree_unflatten(list(self.static), spec)
            self.captured = (_CudaGraph(self.fn, static) if self.mode == "cuda" else _Recorded(self.fn, static))
            self.key = key
            self.captures += 1
            return self.captured.first, self.captured.host
        for buffer, value in zip(self.static, leaves):
            if isinstance(value, torch.Tensor):
                buffer.copy_(value)
        return self.captured.replay(), self.captured.host
