"""Options shared by every planning algorithm, and the budget / progress bookkeeping of a search.

Every algorithm is ``fn(cluster, model, workload, options) -> Plan``; ``PlanOptions`` is the one
options type. A search stops at the first of: its own convergence rule, ``max_iterations``,
``time_limit_s`` less the share kept for what follows the search (``FINAL_SHARE``). With a fixed
``seed`` and a run that stops by convergence or by ``max_iterations`` (not by the clock) the plan is
the same on every run and every machine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from hetserve.cost.analytic import DEFAULT_PERIOD_S
from hetserve.cost.efficiency import Efficiency
from hetserve.planner.layout.engines import ENGINES


def default_restarts(num_devices: int) -> int:
    """Restarts for a pool of this size: 30 on 20 GPUs, 6 at 100 GPUs, falling to 2 from 300 on.

    A round costs roughly in proportion to the pool, so restarts × pool size stays about 600:
    small pools stay well under 10 s (where extra rounds reliably find better plans:
    hexgen2-het1 gains 3–8 %), and large ones stop after a couple of fruitless rounds (at 320 GPUs
    the rounds after the first descent were ~45 % of the search; 2, 6 and 60 restarts all give
    the same plan there, ``bench_planner scaling``, docs/planner.md).
    """
    return max(2, min(30, 600 // max(1, num_devices)))


STALL_TOLERANCE = 1e-3  # a gain below this share of the best plan found does not count as progress
STALL_MIN_DEVICES = 65  # smaller pools stop by their restarts alone (rounds are cheap and pay there)


def default_stall_iterations(num_devices: int) -> int | None:
    """Iterations in a row without progress (``STALL_TOLERANCE``) after which HexGen-2's search
    stops: None (no such rule) below ``STALL_MIN_DEVICES``, then 2,400 ÷ GPUs, at least 5
    (128 GPUs: 18, 320: 7, from 480 on: 5).

    An iteration's cost grows with the pool (candidates × groups), while the gain of one edit
    shrinks (it changes two groups of hundreds); on large pools the climb goes on for a hundred
    iterations of sub-percent gains that do not change the returned plan (at 1,024 GPUs 128
    iterations and 15 return the same plan, docs/planner.md)."""
    if num_devices < STALL_MIN_DEVICES:
        return None
    return max(5, 2400 // num_devices)


OBJECTIVES = ("throughput", "goodput", "cost")


@dataclass(frozen=True)
class SearchProgress:
    """What a search reports after each iteration (for progress bars and convergence plots)."""

    algorithm: str
    iteration: int
    elapsed_s: float
    best_tokens_per_s: float
    fraction: float  # of the budget used, in [0, 1]; a search may finish early


@dataclass(frozen=True)
class PlanOptions:
    """Knobs common to every algorithm.

    seed: every random choice derives from it.
    time_limit_s: wall-clock cap on the whole call (None: ``DEFAULT_TIME_LIMIT_S``, 110 s): the search
        stops at ``1 − FINAL_SHARE`` of it and what follows (the alternatives, the upper bound) ends
        at it, except the bound's minimum share and the bound's columns (``Budget``).
    max_iterations: cap on search iterations (refinement rounds, generations, restarts …); None: no cap.
    patience: iterations without improvement before a stochastic search stops (None: algorithm default).
    restarts: perturb-and-refine rounds HexGen-2 runs after its first convergence (0: stop there;
        None: ``default_restarts(pool size)``, more on small pools where a round is cheap).
    stall_iterations: HexGen-2 stops after this many iterations in a row that do not raise the best
        plan found (the disaggregated climb's best, or on large pools the colocated plan priced
        before it) by more than ``STALL_TOLERANCE`` (None: ``default_stall_iterations(pool size)``:
        no such rule up to 64 GPUs, 7 at 320, 5 from 480 on).
    period_s: the period T of HexGen-2 §3.2; capacities are requests per T.
    progress: called with a ``SearchProgress`` after each iteration.
    efficiency: cost-model efficiencies (None: ``Efficiency()``).
    max_exact_devices: the exact search refuses larger pools.
    allow_colocated: HexGen-2 may return an all-colocated plan when it serves more (False: always
        disaggregated, as in the paper).
    objective: ``throughput`` (tokens/s at full load), ``goodput`` (requests/s meeting
        ``slo_ttft_s`` / ``slo_tpot_s``: capacities from ``planner.slo``) or ``cost`` (the cheapest
        subset of the pool whose plan serves ``rate`` requests/s within the SLOs; ``planner.objectives``).
    budget_usd_per_hour: use only devices costing at most this much per hour in total (the planner
        chooses which; ``planner.objectives``).
    engine: the engine the plan is for (``hetserve``, ``vllm``, ``sglang``): the layout search
        considers only the replica shapes it can run (``planner.layout.engines``).
    """

    seed: int = 0
    time_limit_s: float | None = None
    max_iterations: int | None = None
    patience: int | None = None
    restarts: int | None = None
    stall_iterations: int | None = None
    period_s: float = DEFAULT_PERIOD_S
    progress: Callable[[SearchProgress], None] | None = field(default=None, compare=False)
    efficiency: Efficiency | None = None
    max_exact_devices: int = 8
    allow_colocated: bool = True
    objective: str = "throughput"
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    rate: float | None = None  # requests/s the ``cost`` objective must serve
    budget_usd_per_hour: float | None = None
    engine: str = "hetserve"

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}, got {self.objective!r}")
        for k in ("slo_ttft_s", "slo_tpot_s", "rate", "budget_usd_per_hour"):
            v = getattr(self, k)
            if v is not None and not v > 0:
                raise ValueError(f"{k} must be positive, got {v}")
        if self.objective == "cost" and self.rate is None:
            raise ValueError("objective 'cost' needs a rate (requests/s) to serve")
        if self.time_limit_s is not None and self.time_limit_s <= 0:
            raise ValueError(f"time_limit_s must be positive, got {self.time_limit_s}")
        if self.max_iterations is not None and self.max_iterations < 1:
            raise ValueError(f"max_iterations must be at least 1, got {self.max_iterations}")
        if self.patience is not None and self.patience < 1:
            raise ValueError(f"patience must be at least 1, got {self.patience}")
        if self.stall_iterations is not None and self.stall_iterations < 1:
            raise ValueError(f"stall_iterations must be at least 1, got {self.stall_iterations}")
        if self.restarts is not None and self.restarts < 0:
            raise ValueError(f"restarts must be non-negative, got {self.restarts}")
        if self.period_s <= 0:
            raise ValueError(f"period_s must be positive, got {self.period_s}")
        if self.max_exact_devices < 1:
            raise ValueError("max_exact_devices must be at least 1")


DEFAULT_TIME_LIMIT_S = 110.0  # HexGen-2 on 320 GPUs converges in ~30–40 s of CPU on 2 cores (docs/planner.md)
# the search stops this share of the time limit early: what follows it (HexGen-2's colocated and mixed
# alternatives, every plan's upper bound) has the rest. Searching to the limit, `plan --time-limit 10`
# took 15.9 s on hexgen2-het1 and 18.6 s on hexgen-full-price (docs/planner.md)
FINAL_SHARE = 0.25
# a plan's upper bound (``planner.bound``) gets what is left of the time limit, and at least this share
# of it where the alternatives took the rest: on hexgen2-het1 the bound's MILP wants about a minute,
# which took `plan --time-limit 30` to 101 s; the solver stops where its time runs out (a looser bound).
# (A floor of 0.1 gave 33.2 s against 34.8 there, and a bound of 2,156 tokens/s against 2,116.)
BOUND_SHARE = 0.25
REST_MIN_SHARE = 0.02  # of the time limit, the least a search after the search gets (``Budget.rest``)


class Budget:
    """Clock, iteration count and best-value history of one search run.

    ``history`` holds ``(elapsed_s, best_tokens_per_s)`` after every iteration: the convergence
    curve. ``exhausted()`` (the search) and ``out_of_time()`` (what follows it) are where the
    clock is read against the limits.
    """

    def __init__(self, algorithm: str, options: PlanOptions, time_limit_s: float | None = None,
                 reserve: float = FINAL_SHARE):
        self.algorithm, self.options = algorithm, options
        self.time_limit_s = time_limit_s or options.time_limit_s or DEFAULT_TIME_LIMIT_S
        # the search's own limit: ``reserve`` of the time is kept for what runs after it
        self.search_limit_s = self.time_limit_s * (1.0 - reserve)
        self.start = time.perf_counter()
        self.iteration = 0
        self.best = 0.0
        self.history: list[tuple[float, float]] = []
        self.stopped_by = "converged"
        # tokens/s each kind of edit added to the current pool layout when it was accepted, keyed
        # by (phase, kind): phase "descent" = the first climb from the start, "restart" = climbs
        # after a random kick (the restarts' share of the gain)
        self.gains: dict[tuple[str, str], float] = {}
        self.accepted: dict[tuple[str, str], int] = {}
        self.start_value: float | None = None

    @property
    def elapsed_s(self) -> float:
        return time.perf_counter() - self.start

    def exhausted(self) -> bool:
        if self.options.max_iterations is not None and self.iteration >= self.options.max_iterations:
            self.stopped_by = "max_iterations"
            return True
        if self.elapsed_s >= self.search_limit_s:
            self.stopped_by = "time_limit"
            return True
        return False

    def out_of_time(self) -> bool:
        """The whole time limit is spent: what runs after the search stops at its next step."""
        return self.elapsed_s >= self.time_limit_s

    def rest(self, algorithm: str) -> "Budget":
        """A budget for a search run after this one (HexGen-2's colocated HexGen search): the time
        this one has left, nothing reserved; at least ``REST_MIN_SHARE`` of the limit, so that it
        finishes a first iteration."""
        return Budget(algorithm, self.options, time_limit_s=self._left_s(REST_MIN_SHARE), reserve=0.0)

    def bound_time_s(self) -> float:
        """Seconds the plan's upper bound may take (``BOUND_SHARE``)."""
        return self._left_s(BOUND_SHARE)

    def _left_s(self, at_least_share: float) -> float:
        """What is left of the time limit, and at least ``at_least_share`` of it."""
        return max(self.time_limit_s - self.elapsed_s, at_least_share * self.time_limit_s)

    def record(self, best_tokens_per_s: float) -> None:
        """Close one iteration: remember the best value so far and report progress."""
        self.iteration += 1
        self.best = max(self.best, best_tokens_per_s)
        t = self.elapsed_s
        self.history.append((t, self.best))
        if self.options.progress is not None:
            frac = t / self.search_limit_s
            if self.options.max_iterations:
                frac = max(frac, self.iteration / self.options.max_iterations)
            self.options.progress(SearchProgress(self.algorithm, self.iteration, t, self.best, min(1.0, frac)))

    def chose(self, tokens_per_s: float) -> None:
        """The step after the search picked a plan worth ``tokens_per_s``: a point on the best-so-far
        curve, not an iteration (``max_iterations`` caps the search's own iterations)."""
        self.best = max(self.best, tokens_per_s)
        self.history.append((self.elapsed_s, self.best))

    def credit(self, phase: str, kind: str, gain: float) -> None:
        """An accepted edit of ``kind`` raised the current pool layout by ``gain`` tokens/s."""
        key = (phase, kind)
        self.gains[key] = self.gains.get(key, 0.0) + gain
        self.accepted[key] = self.accepted.get(key, 0) + 1

    def summary(self) -> dict:
        """Search statistics for ``Plan.estimate['search']`` (the history goes to ``log``)."""
        return {"iterations": self.iteration, "wall_s": round(self.elapsed_s, 4), "stopped_by": self.stopped_by}

    def log(self, max_points: int = 2000) -> dict:
        """The search log (``Plan.search_log``, written by ``hetserve plan --history FILE``):
        best value over time (thinned to ``max_points``) and the gain of each kind of edit."""
        hist = self.history
        if len(hist) > max_points:
            step = len(hist) / max_points
            hist = [hist[int(i * step)] for i in range(max_points)] + [hist[-1]]
        out = {"algorithm": self.algorithm, **self.summary(),
               "history": [[round(t, 4), round(v, 3)] for t, v in hist]}
        if self.start_value is not None:
            out["start_tokens_per_s"] = round(self.start_value, 3)
        if self.gains:
            out["gains"] = [{"phase": ph, "kind": k, "accepted": self.accepted[(ph, k)],
                             "tokens_per_s": round(g, 3)}
                            for (ph, k), g in sorted(self.gains.items(), key=lambda x: -x[1])]
        return out
