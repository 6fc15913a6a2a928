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

A capture also reads tensors made before it and kept elsewhere (weights, KV caches, rotary
tables, masks kept per shape): its *externals*, found while it is made (every tensor an op of
it reads that no op of it made). It holds them weakly, as a CUDA graph holds their addresses: one
let go (a rotary table made again larger, a mask dropped from its cache, a cache grown) makes
the capture stale, and it is made again rather than replayed (a graph would read freed memory).
A :class:`Replay` keeps a bounded number of captures (KEPT_CAPTURES for each tree a call may run:
the live choice captures each of its candidates), the least recently used let go.
"""
from __future__ import annotations

import sys
import weakref
from collections import Counter, OrderedDict
from typing import Any, Callable, Hashable, List, Sequence, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

MODES = ("cuda", "recorded")
KEPT_CAPTURES = 8  # captures a Replay keeps per tree it may run (batch sizes, cache buffers), the least recently used let go


class _Recorder(TorchDispatchMode):
    """Watches every op dispatched while active: finds the tensors the ops read that none of them
    made and that are not ``inputs`` (``externals``, held here, in the order first read) and, with
    ``keep``, records each op: (op, args, kwargs, output), which keeps the recorded tensors alive,
    so their ids stay theirs while the record lives."""

    def __init__(self, inputs: Sequence[torch.Tensor] = (), keep: bool = True):
        super().__init__()
        self.calls, self.keep = [], keep
        self.externals: List[torch.Tensor] = []
        # Ids of the inputs, outputs and externals so far. An output's id may be taken again once
        # it is freed (keep=False), but only by a tensor made during the call, never by an external.
        self._seen = {id(t) for t in inputs}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for x in tree_flatten((args, kwargs))[0]:
            if isinstance(x, torch.Tensor) and id(x) not in self._seen:
                self._seen.add(id(x))
                self.externals.append(x)
        out = func(*args, **kwargs)
        self._seen.update(id(t) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
        if self.keep:
            self.calls.append((func, args, kwargs, out))
        return out

    def held_elsewhere(self) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        """The externals split in two: those something besides this recorder holds (an owner: a
        model, a cache, a table kept per shape, that may let them go), and those the call made
        itself outside the dispatcher (a scalar wrapped as a tensor, a host tensor), which the
        capture keeps (a CUDA graph baked their addresses in). Told apart by their references; a
        wrong call keeps an owned one alive with the capture, which costs memory, not results."""
        ours = Counter(id(t) for call in self.calls for t in tree_flatten(call)[0] if isinstance(t, torch.Tensor))
        owned = [sys.getrefcount(t) > _OWN_REFERENCES + ours[id(t)] for t in self.externals]
        return ([t for t, o in zip(self.externals, owned) if o], [t for t, o in zip(self.externals, owned) if not o])


def _own_references() -> int:
    """What ``sys.getrefcount`` counts, in :meth:`_Recorder.held_elsewhere`'s comprehension, for
    a tensor nothing else holds (3 on CPython 3.10-3.13: the list's slot, the loop's name and the
    call's argument; the interpreter decides, so it is measured)."""
    alone = [torch.empty(0)]
    return [sys.getrefcount(t) for t in alone][0]


_OWN_REFERENCES = _own_references()


class _Capture:
    """A captured call: ``first`` (the result of the call that captured it), ``host`` (its host
    value), and whether it is ``stale``: an external tensor it reads was let go (a CUDA graph
    would read freed memory), so it must be captured again, not replayed."""

    def watch(self, externals: Sequence[torch.Tensor]) -> None:
        flag = self._flag = [False]  # (set by the callbacks, which hold it, not the capture: no cycle)
        self._refs = [weakref.ref(t, lambda _ref: flag.__setitem__(0, True)) for t in externals]

    @property
    def stale(self) -> bool:
        return self._flag[0]


class _External:
    """An external tensor of a recorded call held weakly, as a CUDA graph holds its address."""

    def __init__(self, ref: weakref.ref):
        self.ref = ref


class _Recorded(_Capture):
    """A recorded call: replays its ops on the same static inputs and long-lived tensors (weights,
    caches), each intermediate replaced by its new value. ``first``: the recorded run's outputs."""

    def __init__(self, fn: Callable, inputs: Sequence[Any]):
        recorder = _Recorder([x for x in tree_flatten(list(inputs))[0] if isinstance(x, torch.Tensor)])
        with recorder:
            self.outputs, self.host = fn(*inputs)
        watched, _ = recorder.held_elsewhere()  # (the others: held by the recorded calls)
        weak = {id(t): _External(weakref.ref(t)) for t in watched}
        self.calls = [tree_map(lambda x: weak.get(id(x), x) if isinstance(x, torch.Tensor) else x, call)
                      for call in recorder.calls]
        self.watch(watched)
        self.first = tuple(self.outputs)

    def replay(self):
        new = {}  # id of a captured intermediate -> its value in this replay

        def current(x):
            if isinstance(x, _External):
                return x.ref()  # (alive: a stale capture is not replayed)
            return new.get(id(x), x) if isinstance(x, torch.Tensor) else x
        for func, args, kwargs, out in self.calls:
            result = func(*tree_map(current, args), **tree_map(current, kwargs))
            for old, value in zip(tree_flatten(out)[0], tree_flatten(result)[0]):
                if isinstance(old, torch.Tensor):  # (an op's output that is an external: itself, in place)
                    new[id(old)] = value
        return tuple(tree_map(current, self.outputs))  # (a pytree: each tensor its new value)


class _CudaGraph(_Capture):
    """A call captured as a CUDA graph: its outputs are static tensors, rewritten by each replay.
    ``first``: the outputs of the eager warm-up run (a capture runs nothing), this call's result:
    the call's effects happen once, so the device's error word is read (and cleared) once."""

    def __init__(self, fn: Callable, inputs: Sequence[Any]):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: lazy allocations, handles and tables outside the capture
            self.first = tuple(fn(*inputs)[0])
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        # The ops are watched while captured (not in the warm-up, whose lazily made tables the
        # capture reads as made before it) for the externals the graph reads.
        finder = _Recorder([x for x in tree_flatten(list(inputs))[0] if isinstance(x, torch.Tensor)], keep=False)
        # A pool of its own: capturing into the pool of a graph already freed trips the caching
        # allocator's assertion (use_count > 0), as a re-capture for a new key would.
        with torch.cuda.graph(self.graph, pool=torch.cuda.graph_pool_handle()), finder:
            self.outputs, self.host = fn(*inputs)
        watched, self.own = finder.held_elsewhere()
        self.watch(watched)

    def replay(self):
        self.graph.replay()
        return tuple(self.outputs)


def _stored(x) -> bool:
    """Whether a constant says what it holds (``storage_key()``: a KV cache's buffers)."""
    return callable(getattr(x, "storage_key", None))


def _constant_key(x) -> Hashable:
    """A constant's part of a capture's key: what it holds where it says (a cache made of the same
    buffers finds the capture), else its id."""
    return x.storage_key() if _stored(x) else id(x)


class Replay:
    """``fn(*inputs) -> (tuple of outputs, host value)`` captured for a key and replayed (an output:
    a tensor, None or a named tuple of them):
    ``inputs`` are pytrees (tuples, named tuples, lists, None) whose tensors are copied into the
    capture's static buffers on each call and whose other leaves (objects: caches, a drafter) are
    constants of the capture, part of its key with ``key`` (:func:`_constant_key`). Returns the
    outputs (static: valid until the capture's next replay) and the host value the capture returned (e.g. how
    many forwards it ran).
    A new key captures anew; up to ``most`` captures are kept (the least recently used let
    go first), a stale one (an external let go) is let go when found."""

    def __init__(self, fn: Callable[..., Tuple[Tuple[torch.Tensor, ...], Any]], mode: str, most: int = KEPT_CAPTURES):
        if mode not in MODES:
            raise ValueError(f"graph mode must be one of {MODES}, got {mode!r}")
        if mode == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("CUDA graphs need a CUDA device; none is available")
        # A method held weakly (its object, a round, owns this replay: no cycle to wait for the
        # cycle collector with the target's weights), another function as it is.
        self._fn = weakref.WeakMethod(fn) if hasattr(fn, "__self__") else (lambda: fn)
        self.mode, self.most = mode, most
        self.kept: "OrderedDict[Hashable, _Capture]" = OrderedDict()  # key -> capture, least recently used first
        self.captures = 0  # how many times it captured (tests, statistics)

    def __call__(self, key: Hashable, inputs: Sequence[Any]):
        leaves, spec = tree_flatten(list(inputs))
        constants = tuple(_constant_key(x) for x in leaves if not isinstance(x, torch.Tensor))
        key = (key, spec, constants)
        for stale in [k for k, c in self.kept.items() if c.stale]:
            del self.kept[stale]
        captured = self.kept.get(key)
        if captured is None:
            while len(self.kept) >= self.most:  # (frees the old captures' memory first)
                self.kept.popitem(last=False)
            static = [x.clone() if isinstance(x, torch.Tensor) else x for x in leaves]
            made = _CudaGraph if self.mode == "cuda" else _Recorded
            captured = self.kept[key] = made(self._fn(), tree_unflatten(static, spec))
            # Kept with it: the input buffers and the constants keyed by their ids (so the ids stay
            # theirs), not a cache (its buffers are externals, watched: kept, they would never go).
            captured.static = [None if _stored(x) else x for x in static]
            self.captures += 1
            first, captured.first = captured.first, None  # (the call's result, not kept)
            return first, captured.host
        self.kept.move_to_end(key)
        for buffer, value in zip(captured.static, leaves):
            if isinstance(value, torch.Tensor):
                buffer.copy_(value)
        return captured.replay(), captured.host
