"""Placement snapshots of many replicas, kept between decisions (``SnapshotCache``), and the
event loop as one replica uses it (``ReplicaClock``), which tells the cache whose state changed.

A replica kind opts in with ``snapshots_kept`` and says, through ``snapshot_clock()``, how its
snapshot depends on the clock: ``KEEP`` (not at all: it holds until the replica changes), a
function bringing a kept one up to now (it may hand back the very snapshot it got: then that
function stays filed with it; made by ``held_until``, it is not asked before a time it names), or
None (build it again)."""

from __future__ import annotations

import heapq
import itertools
from typing import Any, Callable, Sequence

from hetserve.policies.base import ReplicaState


class ReplicaClock:
    """The event loop as one replica uses it: the same clock and queue, and each event the replica
    schedules marks it changed (``watch``) when handled, so ``SnapshotCache`` knows whose snapshot
    to look at again without asking every replica."""

    __slots__ = ("loop", "_dirty", "_key")

    def __init__(self, loop):
        self.loop = loop
        self._dirty: set[int] | None = None
        self._key = 0

    @property
    def now(self) -> float:
        return self.loop.now

    @property
    def events(self) -> int:
        return self.loop.events

    def watch(self, dirty: set[int], key: int) -> None:
        """From now on, each event of this replica adds ``key`` to ``dirty`` before it is handled."""
        self._dirty, self._key = dirty, key

    def schedule(self, time: float, priority: int, handler: Callable[[Any], None], arg: Any = None) -> None:
        self.loop.schedule(time, priority, self._handle, (handler, arg))

    def _handle(self, item: tuple[Callable[[Any], None], Any]) -> None:
        if self._dirty is not None:
            self._dirty.add(self._key)
        item[0](item[1])


def KEEP(snap: ReplicaState) -> ReplicaState:
    """(Marker) the snapshot holds until the replica changes."""
    return snap


def with_wait(snap: ReplicaState, wait: float) -> ReplicaState:
    """``snap`` with its ``prefill_wait_s`` set (a copy, without a pass through every field)."""
    new = object.__new__(ReplicaState)
    new.__dict__.update(snap.__dict__)
    new.__dict__["prefill_wait_s"] = wait
    return new


def held_until(until: float, retime: Callable[[ReplicaState], ReplicaState]) -> Callable[[ReplicaState], ReplicaState]:
    """``retime``, marked as handing back the snapshot it gets at every time before ``until``:
    ``SnapshotCache`` does not ask it before then (a fleet's arrivals would ask every replica)."""
    retime.until = until  # type: ignore[attr-defined]
    return retime


class SnapshotCache:
    """The placement snapshots of ``replicas`` (aggregates only, no request views), each built
    again only where it may differ from the one kept: the replica changed (one of its own events
    was handled, or the caller ``touch``-ed it after calling into it), or the kept one reads the
    clock (``snapshot_clock``). A kind without ``snapshots_kept`` is built at every decision, so
    every snapshot equals what ``state()`` gives now — but for ``prefill_wait_s`` and
    ``queued_age_s`` when ``waits`` is False (the placement policy does not read them)."""

    def __init__(self, replicas: Sequence, waits: bool = True):  # sim.replicas.base.Replica objects
        self._waits = waits
        self._reps = list(replicas)
        self._snaps: list[ReplicaState | None] = [None] * len(self._reps)
        self._pos = {rep.index: i for i, rep in enumerate(self._reps)}
        self._dirty: set[int] = set(range(len(self._reps)))
        # kept snapshots that read the clock -> how to bring one up to now (None: build it again)
        self._timed: dict[int, Callable[[ReplicaState], ReplicaState] | None] = {}
        # of those, the ones asked at every decision; the others wait in ``_held`` for their time
        self._asked: dict[int, Callable[[ReplicaState], ReplicaState] | None] = {}
        self._held: list = []  # (until, seq, index, retime)
        self._seq = itertools.count()
        self._kept = [rep.snapshots_kept for rep in self._reps]
        for i, rep in enumerate(self._reps):
            if rep.snapshots_kept:
                rep.loop.watch(self._dirty, i)

    def touch(self, rep) -> None:
        """``rep`` may have changed outside its own events (a call into it)."""
        i = self._pos.get(rep.index)
        if i is not None:
            self._dirty.add(i)

    def states(self) -> list[ReplicaState]:
        """Every replica's snapshot now, in the order given."""
        reps, snaps, timed, dirty = self._reps, self._snaps, self._timed, self._dirty
        held = self._held
        if held:
            now = reps[0].loop.now
            while held and held[0][0] <= now:
                _, _, i, how = heapq.heappop(held)
                if timed.get(i) is how:  # still the one filed: asked from now on
                    self._asked[i] = how
        for i, retime in list(self._asked.items()):
            if retime is not None and i not in dirty:
                new = retime(snaps[i])
                if new is not snaps[i]:  # the same snapshot back: it and its retime stay filed
                    snaps[i] = new
                    self._file(i, reps[i].snapshot_clock(self._waits))
            else:
                dirty.add(i)
        for i in dirty:
            rep = reps[i]
            snaps[i] = rep.state(False, self._waits)
            self._file(i, rep.snapshot_clock(self._waits) if self._kept[i] else None)
        dirty.clear()
        return list(snaps)  # type: ignore[arg-type]

    def _file(self, i: int, how) -> None:
        self._asked.pop(i, None)
        if how is KEEP:
            self._timed.pop(i, None)
            return
        self._timed[i] = how
        until = getattr(how, "until", None)
        if until is None:
            self._asked[i] = how
        else:
            heapq.heappush(self._held, (until, next(self._seq), i, how))
