"""Median wall time of a call, for the micro-benchmarks (the standard library only: the vLLM
benchmark's child imports it from vLLM's own environment)."""

from __future__ import annotations

import statistics
import time


def median_us(fn, repeats: int, warmup: int = 0) -> float:
    """Median microseconds of ``fn()`` over ``repeats`` calls, after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6
