"""What to plan for: a budget in $/h, or the cheapest subset of the pool that serves a rate.

Both choose *which* devices to use, then run the algorithm on that subset
(``Cluster.subset``: device names stay those of the pool, so the plan reads against it):

* ``within_budget`` (``PlanOptions.budget_usd_per_hour``): candidate subsets costing at most the
  budget come from the per-device LP with a budget row (``bound.per_device_bound``; which GPU
  kinds to rent, fractionally — a heuristic guide here, not a bound: it undercounts colocated
  replicas' throughput), rounded down and topped up greedily by value per dollar, plus a
  greedy-by-value subset and the LP's kinds filled whole machines first; the algorithm runs on
  each (the time limit shared out) and the best plan by the objective is kept. A plan never
  costs more than the budget: every candidate is checked before it is searched.
* ``cheapest`` (``objective="cost"``, ``PlanOptions.rate``): ``min_cost`` (the smallest budget at
  which the upper bound reaches the rate) is a lower bound on the answer; budgets rise from it
  (×1.1, or by one device of the cheapest kind) until the plan's estimate serves the rate at
  ``TARGET_LOAD`` (the margin that keeps queues short; with SLOs the capacities are already
  SLO-aware, ``planner.slo``).

The plan's estimate says so: ``budget_usd_per_hour``, ``rate_requests_per_s``,
``min_cost_bound_usd_per_hour``, and the upper bound of the budget problem on the whole pool.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable

from hetserve.errors import InfeasibleError, PlanError
from hetserve.planner.bound.throughput import device_rates, per_device_bound, upper_bound
from hetserve.planner.bound.min_cost import min_cost
from hetserve.planner.context import PlanContext
from hetserve.planner.options import DEFAULT_TIME_LIMIT_S, Budget, PlanOptions
from hetserve.planner.plan import Plan
from hetserve.specs.gpus import fmt_gb

# The cost objective sizes for rate / TARGET_LOAD. The SLO capacities are mean-based estimates
# (``planner.slo``); in the simulator a colocated plan on hexgen2-het1 sized at 68 % of its
# estimated goodput met TTFT ≤ 2 s / TPOT ≤ 0.1 s for 82 % of requests, at 49 % for 96 %
# (azure-conv, 300 requests): 70 % keeps the tail inside the SLO.
TARGET_LOAD = 0.7
MAX_BUDGET_STEPS = 14


def served_requests_per_s(plan: Plan) -> float:
    """Requests/s the plan's estimate serves (within the SLOs when the plan was made for them)."""
    e = plan.estimate
    return e.get("requests_per_period", 0.0) / e.get("period_s", 600.0)


def _value(plan: Plan) -> float:
    return plan.estimate.get("throughput_tokens_per_s", 0.0)


def _kind_devices(cluster) -> dict[tuple[str, str], list[int]]:
    """Devices of each kind (GPU type, site), whole machines first (largest first), so a
    subset keeps TP groups inside one machine."""
    by_machine: dict[tuple[str, str], dict[str, list[int]]] = {}
    for d in cluster.devices:
        by_machine.setdefault((d.gpu.name, d.site), {}).setdefault(d.machine, []).append(d.index)
    return {k: [i for m in sorted(ms.values(), key=lambda x: (-len(x), x[0])) for i in m]
            for k, ms in by_machine.items()}


def _prices(cluster) -> dict[tuple[str, str], float]:
    out = {}
    for d in cluster.devices:
        if d.gpu.usd_per_hour is None:
            raise PlanError(f"--budget-usd-per-hour / --objective cost need GPU prices; {d.gpu.name} "
                            f"({d.name}) has none in the GPU table: give one with gpu_usd_per_hour on its "
                            f"machine in the cluster file (docs/design.md)")
        out[(d.gpu.name, d.site)] = float(d.gpu.usd_per_hour)
    return out


