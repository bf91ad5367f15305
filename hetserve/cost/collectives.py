"""All-reduce time inside one box, fitted to measured NCCL all-reduces by size and group size.

``t = alpha_w + 2(w-1)/w · size / (link bandwidth · e_w(size))``: a ring all-reduce moves
``2(w-1)/w`` of the buffer over each GPU's link; ``alpha_w`` is the group's fixed cost and
``e_w(size)`` the share of the link's bandwidth NCCL reaches at that size (piecewise linear in
log2 size between ``KNOTS_LOG2``, flat outside). The link bandwidth is the cluster's (a GPU type's
default NVLink or PCIe figure, or the cluster file's ``intra``): that is how the fit, measured on
A100 NVSwitch boxes, carries to other GPUs. Below ~2 MB the measured times jump between about 25
and 65 µs from one size to the next; the fit runs through their middle.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass, field

import numpy as np

from hetserve.cost.profiles import CollectivePoint

KNOTS_LOG2 = (16.0, 18.0, 20.0, 22.0, 24.0, 26.0)  # 64 KiB .. 64 MiB: the measured sizes
MIN_FIT_BYTES = 65536  # smaller messages are latency alone: the fit starts here


@dataclass(frozen=True)
class AllReduceFit:
    """One group size's fitted numbers: ``alpha_s`` in seconds, ``efficiency`` at ``KNOTS_LOG2``."""

    workers: int
    alpha_s: float
    efficiency: tuple[float, ...]
    # their natural logarithms (numpy's), taken once: the interpolation runs between them
    log_efficiency: tuple[float, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.workers < 2:
            raise ValueError("an all-reduce fit needs at least 2 workers")
        if not (math.isfinite(self.alpha_s) and self.alpha_s >= 0):
            raise ValueError("alpha_s must be a finite non-negative number")
        if len(self.efficiency) != len(KNOTS_LOG2) or not all(
                isinstance(e, (int, float)) and math.isfinite(e) and e > 0 for e in self.efficiency):
            raise ValueError(f"efficiency must hold {len(KNOTS_LOG2)} positive numbers (one per knot)")
        object.__setattr__(self, "log_efficiency", tuple(float(v) for v in np.log(self.efficiency)))

    def time(self, nbytes: float, link_bandwidth: float, workers: int | None = None) -> float:
        """Seconds for one all-reduce of ``nbytes`` over links of ``link_bandwidth`` bytes/s, in a
        group of ``workers`` (default: the fitted group size; another one keeps this fit's numbers)."""
        w = workers or self.workers
        if nbytes <= 0 or w <= 1:
            return 0.0
        lg = math.log2(max(nbytes, 1.0))
        e = _interp(lg, self.log_efficiency)
        return self.alpha_s + 2.0 * (w - 1) / w * nbytes / (link_bandwidth * e)

    def times(self, nbytes, link_bandwidth: float, workers: int | None = None) -> np.ndarray:
        """``time`` over an array of sizes."""
        w = workers or self.workers
        n = np.asarray(nbytes, dtype=float)
        if w <= 1:
            return np.zeros_like(n)
        e = np.exp(np.interp(np.log2(np.maximum(n, 1.0)), KNOTS_LOG2, self.log_efficiency))
        return np.where(n > 0, self.alpha_s + 2.0 * (w - 1) / w * n / (link_bandwidth * e), 0.0)

    def as_dict(self) -> dict:
        return {"workers": self.workers, "alpha_s": self.alpha_s, "efficiency": list(self.efficiency),
                "size_knots_log2": list(KNOTS_LOG2)}


def _interp(lg: float, logs: tuple[float, ...]) -> float:
    """exp of ``logs`` (at ``KNOTS_LOG2``) interpolated at ``lg``: piecewise linear in log space
    between the knots, flat outside; ``numpy.interp``'s arithmetic on one number (it prices every
    all-reduce a simulation runs; numpy's call costs ~30 of these)."""
    xs = KNOTS_LOG2
    if lg <= xs[0]:
        return math.exp(logs[0])
    if lg >= xs[-1]:
        return math.exp(logs[-1])
    j = bisect_right(xs, lg) - 1  # xs[j] <= lg < xs[j + 1]
    if xs[j] == lg:
        return math.exp(logs[j])
    slope = (logs[j + 1] - logs[j]) / (xs[j + 1] - xs[j])
    return math.exp(slope * (lg - xs[j]) + logs[j])


def _vec(alpha, log_e, sizes, w, link):
    e = np.exp(np.interp(np.log2(sizes), KNOTS_LOG2, log_e))
    return alpha + 2.0 * (w - 1) / w * sizes / (link * e)


def fit_allreduce(points: list[CollectivePoint], workers: int, link_bandwidth: float) -> AllReduceFit:
    """Fit one group size to ``points`` (every one of them of that size: one box, ``workers`` GPUs)
    by least squares on log(predicted / measured), sizes from ``MIN_FIT_BYTES`` up."""
    from scipy.optimize import least_squares  # here: pricing from a stored fit needs no scipy

    sel = [p for p in points if p.workers == workers and p.size >= MIN_FIT_BYTES]
    if len(sel) < len(KNOTS_LOG2) + 1:
        raise ValueError(f"too few all-reduce points of {workers} workers to fit ({len(sel)})")
    sizes = np.array([p.size for p in sel])
    t = np.array([p.seconds for p in sel])
    n = len(KNOTS_LOG2)
    # unknowns: log alpha, log e at the first knot, then the steps of log e from knot to knot. A step
    # is at most the step of log size, so e grows no faster than the size and the time never falls
    # as the message grows (the measured times below 2 MB jump about; the fit must not follow them
    # down).
    rise = np.diff(KNOTS_LOG2) * math.log(2.0)
    x0 = np.concatenate([[math.log(1e-5), math.log(0.05)], np.full(n - 1, 0.1)])
    lo = np.concatenate([[math.log(1e-8), -9.0], np.full(n - 1, -3.0)])
    hi = np.concatenate([[math.log(1e-3), 0.0], rise])

    def log_e(z):
        return z[1] + np.concatenate([[0.0], np.cumsum(z[2:])])

    r = least_squares(lambda z: np.log(_vec(math.exp(z[0]), log_e(z), sizes, workers, link_bandwidth) / t), x0,
                      bounds=(lo, hi))
    return AllReduceFit(workers, float(math.exp(r.x[0])), tuple(float(v) for v in np.exp(log_e(r.x))))


def nearest_fit(fits: dict[int, AllReduceFit], workers: int) -> AllReduceFit:
    """The fit of the group size nearest ``workers`` in log2 (a group of 3 priced as 2 or 4)."""
    return fits[min(fits, key=lambda w: (abs(math.log2(w) - math.log2(workers)), w))]
