"""The hooks of ``SocketTransport``'s send path (transport.py's docstring draws it): a
``LinkScheduler`` orders what goes next on one link, as ``Chunk``s of the ``Outgoing`` messages
queued on it, and a ``LinkShaper`` emulates the link's time. ``PriorityScheduler`` is the default
scheduler; the serving layer's (``runtime/links/``) follows the same protocol.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from dataclasses import dataclass
from typing import Protocol


@dataclass
class Outgoing:
    """One encoded message waiting for a link."""

    msg_id: int
    priority: int
    buffers: list[memoryview]
    nbytes: int
    enqueued_at: float


@dataclass
class Chunk:
    msg_id: int
    offset: int  # byte offset of ``data`` inside the message
    total: int  # message size in bytes
    data: bytes | memoryview


class LinkScheduler(Protocol):
    """Orders what goes on one link (one ordered pair of endpoints). Thread-safe."""

    def push(self, item: Outgoing) -> None: ...

    def pop(self, timeout: float | None = None) -> Chunk | None:
        """Next chunk to write, blocking up to ``timeout`` seconds; None if nothing is queued."""

    def pending_bytes(self) -> int: ...


class LinkShaper(Protocol):
    """Emulates a link: seconds to wait before ``nbytes`` go from ``src`` to ``dst`` (e.g. α + n/β)."""

    def delay(self, src: str, dst: str, nbytes: int) -> float: ...


class PriorityScheduler:
    """Whole messages, most urgent class first, FIFO within a class."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, Outgoing]] = []
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._bytes = 0

    def push(self, item: Outgoing) -> None:
        with self._cv:
            heapq.heappush(self._heap, (item.priority, next(self._seq), item))
            self._bytes += item.nbytes
            self._cv.notify()

    def pop(self, timeout: float | None = None) -> Chunk | None:
        with self._cv:
            if not self._heap and not self._cv.wait_for(lambda: bool(self._heap), timeout):
                return None
            _, _, item = heapq.heappop(self._heap)
            self._bytes -= item.nbytes
        data = b"".join(item.buffers) if len(item.buffers) > 1 else item.buffers[0]
        return Chunk(item.msg_id, 0, item.nbytes, data)

    def pending_bytes(self) -> int:
        return self._bytes
