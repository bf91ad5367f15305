"""``LiveState``: a kept placement snapshot whose clock-bound figures are worked out when read
(kept apart from ``snapshots``, which may be compiled: it builds itself with ``object.__new__``
and reads its fields through a descriptor, which want an interpreted class)."""

from __future__ import annotations

from typing import Callable

from hetserve.policies.base import ReplicaState


_NOT_YET = float("-inf")  # a new snapshot's figures hold until: its first read works them out


class _Figure:
    """One clock-bound figure of a ``LiveState`` (a non-data descriptor): worked out when read,
    through the snapshot's ``progress`` again only once the clock reaches the time the last figures
    held until. Figures that hold for ever (an idle replica), or until a time its keeper (``_expire``,
    ``SnapshotCache``) takes them back by, are written into the snapshot's own fields, which are
    then read as any field is."""

    __slots__ = ("_k",)

    def __init__(self, k: int):
        self._k = k

    def __get__(self, snap, owner=None):
        if snap is None:
            return self
        d = snap.__dict__
        now = d["_loop"].now
        if now >= d["_until"]:
            d["_figures"], d["_until"] = figures, until = d["_progress"](now)
            if until == float("inf"):
                d["outstanding_tokens"], d["context_tokens"] = figures
            elif d["_expire"] is not None:
                d["outstanding_tokens"], d["context_tokens"] = figures
                d["_expire"](until, snap)
        return d["_figures"][self._k]


class LiveState(ReplicaState):
    """A ``ReplicaState`` whose outstanding tokens and context are worked out when read, as of that
    moment: kept between decisions while its replica does not change, it reads what a snapshot built
    then would hold (``ColocatedReplica.snapshot``). ``progress(now)`` gives the two figures as of
    ``now`` (the clock of ``loop``, the event loop) and the time until which they hold (the running
    batch's next iteration boundary), so reading them again before then costs nothing."""

    def __new__(cls, *args, **fields):
        # built from fields (``dataclasses.replace``): a plain snapshot of them, the figures as read
        return ReplicaState(*args, **fields)

    @staticmethod
    def of(fields: dict, progress: Callable[[float], tuple[tuple[float, int], float]], loop) -> "LiveState":
        """The snapshot of ``fields`` (the fixed fields; the others' defaults are the class's), which
        it takes for its own ``__dict__``: one dict built once, not copied (it is built at every
        change of a replica)."""
        fields["_progress"], fields["_loop"], fields["_figures"] = progress, loop, None
        fields["_until"], fields["_expire"] = _NOT_YET, None
        snap = object.__new__(LiveState)
        snap.__dict__ = fields
        return snap

    def _forget(self) -> None:
        """The figures written into the fields no longer hold: the next read works them out."""
        d = self.__dict__
        d.pop("outstanding_tokens", None)
        d.pop("context_tokens", None)

    outstanding_tokens = _Figure(0)  # type: ignore[assignment]
    context_tokens = _Figure(1)  # type: ignore[assignment]
