"""What a graphed call keeps for the next (``graphs="cuda"`` or ``"recorded"``): its round's
captures, its drafters and its KV caches' buffers.

A round is captured per batch size and cache buffer (:class:`~jakiro_ext.engine.graphs.Replay`):
a call that made its own would capture again every time, a warm-up and a capture for each batch
size it runs and each growth of its caches. So a graphed call takes the :class:`GraphSession`
kept with the target for what it runs (the head, the method, the trees, the batch size and the
sampling settings) and leaves it to the next such call: its drafters and its round (the replay
and its captures, and the prepared weights they read), and a pool of the caches' buffers by shape
(:class:`~jakiro_ext.kv_cache.BufferPool`), so the next call's caches are made of the buffers
the captures were made on, and its rounds replay them.

A session is found by what its rounds run (the kernels' backend and ``JAKIRO_*`` switches
included) and by what its captures read that may change between calls: where the target's and
the head's weights are, and where the copies the engine reads of them are (a weight replaced, or
changed where the engine reads a copy, is another session, and the session with the old weights
is let go; a weight changed in place where the engine reads it is read by a replay as by an
eager round). Whatever else a capture reads (rotary tables, masks) makes it stale when let go
(:mod:`jakiro_ext.engine.graphs`).

A session serves one call at a time (another call meanwhile makes one it does not keep). Bounded:
KEPT_SESSIONS sessions a target, the least recently used let go, each with at most KEPT_CAPTURES
captures for each tree it may run and KEPT_BUFFERS buffers; :func:`free_graphs` lets a target's go at once (else they go
with the target; a round holds the target weakly). Eager calls keep nothing.
"""
from __future__ import annotations

import os
import threading
from collections import OrderedDict
from typing import Any, Hashable, Optional, Tuple

import torch
from torch.utils._pytree import tree_flatten

from jakiro_ext import ops
from jakiro_ext.config import tree_key
from jakiro_ext.kv_cache import BufferPool

KEPT_SESSIONS = 2  # sessions kept with a target, the least recently used let go
KEPT_BUFFERS = 8  # buffers a session's pool keeps (a batch state's caches: 4), the least recently given let go


class GraphSession:
    """What graphed calls of one kind share, one call at a time: ``parts`` (what the batch made
    for its rounds: its drafters, prepared weights and round, kept as it made them; None until
    then) and ``pool`` (its caches' buffers)."""

    def __init__(self):
        self.parts: Optional[Any] = None
        self.pool = BufferPool(most=KEPT_BUFFERS)
        self.busy = False


def _where(things) -> tuple:
    """Where each tensor of the pytree ``things`` is and its shape (other leaves: their value, or
    their id for an object)."""
    return tuple((t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device) if isinstance(t, torch.Tensor)
                 else t if t is None or isinstance(t, (bool, int, float, str)) else id(t)
                 for t in tree_flatten(things)[0])


def session_key(target, draft, method, trees, settings, rows: int) -> Tuple[tuple, tuple]:
    """What a session serves: (what its rounds run: the head, the method, the trees by value, the
    rows, the settings a round reads (:class:`~jakiro_ext.engine.round.Round`), the kernels'
    backend and the ``JAKIRO_*`` switches the kernels read at launch; where the weights the rounds
    read are, :func:`_where`)."""
    weights = (target.prepare(), list(target.parameters()), list(target.buffers()))
    if draft is not None:
        weights += (draft.products(), list(draft.parameters()), list(draft.buffers()))
    switches = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("JAKIRO_")))
    runs = (id(draft), method.name, tuple(map(tree_key, trees)), rows, settings.graphs,
            settings.temperature, settings.top_p, settings.top_k, settings.keep_features, ops.backend(), switches)
    return runs, _where(weights)


class _Kept(OrderedDict):
    """A target's sessions, least recently used first. They live and die with the target, and a
    copy of it (``copy.deepcopy``, pickling) starts without them: a capture is of its buffers."""

    def __deepcopy__(self, memo) -> "_Kept":
        return _Kept()

    def __reduce__(self):
        return _Kept, ()


def _kept(target) -> "OrderedDict[Hashable, GraphSession]":
    """The sessions kept with ``target``."""
    return target.__dict__.setdefault("_graph_sessions", _Kept())


_LOCK = threading.Lock()  # (calls on several threads: a session serves one at a time)


def take(target, draft, method, trees, settings, rows: int) -> GraphSession:
    """The session for a graphed call (:func:`session_key`), kept for the next: the one kept if
    no call uses it, else a new one (kept when none is, or not kept while one is in use). A new
    one lets go those that ran the same with other weights (replaced: they would never serve)."""
    key = session_key(target, draft, method, trees, settings, rows)
    with _LOCK:
        kept = _kept(target)
        session = kept.get(key)
        if session is not None and session.busy:
            session = GraphSession()  # (another call, not finished, uses the kept one)
        elif session is None:
            for old in [k for k in kept if k[0] == key[0]]:
                del kept[old]
            session = kept[key] = GraphSession()
            for old in list(kept)[:max(0, len(kept) - KEPT_SESSIONS)]:
                del kept[old]  # (one in use stays its call's)
        else:
            kept.move_to_end(key)
        session.busy = True
    return session


def give_back(session: GraphSession) -> None:
    """The call is over: the session is free for the next."""
    with _LOCK:
        session.busy = False


def free_graphs(target) -> None:
    """Let go what graphed calls keep with ``target`` (captures, drafters, cache buffers): its
    memory is freed once no call uses it."""
    with _LOCK:
        _kept(target).clear()
