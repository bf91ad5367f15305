"""Exact search for small pools: the optimum the heuristics are measured against.

Devices of one class are interchangeable (``PlanContext``), so a pool layout is a multiset of
(class-count vector, role) parts whose vectors sum to at most the pool's; devices not covered stay
idle. ``exact`` enumerates every such multiset with at least one prefill and one decode part and
prices it with an ``Evaluator(exhaustive_layouts=True)``: every combination of the parts' layout
alternatives (``LayoutSearch.options``: the capacity-best layout and its KV-friendlier
variants) is solved, by branch and bound on min(Σ prefill, Σ decode) capacity; multisets whose
bound cannot beat the best so far are skipped. It then compares the best colocated pool layout
(``exact_colocated``'s knapsack) and returns the better, its note saying which — so it bounds
every algorithm here, ``hexgen2`` (which also weighs an all-colocated plan) included.
Mixed plans: the devices a disaggregated multiset leaves are cut into the colocated replicas that
serve most (the knapsack below; colocated capacity adds), so pool layouts mixing colocated and
prefill/decode replicas are covered too. Outside its space: layouts the per-group search does not
keep (its TP-split × layer-split × class-order candidates).

``exact_colocated`` is the colocated counterpart (HexGen's space): the value is additive, so it
is a knapsack over count vectors, solved by dynamic programming.

Pools above ``options.max_exact_devices`` (default 8) are refused. Worst case (8 devices, all in
different classes) is ~10⁵ multisets; pools with a few machines take well under a second.
"""

from __future__ import annotations

import itertools
from functools import lru_cache

from hetserve.errors import PlanError
from hetserve.planner.context import PlanContext
from hetserve.planner.pool.estimate import to_plan
from hetserve.planner.options import Budget, PlanOptions
from hetserve.planner.pool.evaluator import Evaluator, start_search
from hetserve.planner.pool.groups import Group, canonical
from hetserve.planner.plan import Plan
from hetserve.specs.cluster import Cluster
from hetserve.specs.model import ModelSpec
from hetserve.specs.workload import Workload


EXACT = ("exact", "exact-colocated")  # the searches that enumerate every placement (algorithms.py names)


def too_large(cluster, options: PlanOptions | None = None) -> str | None:
    """Why the exact searches refuse ``cluster`` (more devices than ``max_exact_devices``); None if they take it."""
    limit = (options or PlanOptions()).max_exact_devices
    if len(cluster) <= limit:
        return None
    return (f"the exact search enumerates every placement and is limited to {limit} devices; {cluster.name} "
            f"has {len(cluster)}")


def _setup(name: str, cluster, model, workload, options, exhaustive_layouts: bool = False):
    options = options or PlanOptions()
    why = too_large(cluster, options)
    if why:
        raise PlanError(f"{why} (use hexgen2, or raise PlanOptions.max_exact_devices)")
    return start_search(name, cluster, model, workload, options, exhaustive_layouts)


def _parts(ctx: PlanContext) -> list[tuple[int, ...]]:
    """Every non-zero class-count vector whose devices could hold the weights."""
    out = []
    for v in itertools.product(*(range(c + 1) for c in ctx.class_counts)):
        if any(v) and ctx.can_hold_weights(_devices(ctx, v, [0] * len(v))):
            out.append(v)
    return out


def _devices(ctx: PlanContext, v, offset) -> list[int]:
    return [d for k, n in enumerate(v) for d in ctx.classes[k][offset[k]:offset[k] + n]]


def _materialize(ctx: PlanContext, items) -> tuple[Group, ...]:
    offset = [0] * len(ctx.class_counts)
    groups = []
    for v, role in items:
        groups.append(Group.of(_devices(ctx, v, offset), role))
        offset = [o + n for o, n in zip(offset, v)]
    return canonical(groups)


def exact(cluster: Cluster, model: ModelSpec, workload: Workload, options: PlanOptions | None = None) -> Plan:
    """Optimal pool layout by enumeration (small pools only): the best of the best pool layout with
    prefill and decode groups (partitions × roles × per-group layout alternatives, the devices they
    leave cut into colocated replicas — mixed plans included) and the best all-colocated one."""
    ctx, budget, ev = _setup("exact", cluster, model, workload, options, exhaustive_layouts=True)
    col_v, col = _exact_colocated(ctx)
    best_v, best = _exact_disaggregated(ctx, budget, ev, mixed=ctx.options.allow_colocated)
    if budget.stopped_by == "converged":
        budget.stopped_by = "exhausted"
    if col and col_v > best_v * (1 + 1e-9):
        budget.chose(col_v)
        note = (f"colocated replicas serve {col_v:.0f} tokens/s, the best placement with prefill and decode "
                f"replicas {best_v:.0f}: colocated plan" if best is not None else
                "no prefill + decode pair fits: colocated plan")
        return to_plan(ctx, ev.evaluate(_materialize(ctx, [(v, "colocated") for v in col])), "exact", budget, notes=note)
    if best is None:
        raise ctx.no_replica_error()
    kind = "mixed" if any(g.role == "colocated" for g in best) else "disaggregated"
    note = f"{kind} {best_v:.0f} tokens/s ≥ colocated {col_v:.0f}: {kind} plan" if col else None
    return to_plan(ctx, ev.evaluate(best), "exact", budget, notes=note)


