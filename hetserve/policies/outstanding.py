"""Outstanding tokens as placement reads them among many equally loaded candidates: the lower bound
on a snapshot's outstanding tokens (``ReplicaState.outstanding_at_least``) as free functions, the
figures of that bound kept in place by whoever files them (``Drain``), and the least loaded
candidates of one decision by position (``LeastLoaded``; over snapshots, ``SnapshotsLeastLoaded``).
Placement asks the bound of every tied candidate at every decision; in the compiled build (``make
fast-sim``) a call from compiled code into these costs no interpreter frame.
"""

from __future__ import annotations

import math
from typing import ClassVar, Protocol, Sequence


class ReplicaState(Protocol):
    """What the bound and ``LeastLoaded`` read of a ``policies.base.ReplicaState``."""

    outstanding_floor: float
    outstanding_drain: ClassVar[tuple[float, float, float] | None]

    @property
    def id(self) -> str: ...

    @property
    def outstanding_tokens(self) -> float: ...


def outstanding_at_least(state: ReplicaState, now: float) -> float:
    """A lower bound on ``state.outstanding_tokens`` at ``now`` (the snapshot's clock; inf: any
    moment) from its ``outstanding_floor`` and ``outstanding_drain``, without working it out."""
    drain = state.outstanding_drain
    if drain is None:
        return state.outstanding_floor
    return drain_bound(state.outstanding_floor, drain[0], drain[1], drain[2], now)


def drain_bound(floor: float, since: float, drained: float, rate: float, now: float) -> float:
    """``outstanding_at_least`` from its figures: the floor, and ``drained`` tokens at ``since``
    going down at most ``rate`` a second (``outstanding_drain``)."""
    at_now = drained - rate * (now - since)  # nan (0·inf) at now = inf and no rate
    return at_now if at_now > floor else floor


def first_least(values: list[float]) -> int:
    """The position of the smallest of ``values``, the first of equals (``values.index(min(values))``
    in one pass of native comparisons, compiled)."""
    best, k = values[0], 0
    for j in range(1, len(values)):
        if values[j] < best:
            best, k = values[j], j
    return k


class LeastLoaded:
    """The candidates of least load at one decision, by position in candidate order (what
    ``choose_lowest`` is given): ``size`` of them; ``id(i)``; ``tokens(i)`` the outstanding tokens
    now, which may cost work to read (a simulator's running batch); ``bound(i)`` a lower bound on
    them that costs none (``ReplicaState.outstanding_at_least``); ``least_bound()`` the position of
    the smallest bound (the first of equals); ``bounded_by(tokens)`` the positions whose bound is
    at most ``tokens``, in order. A base class, not a protocol: compiled, placement calls its
    methods without a lookup by name; each kind passes over its own storage."""

    size: int

    def id(self, i: int) -> str:
        raise NotImplementedError

    def tokens(self, i: int) -> float:
        raise NotImplementedError

    def bound(self, i: int) -> float:
        raise NotImplementedError

    def least_bound(self) -> int:
        raise NotImplementedError

    def bounded_by(self, tokens: float) -> list[int]:
        raise NotImplementedError


class SnapshotsLeastLoaded(LeastLoaded):
    """``LeastLoaded`` over their snapshots at ``now`` (the bounds worked out once, when first asked)."""

    def __init__(self, snapshots: Sequence[ReplicaState], now: float):
        self._snaps, self._now, self.size = snapshots, now, len(snapshots)
        self._bounds: list[float] | None = None

    def id(self, i: int) -> str:
        return self._snaps[i].id

    def tokens(self, i: int) -> float:
        return self._snaps[i].outstanding_tokens

    def bound(self, i: int) -> float:
        return self._all_bounds()[i]

    def least_bound(self) -> int:
        return first_least(self._all_bounds())

    def bounded_by(self, tokens: float) -> list[int]:
        bounds = self._all_bounds()
        return [j for j in range(len(bounds)) if bounds[j] <= tokens]

    def _all_bounds(self) -> list[float]:
        if self._bounds is None:
            now = self._now
            self._bounds = [outstanding_at_least(c, now) for c in self._snaps]
        return self._bounds


class Drain:
    """One snapshot's ``outstanding_at_least`` figures, kept in place by whoever files it (set
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
