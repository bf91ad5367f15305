"""The phase bar of the long commands (``calibrate``, ``compare``): one transient rich bar naming
the phase at hand, as ``plan`` and ``simulate`` show theirs; nothing off a terminal or with --quiet
(a transient bar cannot erase itself there: it would leave lines above the results)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator


@contextmanager
def phase_progress(console, quiet: bool) -> Iterator[Callable[..., None]]:
    """Yields ``report(phase, done=None, total=None)``: the bar names ``phase`` and fills to
    ``done`` of ``total`` (none: no count, an indeterminate bar). Each new phase is drawn at once,
    so a phase shorter than the refresh interval still shows."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TimeElapsedColumn(), console=console,
                  transient=True, disable=quiet or not console.is_terminal) as bar:
        task = bar.add_task("starting", total=None)

        def report(phase: str, done: float | None = None, total: float | None = None) -> None:
            bar.update(task, description=phase, completed=done or 0, total=total, refresh=True)

        yield report
