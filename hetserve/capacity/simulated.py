"""Worker counts found by simulation (Aladdin §6.4): the fewest workers whose run attains the SLOs.

Builds pools of identical tensor-parallel workers of one GPU type, either all colocated (vLLM's
default continuous batching, Figure 11) or as decode workers behind a fixed, ample prefill pool
(split-phase, Figure 12: only decode GPUs are counted), plays the workload with the named
placement policy, and bisects the worker count (``min_workers``). A request attains the SLOs when
TTFT ≤ the TTFT target and ATGT (decode time per output token from joining the decode batch,
Aladdin §2.2) ≤ the ATGT target — for split-phase pools too, as the paper scores them.

Every policy is held to the same target and counted the same way: a fixed pool of n workers, the
fewest n that attains the target found by bisection. KV admission is paged (vLLM's, the paper's
engine) unless ``kv_admission="reserve"`` asks for the oracle reservation of each whole output.

Sits above the simulator (imports ``hetserve.sim``); the policies stay below it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Literal, Sequence

import numpy as np

from hetserve.capacity.config import homogeneous_cluster
from hetserve.capacity.workers import min_workers
from hetserve.cost.analytic import CostModel
from hetserve.planner.plan import KVRoute, Plan, PlanReplica, PlanStage
from hetserve.policies.base import ReplicaState, RequestInfo
from hetserve.specs.cluster import Cluster
from hetserve.specs.model import ModelSpec
from hetserve.specs.workload import SLO, Workload

Mode = Literal["colocated", "decode"]


class PlacementAsRoute:
    """Use a placement policy (eft, jsq, po2, aladdin, ...) to pick the decode replica of a KV hand-off."""

    def __init__(self, placement):
        self.placement = placement
        self.name = getattr(placement, "name", "placement")
        self.needs_requests = bool(getattr(placement, "needs_requests", False))

    def choose(self, request: RequestInfo, src: str, candidates: Sequence[tuple[ReplicaState, float]],
               now: float) -> str:
        return self.placement.choose(request, [r for r, _ in candidates], now)

    def on_finish(self, request_id: int, input_tokens: int, output_tokens: int) -> None:
        self.placement.on_finish(request_id, input_tokens, output_tokens)


@dataclass
class Pool:
    """A homogeneous pool and the plan that uses it."""

    cluster: Cluster
    plan: Plan
    worker_ids: list[str]  # the replicas whose count is being searched
    cost: CostModel = field(repr=False, default=None)


def build_pool(model: ModelSpec, gpu: str, workers: int, gpus_per_worker: int, mode: Mode = "colocated",
               prefill_workers: int = 0, per_machine: int = 4, intra: dict | None = None) -> Pool:
    """``workers`` TP groups of ``gpus_per_worker`` GPUs (plus ``prefill_workers`` prefill groups
    of the same size in ``decode`` mode), ``per_machine`` GPUs to a box so TP stays inside one."""
    g = gpus_per_worker
    if per_machine % g:
        raise ValueError("gpus_per_worker must divide per_machine so a worker stays in one box")
    total = (workers + prefill_workers) * g
    cluster = homogeneous_cluster(gpu, total, per_machine, intra)
    names = [d.name for d in cluster.devices]
    groups = [tuple(names[i * g:(i + 1) * g]) for i in range(workers + prefill_workers)]
    role = "colocated" if mode == "colocated" else "decode"
    reps = [PlanReplica(f"w{i}", role, (PlanStage(groups[i], (0, model.num_layers)),)) for i in range(workers)]
    routes = []
    if mode == "decode":
        for k in range(prefill_workers):
            reps.append(PlanReplica(f"p{k}", "prefill", (PlanStage(groups[workers + k], (0, model.num_layers)),)))
            routes += [KVRoute(f"p{k}", f"w{i}", 1.0 / workers) for i in range(workers)]
    plan = Plan(model.name, cluster.name, f"pool-{mode}", tuple(reps), tuple(routes))
    return Pool(cluster, plan, [f"w{i}" for i in range(workers)], CostModel(cluster, model))


def attainment(result, slo: SLO, decode_metric: str = "atgt") -> float:
    """Share of requests with TTFT and ATGT (or TPOT) within their targets (Aladdin's SLO).

    ATGT counts decode time from joining the decode batch (Aladdin's metric, also for split-phase);
    TPOT from the first token, so it also charges the KV hand-off and any wait for a decode
    worker's KV.
    """
    ok = np.isfinite(result.t_finish)
    if slo.ttft_s is not None:
        ok &= result.ttft <= slo.ttft_s
    if slo.tpot_s is not None:
        ok &= (result.atgt if decode_metric == "atgt" else result.tpot) <= slo.tpot_s
    return float(ok.mean()) if len(ok) else 1.0


PolicyMaker = Callable[[Pool], object]


def run_pool(model: ModelSpec, gpu: str, workload: Workload, slo: SLO, policy: str | PolicyMaker, workers: int,
             gpus_per_worker: int, mode: Mode = "colocated", prefill_workers: int = 0, per_machine: int = 4,
             intra: dict | None = None, predictor=None, kv_admission: str = "paged", prefill_mode: str | None = None):
    """One simulation of ``workload`` on a pool of ``workers`` workers; returns the ``SimResult``.
    ``kv_admission``: the simulator's KV admission mode ("reserve" or "paged", ``SimOptions``).
    ``prefill_mode``: how prompts meet decodes on a colocated worker (``SimOptions.prefill_mode``;
    None: the simulator's default, the runtime's "mixed")."""
    mode_opts = {} if prefill_mode is None else {"prefill_mode": prefill_mode}
    from hetserve.policies.placement import DEFAULT_PLACEMENT, PolicyContext, make_placement
    from hetserve.sim.simulator import SimOptions, simulate

    pool = build_pool(model, gpu, workers, gpus_per_worker, mode, prefill_workers, per_machine, intra)
    if callable(policy):
        pol = policy(pool)
    else:
        # the policy under test sees (and Aladdin fits performance models for) the counted workers only
        layouts = {r.id: r.layout(pool.cluster) for r in pool.plan.replicas if r.id in pool.worker_ids}
        pol = make_placement(policy, PolicyContext.for_plan(pool.plan, pool.cluster, model, workload, slo=slo,
                                                            cost=pool.cost, layouts=layouts))
    if mode == "colocated":
        opts = SimOptions(placement=pol, slo=slo, predictor=predictor, kv_admission=kv_admission, **mode_opts)
    else:  # the ample prefill pool in front gets the default placement; the policy picks decode workers
        opts = SimOptions(placement=DEFAULT_PLACEMENT, route=PlacementAsRoute(pol), slo=slo, predictor=predictor,
                          kv_admission=kv_admission, **mode_opts)
    return simulate(pool.plan, pool.cluster, model, workload, opts, pool.cost)


def workers_needed(model: ModelSpec, gpu: str, workload: Workload, slo: SLO, policy: str | PolicyMaker,
                   gpus_per_worker: int, mode: Mode = "colocated", target: float = 0.99,
                   prefill_workers: int = 0, per_machine: int = 4, intra: dict | None = None,
                   hint: int | None = None, predictor_factory=None, max_workers: int = 512,
                   decode_metric: str = "atgt", kv_admission: str = "paged", prefill_mode: str | None = None) -> int:
    """Fewest workers whose simulation attains ``target`` of the SLOs (O(log n) simulations).

    ``decode_metric``: "atgt" (Aladdin's, default) or "tpot". ``predictor_factory``: a fresh
    output-length predictor per simulation (None: the true lengths).
    Raises ``InfeasibleError`` if ``max_workers`` workers still miss the target.
    """
    metric = decode_metric

    def meets(n: int) -> bool:
        pred = predictor_factory() if predictor_factory else None
        res = run_pool(model, gpu, workload, slo, policy, n, gpus_per_worker, mode, prefill_workers,
                       per_machine, intra, pred, kv_admission, prefill_mode)
        return attainment(res, slo, metric) >= target

    return min_workers(meets, 1, hint, max_workers)


@dataclass(frozen=True)
class ShortTrace:
    """A simulated count below the fluid lower bound: the trace ended before its queue showed."""

    simulated: int  # what the simulation found
    bound: int  # the fluid lower bound, the least count that could serve the rate
    requests: int  # how many were simulated
    span_s: float  # how long the simulated arrivals last
    show_s: float  # how long a queue at ``simulated`` workers takes to add the TTFT target to the wait
    requests_needed: int  # a trace that spans several times ``show_s``


# A trace must span this many times the time the queue takes to show: a queue that shows only at
# its very end costs misses to too few requests to fail the attainment target.
SHOW_SPANS = 3


def short_trace(rate: float, simulated: int, bound: int, worker_rate: float, ttft_s: float | None,
                requests: int) -> ShortTrace | None:
    """None when ``simulated`` ≥ ``bound``; else why it fell below and how many requests would show it.

    Fewer workers than the fluid bound complete at most ``simulated · worker_rate`` < ``rate``
    requests/s, so their backlog, and with it the wait before a prompt starts, grows by
    ``rate / (simulated · worker_rate) − 1`` seconds per second of arrivals. It reaches the TTFT
    target (and requests start to miss) only after ``show_s``; a trace shorter than that attains
    the SLOs on a pool that cannot keep up. The suggestion is for ``simulated`` workers: a rerun
    whose count is still below the bound is checked again, with a longer trace asked for.
    """
    if simulated >= bound:
        return None
    span = requests / rate
    growth = rate / (simulated * worker_rate) - 1.0 if worker_rate > 0 else math.inf
    show = (ttft_s or 0.0) / growth if growth > 0 else math.inf
    if math.isfinite(show):
        need = math.ceil(SHOW_SPANS * show * rate / 500) * 500  # a round figure to pass as --requests
    else:
        need = 0
    return ShortTrace(simulated, bound, requests, span, show, max(need, 2 * requests))
