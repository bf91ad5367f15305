"""Unicode line ends in streamed JSON: escaped, in serve's own events and in those route relays.

Python's ``str.splitlines`` (and so httpx's ``iter_lines`` / ``aiter_lines``) ends a line at U+0085,
U+2028 and U+2029 too, beyond the CR / LF that end an SSE line: one raw inside an event's JSON cuts it
in two for such a client. JSON may escape any character and these occur only inside JSON strings,
so each goes out as its escape, which every JSON reader reads back as the same character."""

from __future__ import annotations

UNICODE_LINE_ENDS = ("\x85", "\u2028", "\u2029")
_TEXT = str.maketrans({ch: f"\\u{ord(ch):04x}" for ch in UNICODE_LINE_ENDS})
_BYTES = [(ch.encode(), f"\\u{ord(ch):04x}".encode()) for ch in UNICODE_LINE_ENDS]


def escape_text(json_text: str) -> str:
    """``json_text`` with each of ``UNICODE_LINE_ENDS`` escaped."""
    return json_text.translate(_TEXT)


def escape_line_ends(events: bytes) -> bytes:
    """``events`` (whole ones, UTF-8: no character is cut) with each of ``UNICODE_LINE_ENDS`` escaped."""
    for raw, escaped in _BYTES:
        if raw in events:
            events = events.replace(raw, escaped)
    return events
