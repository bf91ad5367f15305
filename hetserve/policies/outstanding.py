"""The lower bound on a snapshot's outstanding tokens (``ReplicaState.outstanding_at_least``) as free
functions: placement asks it of every tied candidate at every decision (a simulator's snapshot cache
from the figures it keeps, ``drain_bound``), and in the compiled build (``make fast-sim``) a call from
compiled code into it costs no interpreter frame."""

from __future__ import annotations

from typing import ClassVar, Protocol


class ReplicaState(Protocol):
    """What the bound reads of a ``policies.base.ReplicaState``."""

    outstanding_floor: float
    outstanding_drain: ClassVar[tuple[float, float, float] | None]


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


class LowerBounds(Protocol):
    """The ``outstanding_at_least`` of a list of candidates, by position (what ``choose_lowest`` may
    be given): ``least()`` the position of the smallest (the first of equals), ``at(i)`` one bound,
    ``at_most(tokens)`` the positions whose bound is at most ``tokens``, in order. A keeper of
    snapshots may work them out as asked (``sim.replicas.snapshots``) rather than list them."""

    def least(self) -> int: ...

    def at(self, i: int) -> float: ...

    def at_most(self, tokens: float) -> list[int]: ...


class ListBounds:
    """``LowerBounds`` over a list of the bounds themselves."""

    def __init__(self, values: list[float]):
        self.values = values

    def least(self) -> int:
        v = self.values
        return v.index(min(v))

    def at(self, i: int) -> float:
        return self.values[i]

    def at_most(self, tokens: float) -> list[int]:
        v = self.values
        return [j for j in range(len(v)) if v[j] <= tokens]
