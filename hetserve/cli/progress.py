"""What the long commands (``calibrate``, ``compare``) run their work under: the phase bar, one
transient rich bar naming the phase at hand, as ``plan`` and ``simulate`` show theirs (nothing off a
terminal or with --quiet: a transient bar cannot erase itself there, it would leave lines above the
results); and SIGTERM taken as Ctrl-C, so the workers they start are stopped either way."""

from __future__ import annotations

import signal
import threading
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


@contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """SIGTERM stops the block as Ctrl-C does (``KeyboardInterrupt``), then the previous handler is
    back. Its default action ended the process at once: the probe or served deployment's workers
    were never stopped, and those still starting outlived it, orphaned. On the main thread only
    (where Python delivers signals)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
