"""Counting the host's reads of device values (on a GPU each is a synchronisation that stalls
the launch queue): a debugging aid, used by ``benchmarks/host_syncs.py`` and by the test that
holds a decoding round to one read. Works on any device, the CPU included, by intercepting scalar
reads (``.item()``, ``bool()``, ``int()``, ``float()`` of a tensor: ``aten._local_scalar_dense``),
ops whose output size depends on values (``nonzero``, ``masked_select``, ``unique``, ``equal``),
and ``tolist()`` / ``numpy()``.
"""
import collections
import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from jakiro_ext.engine import _Batch

aten = torch.ops.aten
VALUE_READS = {aten._local_scalar_dense.default: "scalar", aten.nonzero.default: "nonzero",
               aten.masked_select.default: "masked_select", aten.equal.default: "equal",
               aten._unique2.default: "unique", aten.unique_consecutive.default: "unique"}


class HostReads(TorchDispatchMode):
    """Counts the reads of tensor values by the host while active: ``counts[where, kind]``, where
    ``where`` is what the reader set (:func:`counted_rounds` sets "round" inside a round)."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()
        self.where = "start"  # or "round"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kind = VALUE_READS.get(func)
        if kind:
            self.counts[self.where, kind] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        self._saved = torch.Tensor.tolist, torch.Tensor.numpy
        for name, original in zip(("tolist", "numpy"), self._saved):
            def counted(tensor, *a, _original=original, _name=name, **k):
                self.counts[self.where, _name] += 1
                return _original(tensor, *a, **k)
            setattr(torch.Tensor, name, counted)
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist, torch.Tensor.numpy = self._saved
        return super().__exit__(*exc)


@contextlib.contextmanager
def counted_rounds(reads: HostReads):
    """Marks the reads made inside ``_Batch.round``; yields [number of rounds]."""
    original, rounds = _Batch.round, [0]

    def round_(batch):
        rounds[0] += 1
        reads.where = "round"
        try:
            return original(batch)
        finally:
            reads.where = "start"
    _Batch.round = round_
    try:
        yield rounds
    finally:
        _Batch.round = original
