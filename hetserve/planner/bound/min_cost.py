"""A lower bound on what a device set serving a rate costs (``objective="cost"``'s floor).

The smallest budget at which ``bound.upper_bound`` (the group programme with its budget row;
under SLOs also the per-device LP) reaches the rate, found by bisection on the budget. Every
budget B whose bound falls short proves that no plan costing at most B serves the rate (such a
plan would be a point of the programme with the budget row), so the largest such B found is a
lower bound on the price, whether or not the bound is monotone in B (the MILP's dual bound at a
node limit need not be). Under SLOs the per-device LP's own minimum price is a floor too (the LP
holds there), so the bisection starts from it; for throughput capacities it is none: on the
island pool 4×A100 + 2×L4 with llama-2-7b it said no subset serves the rate of exact's plan.
"""

from __future__ import annotations

from hetserve.planner.bound.throughput import per_device_min_cost, upper_bound

TOLERANCE = 0.03  # bisection stops when the budget proven short and one proven enough are this close
MAX_PROBES = 10  # budgeted bounds solved at most per call (0.1–2 s each for the group programme on
# het1 below half its price, 8–15 s near the whole pool)


def min_cost(ctx, requests_per_period: float, devices=None) -> tuple[float, dict] | None:
    """(usd per hour no plan serving ``requests_per_period`` on ``ctx``'s pool, or on only
    ``devices``, can undercut; the bound's device counts at the cheapest budget found to reach
    the rate), or None when even the whole pool's bound cannot serve that much."""
    whole = upper_bound(ctx, None, devices)
    if whole.requests_per_period < requests_per_period:
        return None
    idx = range(len(ctx.cluster)) if devices is None else devices
    lo, hi = 0.0, float(sum(ctx.cluster.devices[i].gpu.usd_per_hour or 0.0 for i in idx))
    counts = whole.counts
    if ctx.slo is not None:
        floor = per_device_min_cost(ctx, requests_per_period, devices)
        if floor is None:
            return None
        lo, counts = min(floor[0], hi), floor[1]
    # the first probe where the bound would reach the rate if it grew in proportion to the
    # budget; budgets double while they fall short (whole replicas make small budgets serve
    # nothing, so the answer is often above that guess), then the gap is halved
    b = hi * requests_per_period / whole.requests_per_period if whole.requests_per_period > 0 else hi
    enough_found = False
    for _ in range(MAX_PROBES):
        if hi - lo <= TOLERANCE * hi:
            break
        if not lo < b < hi:
            b = (lo + hi) / 2
        got = upper_bound(ctx, b, devices)
        if got.requests_per_period < requests_per_period:
            lo = b
            b = 2 * b if not enough_found else (lo + hi) / 2
        else:
            hi, counts, enough_found = b, got.counts, True
            b = (lo + hi) / 2
    return lo, counts
