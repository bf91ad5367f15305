"""``LiveState``: a kept placement snapshot whose clock-bound figures are worked out when read
(kept apart from ``snapshots``, which may be compiled and builds it: it reads its figures through a
descriptor, which wants an interpreted class)."""

from __future__ import annotations

from hetserve.policies.base import ReplicaState


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
        # built from fields (``dataclasses.replace``): a plain snapshot of them, the figures as read;
        # a live one is built by ``snapshots.live_state``
        return ReplicaState(*args, **fields)

    def _forget(self) -> None:
        """The figures written into the fields no longer hold: the next read works them out."""
        d = self.__dict__
        d.pop("outstanding_tokens", None)
        d.pop("context_tokens", None)

    outstanding_tokens = _Figure(0)  # type: ignore[assignment]
    context_tokens = _Figure(1)  # type: ignore[assignment]
