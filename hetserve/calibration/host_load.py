"""What calibration runs beside the engine to load or meter its host (``runtime.calibration_probes``).

A process computing as one more worker slot would (``burn``: the contention probe), a thread
holding this process's GIL a known share of the time (``gil_load``: the GIL probe), and the meters
that read CPU time: a worker's main thread (``cpu_ns``), this process over a block less its idle
threads' rate (``cpu_meter``, ``idle_cpu_rate``: the front end's CPU per HTTP probe).
"""

from __future__ import annotations

import time
from pathlib import Path


def burn(stop, go, weight_bytes: float) -> None:  # pragma: no cover - runs in a child process
    """While ``go`` is set, keep one core busy as one more worker process would: one torch thread
    multiplying by a matrix of the checkpoint's weight size (its weights streamed, its cache used)."""
    import torch

    torch.set_num_threads(1)
    n = max(64, int((min(weight_bytes, 64e6) / 4) ** 0.5))
    w, v = torch.randn(n, n), torch.randn(n, 4)
    while not stop.is_set():
        if go.wait(0.05):
            w @ v


def gil_load(stop, duty: float, burst_s: float, used: list) -> None:
    """Hold this process's GIL as the serving front end's other work does (an HTTP request's
    handling, a batch of SSE events, another replica's step): pure-Python bursts of ``burst_s``,
    apart by exponential gaps so the process's GIL is busy a ``duty`` share of the time at random
    phase to the engine's steps. ``used``: appended the share of wall time spent inside bursts (the
    GIL's busy share: a burst preempted by the OS still holds the GIL, as a front end's work does)."""
    import random

    rng = random.Random(0)
    held, t0 = 0.0, time.perf_counter()
    while not stop.is_set():
        start = time.perf_counter()
        end = start + burst_s
        while time.perf_counter() < end:
            pass
        held += time.perf_counter() - start
        time.sleep(rng.expovariate(duty / (burst_s * (1.0 - duty))))
    used.append(held / max(1e-9, time.perf_counter() - t0))


def cpu_ns(pid: int) -> float | None:
    """CPU time of ``pid``'s main thread in ns (``/proc/PID/schedstat``; None where there is none).
    A worker's step loop runs on its main thread: time-sharing the cores leaves this unchanged, so a
    ratio of it measures what a neighbour costs beyond its share of the cores."""
    try:
        return float(Path(f"/proc/{pid}/schedstat").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def idle_cpu_rate(seconds: float = 0.2) -> float:
    """CPU seconds per second this process burns while it serves nothing (idle threads polling)."""
    c0, t0 = time.process_time(), time.perf_counter()
    time.sleep(seconds)
    return max(0.0, (time.process_time() - c0) / (time.perf_counter() - t0))


class cpu_meter:
    """``with cpu_meter(idle) as used: ...``; ``used()``: this process's CPU seconds over the block
    beyond ``idle`` CPU seconds per second of it (never negative)."""

    def __init__(self, idle: float):
        self.idle = idle
        self.cpu = self.wall = 0.0

    def __enter__(self):
        self._c, self._t = time.process_time(), time.perf_counter()
        return lambda: self.cpu

    def __exit__(self, *exc) -> None:
        self.wall = time.perf_counter() - self._t
        self.cpu = max(0.0, time.process_time() - self._c - self.idle * self.wall)
