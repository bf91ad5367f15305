"""The event loop: a heap of ``(time, priority, seq)``-ordered callbacks.

Vidur's loop in a few lines: pop the earliest event, set the clock, call its handler; handlers
schedule what follows. Ties are broken explicitly and deterministically:

1. ``time`` (seconds);
2. ``priority`` (``Priority``, smaller first) — at one instant, bytes land and work finishes
   before new requests arrive, and all of those before any replica decides what to run next
   (``Priority.SCHEDULE``), so a decision sees every change of that instant;
3. ``seq`` — insertion order.

Stale events (a decode segment cut short, a link allocation replaced) are not removed from the
heap; their handlers compare a version number and return.
"""

from __future__ import annotations

import gc
import heapq
from contextlib import contextmanager
from enum import IntEnum
from typing import Any, Callable


class Priority(IntEnum):
    LINK = 0  # a send on a link finishes / bytes are delivered
    WORK = 1  # a prefill batch, decode segment or pipeline stage finishes
    ARRIVAL = 2  # a request arrives at the system
    SCHEDULE = 3  # a replica decides what to run next


class EventLoop:
    """Owns the clock. ``schedule`` pushes; ``run`` pops until the heap is empty."""

    __slots__ = ("now", "_heap", "_seq", "events")

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, int, Callable[[Any], None], Any]] = []
        self._seq = 0
        self.events = 0  # handled so far

    def schedule(self, time: float, priority: int, handler: Callable[[Any], None], arg: Any = None) -> None:
        if time < self.now:
            raise ValueError(f"event at {time} scheduled in the past (now {self.now})")
        self._seq += 1
        heapq.heappush(self._heap, (time, priority, self._seq, handler, arg))

    def __len__(self) -> int:
        return len(self._heap)

    def next_at(self) -> tuple[float, int] | None:
        """``(time, priority)`` of the next event to be handled (None: none is pending)."""
        return self._heap[0][:2] if self._heap else None

    def run(self, until: float = float("inf"), on_progress: Callable[[], None] | None = None,
            progress_every: int = 4096) -> None:
        """Handle events in order until the heap is empty or the next is later than ``until``."""
        heap, pop = self._heap, heapq.heappop
        with _rare_young_collections():
            while heap and heap[0][0] <= until:
                time, _, _, handler, arg = pop(heap)
                self.now = time
                handler(arg)
                self.events += 1
                if on_progress is not None and self.events % progress_every == 0:
                    on_progress()


YOUNG_OBJECTS = 50_000  # the cycle collector's first threshold while the loop runs (Python's default: 700)


@contextmanager
def _rare_young_collections():
    """The cycle collector run on the youngest objects every ``YOUNG_OBJECTS`` allocations instead of
    every 700, then as it was. The loop allocates short-lived containers by the million (events,
    messages, their tuples) that their reference counts free; at Python's default the collector
    keeps tracing the few alive. A collector turned off stays off."""
    threshold = gc.get_threshold()
    if threshold[0] and threshold[0] < YOUNG_OBJECTS:
        gc.set_threshold(YOUNG_OBJECTS, *threshold[1:])
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
