"""Placement snapshots of many replicas, kept between decisions (``SnapshotCache``); each replica's
events tell the cache whose state changed (``clock.ReplicaClock``).

A replica kind opts in with ``snapshots_kept`` and says, through ``snapshot_clock()``, how its
snapshot depends on the clock: ``KEEP`` (not at all: it holds until the replica changes; a
``LiveState`` works out its clock-bound figures when read), a function bringing a kept one up to
now (it may hand back the very snapshot it got: then that function stays filed with it), or None
(build it again)."""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from heapq import heappop, heappush
from typing import Any, Callable, Sequence

from hetserve.policies.base import ReplicaState
from hetserve.policies.outstanding import Drain, LeastLoaded
from hetserve.sim.replicas.base import Replica
from hetserve.sim.replicas.live import LiveState


def KEEP(snap: ReplicaState) -> ReplicaState:
    """(Marker) the snapshot holds until the replica changes."""
    return snap


# a new live snapshot's figures hold until: its first read works them out
_NOT_YET = float("-inf")


def live_state(fields: dict, progress: Callable[[float], tuple[tuple[float, int], float]], loop) -> LiveState:
    """A ``LiveState`` of ``fields`` (the fields that hold until its replica changes; the others'
    defaults are the class's), which it takes for its own ``__dict__``: one dict built once, not
    copied (it is built at every change of a replica). ``progress(now)`` gives its two clock-bound
    figures at ``now`` (the clock of ``loop``, the event loop) and the time until which they hold."""
    snap = object.__new__(LiveState)
    fields["_progress"], fields["_loop"], fields["_figures"], fields["_until"], fields["_expire"] = \
        progress, loop, None, _NOT_YET, None
    object.__setattr__(snap, "__dict__", fields)  # past the frozen dataclass's own __setattr__
    return snap


def with_wait(snap: ReplicaState, wait: float) -> ReplicaState:
    """``snap`` with its ``prefill_wait_s`` set (a copy, without a pass through every field)."""
    new = object.__new__(ReplicaState)
    new.__dict__.update(snap.__dict__)
    new.__dict__["prefill_wait_s"] = wait
    return new


