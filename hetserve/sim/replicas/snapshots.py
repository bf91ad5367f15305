"""Placement snapshots of many replicas, kept between decisions (``SnapshotCache``), and the
event loop as one replica uses it (``ReplicaClock``), which tells the cache whose state changed.

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
from hetserve.policies.outstanding import LowerBounds, drain_bound
from hetserve.sim.replicas.live import LiveState


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


# a new live snapshot's figures hold until: its first read works them out
_NOT_YET = float("-inf")


def live_shell(fields: dict) -> LiveState:
    """A ``LiveState`` of ``fields`` alone (the fixed fields; the others' defaults are the class's),
    which it takes for its own ``__dict__``: one dict built once, not copied (it is built at every
    change of a replica). Its fixed fields may be read (a rank), not yet its clock-bound figures:
    ``live_fill`` makes it whole."""
    snap = object.__new__(LiveState)
    object.__setattr__(snap, "__dict__", fields)  # past the frozen dataclass's own __setattr__
    return snap


def live_fill(snap: LiveState, progress: Callable[[float], tuple[tuple[float, int], float]], loop) -> LiveState:
    """``snap`` (a ``live_shell``) made whole: ``progress(now)`` gives its two figures at ``now``
    (the clock of ``loop``, the event loop) and the time until which they hold."""
    d = snap.__dict__
    d["_progress"], d["_loop"], d["_figures"], d["_until"], d["_expire"] = progress, loop, None, _NOT_YET, None
    return snap


def with_wait(snap: ReplicaState, wait: float) -> ReplicaState:
    """``snap`` with its ``prefill_wait_s`` set (a copy, without a pass through every field)."""
    new = object.__new__(ReplicaState)
    new.__dict__.update(snap.__dict__)
    new.__dict__["prefill_wait_s"] = wait
    return new


class _Bound:
    """A filed snapshot's ``outstanding_at_least`` figures, in place (one object per position, set
    again at each filing): its ``outstanding_floor``, and ``drained`` tokens at ``since`` going
    down at most ``rate`` a second (``outstanding_drain``; none: ``drained`` is -inf)."""

    def __init__(self) -> None:
        self.floor, self.since, self.drained, self.rate = 0.0, 0.0, -math.inf, 0.0

    def set(self, floor: float, drain: tuple[float, float, float] | None) -> None:
        self.floor = floor
        if drain is None:
            self.since, self.drained, self.rate = 0.0, -math.inf, 0.0
        else:
            self.since, self.drained, self.rate = drain

    def at(self, now: float) -> float:
        return drain_bound(self.floor, self.since, self.drained, self.rate, now)


class _PickedBounds:
    """``LowerBounds`` of the snapshots ``lowest`` hands out at ``now``, worked out from their
    positions' figures as asked: a fleet has tens of equally loaded candidates at most decisions,
    and a pass over native floats costs a fraction of a list of them."""

    def __init__(self, bounds: list[_Bound], now: float):
        self._bounds, self._now = bounds, now

    def least(self) -> int:
        bounds, now = self._bounds, self._now
        best, k = bounds[0].at(now), 0
        for j in range(1, len(bounds)):
            b = bounds[j].at(now)
            if b < best:  # the first of equals, as ``min``
                best, k = b, j
        return k

    def at(self, i: int) -> float:
        return self._bounds[i].at(self._now)

    def at_most(self, tokens: float) -> list[int]:
        bounds, now = self._bounds, self._now
        return [j for j in range(len(bounds)) if bounds[j].at(now) <= tokens]


class SnapshotCache:
    """The placement snapshots of ``replicas`` (aggregates only, no request views), each built
    again only where it may differ from the one kept: the replica changed (one of its own events
    was handled, or the caller ``touch``-ed it after calling into it), or the kept one reads the
    clock (``snapshot_clock``). A kind without ``snapshots_kept`` is built at every decision, so
    every snapshot equals what ``state()`` gives now — but for ``prefill_wait_s`` and
    ``queued_age_s`` when ``waits`` is False (the placement policy does not read them).

    ``rank`` (optional): a function of a snapshot's fields that hold while it is kept (not its
    clock-bound figures); the snapshots are then also filed by it, so ``lowest`` finds those of
    the least rank without reading every snapshot (``PlacementPolicy.lowest_rank``). A changed
    replica whose kind hands a shell (``Replica.snapshot_shell``: the fixed fields alone) is then
    filed by the shell's rank and made whole only once read (``lowest`` reads those of the least
    rank, ``states`` every one): on a large fleet most replicas that change are not of the least.

    A ``LiveState`` kept here has the figures it works out written into its fields until the time
    they hold until, when the cache, bringing its snapshots up to that moment, takes them back
    (``_expire``): a decision reads them as fields. Its snapshots are read at the clock of the last
    ``states`` or ``lowest``."""

    def __init__(self, replicas: Sequence, waits: bool = True,  # sim.replicas.base.Replica objects
                 rank: Callable[[ReplicaState], Any] | None = None):
        self._waits = waits
        self._reps = list(replicas)
        self._snaps: list[ReplicaState | None] = [None] * len(self._reps)
        # each snapshot's ``outstanding_floor`` and ``outstanding_drain``, read when it is filed
        self._bounds = [_Bound() for _ in self._reps]
        self._pos = {rep.index: i for i, rep in enumerate(self._reps)}
        self._dirty: set[int] = set(range(len(self._reps)))
        # kept snapshots that read the clock -> how to bring one up to now (None: build it again)
        self._asked: dict[int, Callable[[ReplicaState], ReplicaState] | None] = {}
        self._kept = [rep.snapshots_kept for rep in self._reps]
        self.rank = rank
        self._ranks: list[Any] = [None] * len(self._reps)
        self._by_rank: dict[Any, list[int]] = {}  # rank -> positions of the snapshots of that rank, in order
        # live snapshots' figures written into their fields: (the time they hold until, n, snapshot)
        self._expiring: list[tuple[float, int, LiveState]] = []
        # positions whose snapshot is a shell (``Replica.snapshot_shell``: its fixed fields, which
        # rank it), made whole only when read: most changed replicas are not of the least rank
        self._shell = [False] * len(self._reps)
        self._shells = 0  # how many
        self._expired = 0
        self._loop: Any = self._reps[0].loop if self._reps else None
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
        self._refresh()
        self._complete_shells(range(len(self._reps)))
        return list(self._snaps)  # type: ignore[arg-type]

    def lowest(self) -> tuple[list[ReplicaState], LowerBounds]:
        """The snapshots now of the least ``rank``, in the order given, and a lower bound on each
        one's ``outstanding_tokens`` at the clock now (``ReplicaState.outstanding_at_least``) from
        the figures read when it was filed, worked out as asked (ValueError without a rank)."""
        if self.rank is None:
            raise ValueError("this cache files its snapshots by no rank")
        self._refresh()
        picked = self._by_rank[min(self._by_rank)]
        self._complete_shells(picked)
        snaps, bounds = self._snaps, self._bounds
        return [snaps[i] for i in picked], _PickedBounds([bounds[i] for i in picked], self._loop.now)  # type: ignore[misc]

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
                    self._filed(i, new)
                    self._rerank(i)
            else:
                dirty.add(i)
        shelled = self.rank is not None
        for i in dirty:
            rep = reps[i]
            shell = rep.snapshot_shell(self._waits) if shelled else None
            if shell is not None:  # ranked now, completed if ever read
                snaps[i] = shell
                if self._asked:
                    self._asked.pop(i, None)
                if not self._shell[i]:
                    self._shell[i] = True
                    self._shells += 1
            else:
                self._unshell(i)
                self._filed(i, rep.snapshot(self._waits))
            self._rerank(i)
        dirty.clear()

    def _complete_shells(self, positions: Sequence[int]) -> None:
        """The shells among ``positions`` made whole (a decision reads them)."""
        if self._shells:
            shell = self._shell
            for i in positions:
                if shell[i]:
                    self._complete(i)

    def _complete(self, i: int) -> None:
        """The shell at position ``i`` made whole (its replica has not changed since: it would be dirty)."""
        self._unshell(i)
        self._filed(i, self._reps[i].complete_snapshot(self._snaps[i]))  # type: ignore[arg-type]

    def _unshell(self, i: int) -> None:
        if self._shell[i]:
            self._shell[i] = False
            self._shells -= 1

    def _filed(self, i: int, snap: ReplicaState) -> None:
        """``snap``, whole, is the snapshot at position ``i`` (its rank is filed apart)."""
        if type(snap) is LiveState:  # its fields read as the dict they are
            d = snap.__dict__
            d["_expire"] = self._expire
            self._keep(i, snap, d["outstanding_floor"], d["outstanding_drain"])
        else:
            self._keep(i, snap, snap.outstanding_floor, snap.outstanding_drain)
        self._file(i, self._reps[i].snapshot_clock(self._waits) if self._kept[i] else None)

    def _keep(self, i: int, snap: ReplicaState, floor: float, drain: tuple[float, float, float] | None) -> None:
        """``snap`` is the snapshot at position ``i``, with its ``outstanding_floor`` and
        ``outstanding_drain``: its bound's figures are read once, here."""
        self._snaps[i] = snap
        self._bounds[i].set(floor, drain)

    def _file(self, i: int, how) -> None:
        self._asked.pop(i, None)
        if how is not KEEP:
            self._asked[i] = how

    def _rerank(self, i: int) -> None:
        if self.rank is None:
            return
        new, old = self.rank(self._snaps[i]), self._ranks[i]  # type: ignore[arg-type]
        if new == old and old is not None:
            return
        if old is not None:
            bucket = self._by_rank[old]
            del bucket[bisect_left(bucket, i)]  # found by halving (``remove`` compares each in turn)
            if not bucket:
                del self._by_rank[old]
        self._ranks[i] = new
        insort(self._by_rank.setdefault(new, []), i)
