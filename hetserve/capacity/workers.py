"""How many workers an arrival rate needs (Aladdin §5.2, Eq. 7).

``min_workers(meets)`` finds the fewest workers for which ``meets(n)`` holds — ``meets`` is any
monotone test, normally "a simulation with n workers attains the SLOs" (``hetserve.capacity.sim``);
``fluid_workers`` is the cost-model lower bound used when no simulation is wanted: the rate divided by
the most requests one worker completes per second at its SLO-bounded batch.

``fit_worker_law`` fits N_w = ⌈k5·r + c5⌉ to (rate, workers) pairs above the rate floor R.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from hetserve.capacity.config import WorkerOption
from hetserve.errors import InfeasibleError


def min_workers(meets: Callable[[int], bool], lo: int = 1, hi: int | None = None, max_workers: int = 4096) -> int:
    """Fewest ``n`` ≥ ``lo`` with ``meets(n)``, assuming more workers never hurt.

    Doubles from ``hi`` (a guess; default ``lo``) until met, then bisects the gap:
    O(log n) calls of ``meets``. Raises ``InfeasibleError`` if even ``max_workers`` fails.
    """
    if lo < 1:
        raise ValueError("lo must be at least 1")
    cache: dict[int, bool] = {}

    def ok(n: int) -> bool:
        if n not in cache:
            cache[n] = bool(meets(n))
        return cache[n]

    hi = lo if hi is None else max(lo, min(hi, max_workers))
    while not ok(hi):
        if hi >= max_workers:
            raise InfeasibleError(f"even {max_workers} workers do not meet the target (are the SLOs "
                                  f"reachable by a single request on one idle worker?)")
        lo, hi = hi + 1, min(max_workers, hi * 2)
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid + 1
    return hi


def worker_request_rate(option: WorkerOption, mean_input: float, mean_output: float, colocated: bool) -> float:
    """At most how many requests/s one worker completes (fluid view): what makes ``fluid_workers``
    a lower bound on the workers an arrival rate needs.

    Every request of the mean shape needs ``l_out − 1`` decode steps (its first token comes with its
    prompt), and a step serves at most ``batch`` of them (the option's batch: KV, the engine's
    sequence cap, the ATGT target) in no less than ``iteration`` (a step carrying prompts takes no
    less than the decode step alone): at most ``batch / ((l_out − 1) · iteration)`` requests/s.
    Colocated, every prompt also costs its share of a step batching prompts to the token budget
    (``option.prompt_s``), as the simulator and the engine batch them. The prompts ride in the
    decode steps, so the two overlap: the bound is the slower of them, not their sum (a sum, one
    stand-alone TTFT per request added to the decode share, is an estimate that can exceed the
    workers a simulation needs, so not a bound).
    """
    if option.batch <= 0 or option.iteration_s <= 0:
        return 0.0
    per_req = max(mean_output - 1.0, 0.0) * option.iteration_s / option.batch
    if colocated:
        per_req = max(per_req, option.prompt_s)
    return 1.0 / per_req if per_req > 0 else math.inf


def fluid_workers(rate: float, option: WorkerOption, mean_input: float, mean_output: float,
                  colocated: bool = True, utilisation: float = 1.0) -> int:
    """⌈rate / (utilisation · the most requests/s a worker completes)⌉: a lower bound on the
    workers ``rate`` needs (no queueing, bursts or SLO misses; ``worker_request_rate``)."""
    per = worker_request_rate(option, mean_input, mean_output, colocated) * utilisation
    if per <= 0:
        raise ValueError("a worker of this configuration completes no requests")
    return max(1, math.ceil(rate / per - 1e-9))


class DegenerateLaw(ValueError):
    """The (rate, workers) pairs carry no slope: the same count at every rate, or counts falling."""


@dataclass(frozen=True)
class WorkerLaw:
    """N_w = ⌈k5 · r + c5⌉ for r above ``rate_floor`` (R); below it, the count at R."""

    k5: float
    c5: float
    rate_floor: float = 0.0
    r2: float = 1.0
    max_abs_error: int = 0  # over the fitted points, in workers

    def workers(self, rate: float) -> int:
        r = max(rate, self.rate_floor)
        return max(1, math.ceil(self.k5 * r + self.c5 - 1e-9))


def fit_worker_law(rates: Sequence[float], workers: Sequence[int], rate_floor: float = 0.0) -> WorkerLaw:
    """Least-squares fit of Eq. 7 to (rate, workers) pairs with rate ≥ ``rate_floor``.

    A ceiling sits on average half a worker above its argument, so the line is fitted to
    ``workers − 0.5``; the fit's error is reported in whole workers after rounding up.
    """
    r, n = np.asarray(rates, float), np.asarray(workers, float)
    keep = r >= rate_floor
    r, n = r[keep], n[keep]
    if len(r) < 2 or np.ptp(r) == 0:
        raise ValueError("need at least two distinct rates above the floor")
    if np.ptp(n) == 0:  # a slope of 0 would claim every rate, however high, needs this many workers
        raise DegenerateLaw(f"every rate given ({', '.join(f'{x:g}' for x in r)} req/s) needs {int(n[0])} "
                            f"worker(s): no law fits counts that do not change; give rates further apart")
    A = np.column_stack([r, np.ones_like(r)])
    (k5, c5), *_ = np.linalg.lstsq(A, n - 0.5, rcond=None)
    pred = A @ np.array([k5, c5]) + 0.5
    ss_tot = float(np.sum((n - n.mean()) ** 2))
    r2 = 1.0 - float(np.sum((n - pred) ** 2)) / ss_tot if ss_tot > 0 else 1.0
    if k5 <= 0:  # noise (a count that falls as the rate rises) leaves no law to extrapolate
        raise DegenerateLaw(f"the worker counts ({', '.join(str(int(x)) for x in n)}) do not rise with the rates "
                            f"({', '.join(f'{x:g}' for x in r)} req/s): no law to fit; give rates further apart")
    law = WorkerLaw(float(k5), float(c5), float(rate_floor), r2)
    err = max(abs(law.workers(x) - int(y)) for x, y in zip(r, n))
    return WorkerLaw(law.k5, law.c5, law.rate_floor, r2, int(err))
