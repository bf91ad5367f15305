"""A replica's running and waiting requests as columns (numpy arrays of the ``RunningRequest``
fields) for policies that read them whole (Aladdin's per-worker view), built without a
``RunningRequest`` each; the objects are still given where a policy iterates them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Callable, NamedTuple

import numpy as np

from hetserve.policies.base import RunningRequest
from hetserve.sim.replicas.base import LazyRequests


class Columns(NamedTuple):
    """A replica's per-request views as columns (the ``RunningRequest`` fields, in the same order)."""

    ids: list[int] | tuple[()]
    l_in: np.ndarray  # float
    gen: np.ndarray  # float
    pred: np.ndarray
    started: np.ndarray  # bool
    dec_time: np.ndarray


def _fixed(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


NONE = Columns((), *(_fixed(np.zeros(0, t)) for t in (float, float, float, bool, float)))  # no requests


def columns(ids: list[int], inp: list[int], gens: list[int], preds: list[float], t_join: list[float],
            now: float, started: int) -> Columns:
    """``Columns`` of ``ids`` (the first ``started`` of them running, the rest waiting), with
    ``decode_time_s`` as ``_requests`` gives it: now − joined, 0 where never joined (NaN)."""
    n = len(ids)
    if not n:
        return NONE
    dec = now - np.array([t_join[i] for i in ids], float)
    rest = dec[started:]
    rest[rest != rest] = 0.0
    return Columns(ids, np.array([inp[i] for i in ids], float), np.array(gens, float), np.array(preds, float),
                   np.arange(n) < started, dec)


class RequestColumns(LazyRequests):
    """``LazyRequests`` that also gives the views as ``Columns`` (``columns()``), built without a
    ``RunningRequest`` each: Aladdin reads them so (``AladdinConstraints._view``). Like the views,
    the columns describe the moment of the decision and must be read during it."""

    __slots__ = ("_cols", "_cols_build")

    def __init__(self, build: Callable[[], tuple[RunningRequest, ...]], cols: Callable[[], Columns], loop):
        # ``LazyRequests.__init__`` written out: one is built per replica at every decision
        self._build, self._loop, self._stamp = build, loop, loop.events
        self._items: tuple[RunningRequest, ...] | None = None
        self._cols_build = cols
        self._cols: Columns | None = None

    def columns(self) -> Columns:
        if self._cols is None:
            if self._loop.events != self._stamp:
                raise RuntimeError("a snapshot's request columns were first read after its decision")
            self._cols = self._cols_build()
        return self._cols


class KeptColumns(Sequence):
    """Views taken as ``Columns`` when the snapshot was (read at any time later): the
    ``RunningRequest`` objects are built from them on first access."""

    __slots__ = ("_cols", "_items")

    def __init__(self, cols: Columns):
        self._cols = cols
        self._items: tuple[RunningRequest, ...] | None = None

    def columns(self) -> Columns:
        return self._cols

    def _get(self) -> tuple[RunningRequest, ...]:
        if self._items is None:
            c = self._cols
            self._items = tuple(RunningRequest(i, int(n), int(g), p, d, s) for i, n, g, p, d, s in zip(
                c.ids, c.l_in.tolist(), c.gen.tolist(), c.pred.tolist(), c.dec_time.tolist(), c.started.tolist()))
        return self._items

    def __getitem__(self, i):
        return self._get()[i]

    def __len__(self) -> int:
        return len(self._cols.ids)

    def __iter__(self):
        return iter(self._get())