def budget_subsets(ctx: PlanContext, budget: float) -> list[list[int]]:
    """Candidate device subsets costing at most ``budget`` (see the module docstring)."""
    cluster = ctx.cluster
    prices = _prices(cluster)
    pool = _kind_devices(cluster)
    rates = device_rates(ctx)
    per_dollar = sorted(pool, key=lambda k: (-rates[k] / prices[k], k))
    lp = per_device_bound(ctx, budget)  # a heuristic guide (milliseconds), not a bound: module docstring
    want: dict[tuple[str, str], float] = {}
    for (gpu, site, _), n in lp.counts.items():
        want[(gpu, site)] = want.get((gpu, site), 0.0) + n

    def fill(counts: dict, order) -> dict:
        counts = dict(counts)
        left = budget - sum(prices[k] * n for k, n in counts.items())
        for k in order:
            add = min(len(pool[k]) - counts.get(k, 0), int((left + 1e-9) // prices[k]))
            if add > 0:
                counts[k] = counts.get(k, 0) + add
                left -= add * prices[k]
        return counts

    floor = {k: int(math.floor(n + 1e-6)) for k, n in want.items()}
    by_lp = sorted(want, key=lambda k: (-want[k], k))
    cands = [fill(floor, per_dollar), fill({}, per_dollar), fill(floor, by_lp + per_dollar)]
    # whole machines of the LP's kinds: round each kind down to machine multiples
    machines = {}
    for d in cluster.devices:
        machines.setdefault((d.gpu.name, d.site), {}).setdefault(d.machine, 0)
        machines[(d.gpu.name, d.site)][d.machine] += 1
    whole = {}
    for k, n in floor.items():
        sizes = sorted(machines[k].values(), reverse=True)
        take = 0
        for s in sizes:
            if take + s <= n:
                take += s
        if take:
            whole[k] = take
    cands.append(fill(whole, per_dollar))
    out, seen = [], set()
    for counts in cands:
        idx = sorted(i for k, n in counts.items() for i in pool[k][:n])
        key = tuple(idx)
        cost = sum(prices[(cluster.devices[i].gpu.name, cluster.devices[i].site)] for i in idx)
        if idx and key not in seen and cost <= budget + 1e-9 and ctx.can_hold_weights(idx):
            seen.add(key)
            out.append(idx)
    return out


def within_budget(fn: Callable[..., Plan], cluster, model, workload, options: PlanOptions) -> Plan:
    """The best plan of ``fn`` on a subset of ``cluster`` costing at most the budget."""
    budget = options.budget_usd_per_hour
    assert budget is not None
    clock = Budget("within_budget", options)  # the whole call's time limit, the bound's share at the end
    ctx = PlanContext(cluster, model, workload, options)
    total = cluster.usd_per_hour()
    if total is None:
        _prices(cluster)  # raises with the device that has no price
    inner = dataclasses.replace(options, budget_usd_per_hour=None,
                                objective="goodput" if options.objective == "cost" else options.objective)
    if total <= budget + 1e-9:
        subsets = [list(range(len(cluster)))]
    else:
        subsets = budget_subsets(ctx, budget)
    if not subsets:
        cheapest = min(d.gpu.usd_per_hour or 0.0 for d in cluster.devices)
        raise InfeasibleError(f"no subset of {cluster.name} within ${budget:,.2f}/h can hold {model.name}'s "
                              f"weights (cheapest GPU ${cheapest:,.2f}/h, {fmt_gb(model.weight_bytes)} of weights)")
    limit = (options.time_limit_s or DEFAULT_TIME_LIMIT_S) / len(subsets)
    best = None
    for idx in subsets:
        sub = cluster.subset(idx)
        try:
            plan = fn(sub, model, workload, dataclasses.replace(inner, time_limit_s=limit))
        except InfeasibleError:
            continue
        if best is None or _value(plan) > _value(best) * (1 + 1e-9):
            best = plan
    if best is None:
        raise InfeasibleError(f"no subset of {cluster.name} within ${budget:,.2f}/h found a pipeline layout "
                              f"for {model.name}")
    bound = upper_bound(ctx, budget, time_limit_s=clock.bound_time_s())
    best.estimate.update({"budget_usd_per_hour": budget, "devices_total": len(cluster),
                          "upper_bound_tokens_per_s": round(bound.tokens_per_s, 3),
                          "upper_bound_wall_s": round(bound.wall_s, 3)})
    best.estimate.pop("upper_bound_cut_short", None)  # the subset's bound's flag: this bound's below
    if bound.cut_short:
        best.estimate["upper_bound_cut_short"] = True
    return best


def cheapest(fn: Callable[..., Plan], cluster, model, workload, options: PlanOptions) -> Plan:
    """The cheapest plan found whose estimate serves ``options.rate`` requests/s (see above)."""
    rate = options.rate
    assert rate is not None
    prices = _prices(cluster)
    ctx = PlanContext(cluster, model, workload, options)
    ctx.check_feasible()
    need = rate / TARGET_LOAD * ctx.period_s  # requests per T
    lower = min_cost(ctx, need)
    if lower is None:
        whole = upper_bound(ctx)
        raise InfeasibleError(
            f"{cluster.name} cannot serve {rate:g} requests/s of {workload.name} with {model.name}"
            f"{' within the SLOs' if ctx.slo else ''}: even its upper bound is "
            f"{whole.requests_per_period / ctx.period_s * TARGET_LOAD:.3g} requests/s at {TARGET_LOAD:.0%} load")
    floor_usd = lower[0]
    step = min(prices.values())
    budget = max(floor_usd, step)
    total = cluster.usd_per_hour() or 0.0
    tried = []
    for _ in range(MAX_BUDGET_STEPS):
        b = min(budget, total)
        try:
            plan = within_budget(fn, cluster, model, workload, dataclasses.replace(options, budget_usd_per_hour=b))
        except InfeasibleError:
            plan = None
        if plan is not None:
            tried.append((b, served_requests_per_s(plan)))
            if served_requests_per_s(plan) * TARGET_LOAD >= rate * (1 - 1e-9):
                plan.estimate.update({"objective": "cost", "rate_requests_per_s": rate,
                                      "min_cost_bound_usd_per_hour": round(floor_usd, 4),
                                      "budgets_tried": [[round(x, 3), round(y, 4)] for x, y in tried]})
                return plan
        if b >= total:
            break
        budget = max(budget * 1.1, budget + step)
    best = max((y for _, y in tried), default=0.0)
    raise InfeasibleError(
        f"no plan on {cluster.name} serves {rate:g} requests/s at {TARGET_LOAD:.0%} load: the best found serves "
        f"{best * TARGET_LOAD:.3g} (budgets tried up to ${min(budget, total):,.2f}/h)")


def plan_for(fn: Callable[..., Plan], cluster, model, workload, options: PlanOptions) -> Plan:
    """Run ``fn`` for ``options``' objective and budget (plain ``fn`` when neither applies). Where a
    budget or the cost objective runs ``fn`` more than once (a search per device subset, per budget
    tried), the whole search's time and the inner searches it ran go in
    ``estimate['objective_search']``: the estimate's ``search`` is the chosen inner plan's alone."""
    if options.objective == "cost":
        search = cheapest
    elif options.budget_usd_per_hour is not None:
        search = within_budget
    else:
        return fn(cluster, model, workload, options)
    runs = 0

    def counted(*args, **kwargs) -> Plan:
        nonlocal runs
        runs += 1
        return fn(*args, **kwargs)

    start = time.perf_counter()
    plan = search(counted, cluster, model, workload, options)
    plan.estimate["objective_search"] = {"wall_s": round(time.perf_counter() - start, 3), "inner_plans": runs}
    return plan
