"""What ``hetserve route``'s requests wait on their backends for, and the two things that cut a wait
short: the shutdown's ``end_now`` wakes every stream's read (``wake_reads``), and a backend that went
quiet (a frozen process, a dead host whose connections never reset) has its waits ended once health
checks have taken it out, the last one unanswered, and a wait has lasted ``stall_s`` (``end_stalled``). Without the second, a
stream from a frozen backend would hang for the whole request timeout (600 s by default), long after
the backend was marked down.

A wait is cut by cancelling the task that awaits (no task per chunk: a stream's chunks come
thousands a second) with a message of this module's own; the cancel is taken back (``uncancel``)
where it was this module's alone, and turned into ``Woken`` or ``Stalled``. ``Stalled`` is an httpx
error, so each wait's handler takes it as a broken connection: a request not yet answered moves to
another backend, a stream already relayed ends with an error event.
"""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, TypeVar

import httpx

T = TypeVar("T")

_WAKE = "hetserve route: end_now"
_STALL = "hetserve route: backend stalled"


class Woken(Exception):
    """A stream's read woken by ``wake_reads`` (the shutdown ends it)."""


class Stalled(httpx.ReadTimeout):
    """A wait on a backend marked down, ended after ``stall_s``."""


class Waits:
    """The tasks awaiting a backend now: task -> (backend, since when, a stream's read)."""

    def __init__(self, stall_s: float = 10.0):
        if not stall_s > 0:
            raise ValueError(f"stall_s must be above 0, got {stall_s}")
        self.stall_s = stall_s
        self._on: dict[asyncio.Task, tuple[object, float, bool]] = {}

    async def on(self, backend: object, aw: Awaitable[T], read: bool = False) -> T:
        """``aw``'s result, awaited on ``backend``'s behalf; ``read``: a stream's next chunk (which
        ``wake_reads`` wakes)."""
        me = asyncio.current_task()
        self._on[me] = (backend, time.monotonic(), read)
        try:
            return await aw
        except asyncio.CancelledError as exc:
            why = exc.args[0] if exc.args else None
            if not (why is _WAKE or why is _STALL) or me.cancelling() != 1:
                raise  # another's cancel (the client left, the server stops): not ours to take back
            me.uncancel()
            if why is _WAKE:
                raise Woken() from None
            raise Stalled(f"nothing for {self.stall_s:g} s from a backend marked down") from None
        finally:
            self._on.pop(me, None)

    def wake_reads(self) -> None:
        """End every stream's read now (each raises ``Woken``)."""
        for task, (_, _, read) in list(self._on.items()):
            if read:
                del self._on[task]  # cancelled once: a second cancel would not be taken back
                task.cancel(_WAKE)

    def end_stalled(self, backend: object) -> int:
        """End the waits on ``backend`` (marked down: the caller knows) that have lasted ``stall_s``
        (each raises ``Stalled``); how many."""
        now, n = time.monotonic(), 0
        for task, (b, since, _) in list(self._on.items()):
            # a wait whose answer came in this very turn of the loop is ended all the same (its
            # connection closed): it had waited ``stall_s`` on a backend gone quiet
            if b is backend and now - since >= self.stall_s:
                del self._on[task]
                task.cancel(_STALL)
                n += 1
        return n
