"""What a served request spends outside the engine, fitted from ``hetserve calibrate``'s HTTP probes.

The cost model's fit (``runtime.calibrate.fit``) prices the engine; these price the serving around
it: the request overhead before a first token (HTTP, tokenisation, the stream's set-up), the stream's
cost per decoding step and per sequence (each token one SSE event), and the front end's CPU per
request, engine step and token (``sim.hosts`` counts it on the cores it shares).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class FrontEndPoint:
    """One HTTP probe's front-end CPU: measured (median over the rounds) and as fitted."""

    requests: int
    steps: int
    tokens: int
    measured_s: float
    predicted_s: float

    @property
    def error(self) -> float:
        return (self.predicted_s - self.measured_s) / self.measured_s if self.measured_s > 0 else 0.0


def fit_frontend_cpu(samples) -> tuple[tuple[float, float, float], tuple[FrontEndPoint, ...]]:
    """Non-negative least squares of ``cpu = request · requests + step · steps + token · tokens`` over
    the HTTP probes' ``(requests, engine steps, output tokens, CPU seconds)``, each probe's median
    over its rounds (the first round warms the client up); ((0, 0, 0), ()) without two probes.
    Relative residuals (each probe weighted by 1 / its CPU): the small probes count as much as
    the large ones."""
    from scipy.optimize import nnls

    by: dict[tuple[int, int, int], list[float]] = {}
    for n, k, t, c in samples or ():
        if n > 0:
            by.setdefault((n, k, t), []).append(c)
    keys = sorted(by)
    if len(keys) < 2:
        return (0.0, 0.0, 0.0), ()
    y = np.array([statistics.median(by[key]) for key in keys], float)
    a = np.array(keys, float)
    w = 1.0 / np.maximum(y, 1e-6)
    scale = a.max(axis=0)
    coef, _ = nnls(a / scale * w[:, None], y * w)
    coef = coef / scale
    pred = a @ coef
    points = tuple(FrontEndPoint(n, k, t, float(m), float(p)) for (n, k, t), m, p in zip(keys, y, pred))
    return (float(coef[0]), float(coef[1]), float(coef[2])), points


def request_overhead(http_ttft: dict[int, float] | None, ttft: dict[int, float],
                     outside: tuple[list[float], list[float]] | None = None) -> float:
    """What a served request spends outside the engine before its first token (HTTP, tokenisation,
    the stream's set-up). With ``outside`` (``Measurements.http_outside``, ``.engine_outside``: per
    request, TTFT less its own prompt step's span, through HTTP and on the engine): the difference of
    their medians. Each is paired within one request, so it holds no drift of the machine's speed,
    where the median HTTP TTFT less the median engine TTFT of the same prompt length, measured
    seconds apart, holds it (on a shared VM that difference spreads about twice as widely between
    calibrations). Without ``outside``: that unpaired estimate, the median over the prompt lengths
    measured both ways."""
    if outside and outside[0] and outside[1]:
        return max(0.0, statistics.median(outside[0]) - statistics.median(outside[1]))
    common = [L for L in (http_ttft or {}) if L in ttft]
    return max(0.0, statistics.median(http_ttft[L] - ttft[L] for L in common)) if common else 0.0


def stream_overheads(http_tpot: dict[int, float] | None, tpot: dict[int, float]) -> tuple[float, float]:
    """(per step, per sequence): what streaming a decode step's tokens over HTTP/SSE adds to it, the
    non-negative least-squares line ``a + b · n`` through HTTP TPOT − engine TPOT over the batch
    sizes ``n`` measured both ways; through 0 (``a`` = 0) with one size. The fixed part is most of
    it: on the CPU demo the line is 0.9-1.8 ms per step + 0.04-0.06 ms per sequence, so a line
    through 0 would price a lone sequence's stream at a tenth of what it costs."""
    from scipy.optimize import nnls

    both = sorted(b for b in (http_tpot or {}) if b in tpot)
    if not both:
        return 0.0, 0.0
    diff = np.array([http_tpot[b] - tpot[b] for b in both], float)
    if len(both) == 1:
        return 0.0, max(0.0, float(diff[0] / both[0]))
    (a, b), _ = nnls(np.array([[1.0, float(n)] for n in both]), diff)
    return float(a), float(b)
