"""The event loop as one replica uses it (``ReplicaClock``): every event the replica schedules
tells a keeper of placement snapshots (``snapshots.SnapshotCache``) that the replica changed."""

from __future__ import annotations

from typing import Any, Callable


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
