"""How a line names many things: all of them when few, else their count and the first few, so a
fleet's 171 machines make one short line, not a paragraph."""

from __future__ import annotations

NAMES_SHOWN = 3  # names shown before the "…"


def some(names: list[str], limit: int = NAMES_SHOWN) -> str:
    """``a, b, c`` or, past ``limit`` names, their count first: ``171: a, b, c, …``."""
    return ", ".join(names) if len(names) <= limit else f"{len(names):,}: " + ", ".join(names[:limit]) + ", …"


def and_more(names: list[str], limit: int = 8) -> str:
    """For a sentence: ``a, b, c`` or, past ``limit`` names, ``a, b, … h and 163 more`` (the first ``limit``)."""
    return ", ".join(names) if len(names) <= limit else ", ".join(names[:limit]) + f" and {len(names) - limit:,} more"