def _exact_disaggregated(ctx: PlanContext, budget: Budget, ev: Evaluator, mixed: bool = False):
    """(tokens/s, pool layout) of the best pool layout with ≥ 1 prefill and ≥ 1 decode group; with
    ``mixed``, the devices they leave are cut into the colocated replicas that serve most
    (``_colocated_dp``: colocated capacity is additive, so the best cut of the rest is exact)."""
    comp = lambda v: tuple((k, n) for k, n in enumerate(v) if n)  # noqa: E731
    items = []
    for v in _parts(ctx):
        for role in ("prefill", "decode"):
            c = ctx.layouts.choice(comp(v), role)
            if c is not None:
                items.append((v, role, c.capacity))
    items.sort(key=lambda x: (x[1], x[0]))
    best = [0.0, None]
    limit = ctx.class_counts
    rest = _colocated_dp(ctx) if mixed else (lambda left: (0.0, ()))

    def rec(start: int, left: list[int], chosen: list, cap_p: float, cap_d: float) -> None:
        if budget.exhausted():
            return
        col_cap, col_parts = rest(tuple(left))
        # min(Σ prefill, Σ decode) of best capacities bounds every layout choice (``Evaluator``)
        if cap_p > 0 and cap_d > 0 and ctx.tokens_per_s(min(cap_p, cap_d) + col_cap) > best[0] * (1 + 1e-9):
            pool = _materialize(ctx, [(v, r) for v, r, _ in chosen] + [(v, "colocated") for v in col_parts])
            value = ev.score(pool)
            if value > best[0] * (1 + 1e-9):
                best[0], best[1] = value, pool
            budget.record(best[0])
        for i in range(start, len(items)):
            v, role, cap = items[i]
            if all(n <= m for n, m in zip(v, left)):
                chosen.append(items[i])
                rec(i, [m - n for n, m in zip(v, left)], chosen,
                    cap_p + (cap if role == "prefill" else 0.0), cap_d + (cap if role == "decode" else 0.0))
                chosen.pop()

    rec(0, list(limit), [], 0.0, 0.0)
    return best[0], best[1]


def _colocated_dp(ctx: PlanContext):
    """``left`` class-count vector → (requests per T, vectors) of the best colocated cut (knapsack)."""
    parts = []
    for v in _parts(ctx):
        c = ctx.layouts.choice(tuple((k, n) for k, n in enumerate(v) if n), "colocated")
        if c is not None:
            parts.append((v, c.capacity))

    @lru_cache(maxsize=None)
    def best(left: tuple[int, ...]) -> tuple[float, tuple]:
        out: tuple[float, tuple] = (0.0, ())
        for v, cap in parts:
            if all(n <= m for n, m in zip(v, left)):
                sub = best(tuple(m - n for n, m in zip(v, left)))
                if cap + sub[0] > out[0] * (1 + 1e-12):
                    out = (cap + sub[0], (v,) + sub[1])
        return out

    return best


def _exact_colocated(ctx: PlanContext) -> tuple[float, tuple]:
    """(tokens/s, class-count vectors) of the best colocated pool layout: a knapsack DP."""
    value, chosen = _colocated_dp(ctx)(ctx.class_counts)
    return ctx.tokens_per_s(value), chosen


def exact_colocated(cluster: Cluster, model: ModelSpec, workload: Workload,
                    options: PlanOptions | None = None) -> Plan:
    """Optimal colocated pool layout: knapsack DP over class-count vectors (small pools only)."""
    ctx, budget, ev = _setup("exact-colocated", cluster, model, workload, options)
    value, chosen = _exact_colocated(ctx)
    if not chosen:
        raise ctx.no_replica_error()
    budget.record(value)
    if budget.stopped_by == "converged":
        budget.stopped_by = "exhausted"
    return to_plan(ctx, ev.evaluate(_materialize(ctx, [(v, "colocated") for v in chosen])), "exact-colocated", budget)
