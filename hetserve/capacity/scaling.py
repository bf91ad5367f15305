"""Scale the number of workers over a time-varying trace (Aladdin §5.2).

At every heartbeat the arrival rate of the window just ended is measured (reactive; with
``lookahead`` the coming window's rate, an oracle) and the fitted law N_w = ⌈k5·r + c5⌉ gives the
worker count for the next window. Scaling up is immediate; scaling down waits until the lower
count has been wanted for ``down_after`` heartbeats in a row (a simple change-point guard against
flapping on one quiet window).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hetserve.capacity.workers import WorkerLaw
from hetserve.specs.workload import Workload


@dataclass(frozen=True)
class ScalingStep:
    start_s: float
    duration_s: float  # the heartbeat; the trace's rest for its last window (``plan_scaling``)
    measured_rate: float  # req/s that drove the decision
    actual_rate: float  # req/s that arrived in this window
    workers: int


@dataclass(frozen=True)
class ScalingPlan:
    heartbeat_s: float
    gpus_per_worker: int
    steps: tuple[ScalingStep, ...]
    law: WorkerLaw

    @property
    def gpu_hours(self) -> float:
        return sum(s.workers * s.duration_s for s in self.steps) * self.gpus_per_worker / 3600.0

    @property
    def peak_workers(self) -> int:
        return max((s.workers for s in self.steps), default=0)

    @property
    def static_gpu_hours(self) -> float:
        """GPU-hours of provisioning the peak for the whole trace (what scaling saves against)."""
        return self.peak_workers * self.gpus_per_worker * sum(s.duration_s for s in self.steps) / 3600.0

    @property
    def under_provisioned_windows(self) -> int:
        """Windows whose actual rate needed more workers than were running (by the same law)."""
        return sum(1 for s in self.steps if s.workers < self.law.workers(s.actual_rate))


def plan_scaling(workload: Workload, law: WorkerLaw, heartbeat_s: float = 60.0, gpus_per_worker: int = 1,
                 lookahead: bool = False, down_after: int = 1, min_workers: int = 1) -> ScalingPlan:
    """Worker count per heartbeat window over ``workload`` (O(n) in requests). The last window
    holds the trace's rest (to its last arrival, and its mean gap on): its rate is counted over that,
    and its workers are paid for that long."""
    if heartbeat_s <= 0 or down_after < 1:
        raise ValueError("heartbeat_s must be positive and down_after at least 1")
    span = workload.duration_s
    n_windows = max(1, int(np.ceil(span / heartbeat_s)))
    counts = np.bincount(np.minimum((workload.arrival_s // heartbeat_s).astype(int), n_windows - 1),
                         minlength=n_windows)
    durations = np.full(n_windows, heartbeat_s)
    if len(workload) > 1:  # n arrivals a mean gap apart cover n gaps, the last one's own included
        rest, last = span - (n_windows - 1) * heartbeat_s, int(counts[-1])
        gap = rest / (last - 1) if last > 1 else span / (len(workload) - 1)
        if rest + gap > 0:  # else every arrival at one instant: one whole window
            durations[-1] = min(heartbeat_s, rest + gap)
    rates = counts / durations
    steps, current, lower_for = [], None, 0
    for w in range(n_windows):
        measured = rates[w] if lookahead else (rates[w - 1] if w > 0 else rates[0])
        want = max(min_workers, law.workers(float(measured)))
        if current is None or want > current:
            current, lower_for = want, 0
        elif want < current:
            lower_for += 1
            if lower_for >= down_after:
                current, lower_for = want, 0
        else:
            lower_for = 0
        steps.append(ScalingStep(w * heartbeat_s, float(durations[w]), float(measured), float(rates[w]), int(current)))
    return ScalingPlan(heartbeat_s, gpus_per_worker, tuple(steps), law)