class _Outstanding(Drain):
    """A filed replica's outstanding tokens: the figures of their lower bound (``Drain``), and the
    tokens themselves, fixed (a plain snapshot's) or worked out by ``progress(now)``, which gives
    them and the time until which they hold (``Replica.live_figures``), again only past that time."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens, self.until = 0.0, math.inf
        self.progress: Callable[[float], tuple[tuple[float, int], float]] | None = None

    def fixed(self, floor: float, drain: tuple[float, float, float] | None, tokens: float) -> None:
        self.set(floor, drain)
        self.tokens, self.until, self.progress = tokens, math.inf, None

    def live(self, floor: float, drain: tuple[float, float, float] | None,
             progress: Callable[[float], tuple[tuple[float, int], float]]) -> None:
        self.set(floor, drain)
        self.until, self.progress = -math.inf, progress

    def now(self, now: float) -> float:
        if now >= self.until:
            figures, self.until = self.progress(now)  # type: ignore[misc]
            self.tokens = figures[0]
        return self.tokens


class _FiledLeastLoaded(LeastLoaded):
    """``LeastLoaded`` at ``now`` of the positions ``picked`` (the cache's own list, read during
    one decision), from the figures filed for them."""

    def __init__(self, ids: list[str], picked: list[int], filed: list[_Outstanding], now: float):
        self._ids, self._picked, self._filed, self._now = ids, picked, filed, now
        self.size = len(picked)

    def id(self, i: int) -> str:
        return self._ids[self._picked[i]]

    def tokens(self, i: int) -> float:
        return self._filed[self._picked[i]].now(self._now)

    def bound(self, i: int) -> float:
        return self._filed[self._picked[i]].at(self._now)

    def least_bound(self) -> int:
        filed, picked, now = self._filed, self._picked, self._now
        best, k = filed[picked[0]].at(now), 0
        for j in range(1, len(picked)):
            b = filed[picked[j]].at(now)
            if b < best:  # the first of equals, as ``min``
                best, k = b, j
        return k

    def bounded_by(self, tokens: float) -> list[int]:
        filed, picked, now = self._filed, self._picked, self._now
        return [j for j in range(len(picked)) if filed[picked[j]].at(now) <= tokens]


class SnapshotCache:
    """The placement snapshots of ``replicas`` (aggregates only, no request views), each built
    again only where it may differ from the one kept: the replica changed (one of its own events
    was handled, or the caller ``touch``-ed it after calling into it), or the kept one reads the
    clock (``snapshot_clock``). A kind without ``snapshots_kept`` is built at every decision, so
    every snapshot equals what ``state()`` gives now — but for ``prefill_wait_s`` and
    ``queued_age_s`` when ``waits`` is False (the placement policy does not read them).

    ``by_load``: the replicas are also filed by their load (``ReplicaState.load``), and ``lowest``
    hands the least loaded as ``LeastLoaded`` without reading every snapshot
    (``PlacementPolicy.picks_least_loaded``). A changed replica whose kind tells its load without
    a snapshot (``Replica.deferred_load``) is then filed by it; its outstanding figures are read
    only when it is among the least loaded (``Replica.live_figures``), and its snapshot built only
    when ``states`` reads every one: on a large fleet most replicas that change are not of the least.

    A ``LiveState`` kept here has the figures it works out written into its fields until the time
    they hold until, when the cache, bringing its snapshots up to that moment, takes them back
    (``_expire``): a decision reads them as fields. Its snapshots are read at the clock of the last
    ``states`` or ``lowest``."""

    def __init__(self, replicas: Sequence[Replica], waits: bool = True, by_load: bool = False):
        self._waits = waits
        self._reps: list[Replica] = list(replicas)
        n = len(self._reps)
        self._ids = [rep.id for rep in self._reps]
        self._snaps: list[ReplicaState | None] = [None] * n
        # each replica's outstanding tokens and the figures of their bound, read when it is filed
        self._outstanding = [_Outstanding() for _ in range(n)]
        self._pos = {rep.index: i for i, rep in enumerate(self._reps)}
        self._dirty: set[int] = set(range(n))
        # kept snapshots that read the clock -> how to bring one up to now (None: build it again)
        self._asked: dict[int, Callable[[ReplicaState], ReplicaState] | None] = {}
        self._kept = [rep.snapshots_kept for rep in self._reps]
        self.by_load = by_load
        self._loads: list[int] = [-1] * n
        self._by_load: dict[int, list[int]] = {}  # load -> positions of that load, in order
        # live snapshots' figures written into their fields: (the time they hold until, n, snapshot)
        self._expiring: list[tuple[float, int, LiveState]] = []
        # positions filed by load alone (``Replica.deferred_load``): no snapshot built, and (unread)
        # their outstanding figures not read either
        self._deferred = [False] * n
        self._unread = [False] * n
        self._deferrals = 0  # how many are deferred
        self._expired = 0
        self._loop: Any = self._reps[0].loop.loop if self._reps else None
        for i, rep in enumerate(self._reps):
            if rep.snapshots_kept:
                rep.loop.watch(self._dirty, i)

    def touch(self, rep: Replica) -> None:
        """``rep`` may have changed outside its own events (a call into it)."""
        i = self._pos.get(rep.index)
        if i is not None:
            self._dirty.add(i)

    def states(self) -> list[ReplicaState]:
        """Every replica's snapshot now, in the order given."""
        self._refresh()
        if self._deferrals:
            for i in range(len(self._reps)):
                if self._deferred[i]:
                    self._undefer(i)
                    self._file(i, self._reps[i].snapshot(self._waits))
        return list(self._snaps)  # type: ignore[arg-type]

    def lowest(self) -> LeastLoaded:
        """The least loaded replicas now, in the order given: their ids, outstanding tokens at the
        clock now and a lower bound on them (``ReplicaState.outstanding_at_least``) from the
        figures read when each was filed (ValueError unless ``by_load``)."""
        if not self.by_load:
            raise ValueError("this cache files its replicas by no load")
        self._refresh()
        picked = self._by_load[min(self._by_load)]
        if self._deferrals:
            unread, reps, outstanding = self._unread, self._reps, self._outstanding
            for i in picked:
                if unread[i]:
                    unread[i] = False
                    floor, drain, progress = reps[i].live_figures()
                    outstanding[i].live(floor, drain, progress)
        return _FiledLeastLoaded(self._ids, picked, self._outstanding, self._loop.now)

    def _expire(self, until: float, snap: LiveState) -> None:
        self._expired += 1
        heappush(self._expiring, (until, self._expired, snap))

    def _refresh(self) -> None:
        reps, snaps, dirty, expiring = self._reps, self._snaps, self._dirty, self._expiring
        if expiring:
            now = self._loop.now
            while expiring and expiring[0][0] <= now:
                heappop(expiring)[2]._forget()
        for i, retime in list(self._asked.items()):
            if retime is not None and i not in dirty:
                new = retime(snaps[i])  # type: ignore[arg-type]
                if new is not snaps[i]:  # the same snapshot back: it and its retime stay filed
                    self._file(i, new)
                    self._file_load(i, new.load)
            else:
                dirty.add(i)
        by_load, waits = self.by_load, self._waits
        for i in dirty:
            rep = reps[i]
            load = rep.deferred_load(waits) if by_load else -1
            if load >= 0:  # filed by its load now, read if ever among the least loaded
                snaps[i] = None
                if self._asked:
                    self._asked.pop(i, None)
                self._unread[i] = True
                if not self._deferred[i]:
                    self._deferred[i] = True
                    self._deferrals += 1
            else:
                if self._deferred[i]:
                    self._undefer(i)
                snap = rep.snapshot(waits)
                self._file(i, snap)
                load = snap.load
            self._file_load(i, load)
        dirty.clear()

    def _undefer(self, i: int) -> None:
        """Position ``i``, deferred, is about to be filed whole."""
        self._deferred[i] = self._unread[i] = False
        self._deferrals -= 1

    def _file(self, i: int, snap: ReplicaState) -> None:
        """``snap``, whole, is the snapshot at position ``i`` (its load is filed apart): its
        outstanding tokens' figures are read once, here (filed by load)."""
        self._snaps[i] = snap
        outstanding = self._outstanding[i]
        if type(snap) is LiveState:  # its fields read as the dict they are
            d = snap.__dict__
            d["_expire"] = self._expire
            if self.by_load:
                outstanding.live(d["outstanding_floor"], d["outstanding_drain"], d["_progress"])
        elif self.by_load:
            outstanding.fixed(snap.outstanding_floor, snap.outstanding_drain, snap.outstanding_tokens)
        how = self._reps[i].snapshot_clock(self._waits) if self._kept[i] else None
        self._asked.pop(i, None)
        if how is not KEEP:
            self._asked[i] = how

    def _file_load(self, i: int, new: int) -> None:
        if not self.by_load:
            return
        old = self._loads[i]
        if new == old:
            return
        if old >= 0:
            bucket = self._by_load[old]
            del bucket[bisect_left(bucket, i)]  # found by halving (``remove`` compares each in turn)
            if not bucket:
                del self._by_load[old]
        self._loads[i] = new
        insort(self._by_load.setdefault(new, []), i)
