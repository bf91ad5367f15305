"""The console a benchmark prints its tables on: at least ``MIN_WIDTH`` columns wide.

Rich takes 80 columns when the output is not a terminal (a log file, CI, ``nohup``) and folds a wide
table into cells of a few characters; a benchmark's table is read from its log more often than live."""

from __future__ import annotations

from rich.console import Console

MIN_WIDTH = 160


def wide_console(**kwargs) -> Console:
    """A ``Console`` as wide as the terminal, and at least ``MIN_WIDTH``."""
    return Console(width=max(MIN_WIDTH, Console().width), **kwargs)
