"""Whole server-sent events out of a backend's byte stream, as it arrives.

``hetserve route`` relays a backend's stream one whole event at a time, so a backend cut off inside
an event never leaves the client half an event: SSE clients (the OpenAI SDK among them) parse each
event's ``data:`` as JSON, and a broken one would fail there before the error event after it is
read. An event ends at a blank line: two line ends in a row, each CRLF, LF or CR (the SSE spec's
line ends, as the OpenAI SDK splits them).
"""

from __future__ import annotations

import re

# two line ends in a row; a CR is one line end with the LF after it, so a CR counts alone only when
# the next byte is known and is not LF (a CR last in what has arrived waits for the next byte)
_EVENT_END = re.compile(rb"(?:\r\n|\r(?!\n)|\n)(?:\r\n|\r(?=[^\n])|\n)")
_LONGEST_END = 4  # b"\r\n\r\n"

MAX_EVENT_BYTES = 4 << 20  # a backend's event longer than this ends its stream as a broken one


class EventCutter:
    """Feed it a stream's chunks; it gives back the bytes up to the last whole event's end and holds
    the rest (at most one event, not yet ended) until a later chunk ends it."""

    def __init__(self, max_event_bytes: int | None = None):
        self.max_event_bytes = MAX_EVENT_BYTES if max_event_bytes is None else max_event_bytes
        self._held = bytearray()

    def feed(self, chunk: bytes) -> bytes:
        """The whole events ``chunk`` completes (``b""`` if none)."""
        # what is held has no event end in it but may hold the start of one: search from there on
        start = max(len(self._held) - (_LONGEST_END - 1), 0)
        self._held += chunk
        end = None
        for m in _EVENT_END.finditer(self._held, start):
            end = m.end()
        if end is None:
            return b""
        out = bytes(self._held[:end])
        del self._held[:end]
        return out

    @property
    def too_long(self) -> bool:
        """Whether the event held has grown past ``max_event_bytes`` (the stream is to be ended)."""
        return len(self._held) > self.max_event_bytes

    def rest(self) -> bytes:
        """What is held, for a stream that ended normally (a well-formed one ends on an event's end,
        leaving nothing)."""
        out = bytes(self._held)
        self._held.clear()
        return out
