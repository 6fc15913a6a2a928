"""Counting the host's reads of device values (on a GPU each is a synchronisation that stalls
the launch queue): a debugging aid, used by ``benchmarks/host_syncs.py`` and by the test that
holds a decoding round to one read. Works on any device, the CPU included, by intercepting scalar
reads (``.item()``, ``bool()``, ``int()``, ``float()`` of a tensor: ``aten._local_scalar_dense``),
ops whose output size depends on values (``nonzero``, ``masked_select``, ``unique``, ``equal``,
``bincount``, ``repeat_interleave`` without ``output_size``, indexing with a boolean mask: ``x[mask]``
and ``x[mask] = v``), copies from a device to the host, and ``tolist()`` / ``numpy()``.
"""
import collections
import contextlib

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from jakiro_ext.engine.batch import ROUND_LISTENERS

aten = torch.ops.aten
# (In inference mode, as the decoding rounds run, ``.item()`` and ``bool()`` reach a dispatch mode
# as ``aten.item`` and ``aten.is_nonzero``; outside it, both as ``aten._local_scalar_dense``.)
VALUE_READS = {aten._local_scalar_dense.default: "scalar", aten.item.default: "scalar",
               aten.is_nonzero.default: "scalar", aten.nonzero.default: "nonzero",
               aten.masked_select.default: "masked_select", aten.equal.default: "equal",
               aten._unique2.default: "unique", aten.unique_consecutive.default: "unique"}


class HostReads(TorchDispatchMode):
    """Counts the reads of tensor values by the host while active: ``counts[where, kind]``, where
    ``where`` is what the reader set (:func:`counted_rounds` sets "round" inside a round)."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()
        self.where = "start"  # or "round"
        self.in_method = 0  # inside tolist() / numpy(), already counted: its own copy to the host is not

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kind = VALUE_READS.get(func) or _value_dependent(func, args, kwargs or {})
        if kind and not self.in_method:
            self.counts[self.where, kind] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        self._methods = _MethodReads(self)  # tolist() / numpy() read before any dispatch
        self._methods.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._methods.__exit__(*exc)


class _MethodReads(TorchFunctionMode):
    """Counts ``Tensor.tolist()`` and ``Tensor.numpy()`` for a :class:`HostReads`: they read the
    values without dispatching an op, but a function mode sees every Tensor method called."""

    def __init__(self, reads: HostReads):
        super().__init__()
        self.reads = reads

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name not in ("tolist", "numpy"):
            return func(*args, **(kwargs or {}))
        # One read: on a GPU, tolist() copies the tensor to the host through a dispatched op,
        # which must not count as a second.
        self.reads.counts[self.reads.where, name] += 1
        self.reads.in_method += 1
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.reads.in_method -= 1


def _value_dependent(func, args, kwargs) -> str:
    """The kind of read an op makes only for some arguments ("" for none): a boolean-mask index
    (its positions are read to size the result), ``repeat_interleave`` of a repeats tensor without
    ``output_size``, ``bincount`` (sized by the largest value), a copy from a device to the host."""
    if func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default):
        if any(t is not None and t.dtype in (torch.bool, torch.uint8) for t in args[1]):
            return "boolean index"
    elif func is aten.repeat_interleave.Tensor:
        if kwargs.get("output_size") is None:
            return "repeat_interleave"
    elif func is aten.bincount.default:
        return "bincount"
    elif func in (aten._to_copy.default, aten.copy_.default):
        src, dst = (args[0], kwargs.get("device")) if func is aten._to_copy.default else (args[1], args[0].device)
        if dst is not None and torch.device(dst).type == "cpu" and src.device.type != "cpu":
            return "copy to host"
    return ""


@contextlib.contextmanager
def counted_rounds(reads: HostReads):
    """Marks the reads made inside ``DecodeBatch.round``; yields [number of rounds]."""
    rounds = [0]

    def listen(starting: bool) -> None:
        rounds[0] += starting
        reads.where = "round" if starting else "start"
    ROUND_LISTENERS.append(listen)
    try:
        yield rounds
    finally:
        ROUND_LISTENERS.remove(listen)
