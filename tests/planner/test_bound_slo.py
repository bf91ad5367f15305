"""Bounds under SLO objectives and the cost floor (planner/bound/throughput.py, planner/bound/min_cost.py, planner/slo.py):
goodput is bounded by the group programme without SLOs, and ``min_cost`` is a floor on the
price where the per-device LP's minimum price is not."""

import pytest

from bench.lib.exact_pools import island
from hetserve.cost.layout import ReplicaLayout, StageLayout
from hetserve.planner import ALGORITHMS, PlanOptions, plan
from hetserve.planner.bound import throughput as bound
from hetserve.planner.context import PlanContext
from hetserve.planner.bound.min_cost import min_cost
from hetserve.planner.objectives import TARGET_LOAD, served_requests_per_s
from hetserve.planner.slo import SLOTargets, slo_capacity
from hetserve.specs.cluster import cluster_from_dict, load_cluster


def _h100_a100():
    return cluster_from_dict({"name": "h100-a100", "machines": [
        {"name": "h0", "gpu": "H100-SXM-80G", "count": 4, "site": "a"},
        {"name": "a0", "gpu": "A100-SXM-80G", "count": 2, "site": "b"}],
        "network": {"intra_site": {"bandwidth_gbps": 10, "latency_ms": 0.5},
                    "inter_site": {"bandwidth_gbps": 3, "latency_ms": 15}}})


def test_slo_capacity_never_exceeds_the_throughput_capacity(llama70b, azure):
    """The SLO model prices a colocated request as a stand-alone TTFT plus its decode steps; on
    this pipeline that came out above the cost model's mixed steady state (1,404 against 1,397
    requests per T) until ``slo_capacity`` was capped by it. The group bound without SLOs rests on it."""
    ctx = PlanContext(_h100_a100(), llama70b, azure)
    i, o, T = ctx.input_tokens, ctx.output_tokens, ctx.period_s
    loose = SLOTargets(ttft_s=1e12)  # the largest SLO capacity: the whole batch, no queueing cap
    n = 0
    for cut in (30, 40, 50):
        lay = ReplicaLayout((StageLayout((4, 5), (0, cut)), StageLayout((0, 1, 2, 3), (cut, 80))))
        if not ctx.cost.fits(lay):
            continue
        n += 1
        full = {"prefill": ctx.cost.prefill_capacity(lay, i, T), "decode": ctx.cost.decode_capacity(lay, i, o, T),
                "colocated": ctx.cost.colocated_capacity(lay, i, o, T)}
        for role, cap in full.items():
            assert 0 < slo_capacity(ctx.cost, lay, role, i, o, T, loose) <= cap * (1 + 1e-12), (cut, role)
    assert n == 3


@pytest.mark.parametrize("pool,model", [("aladdin-v100", "llama-2-7b"), ("island", "llama-2-7b")])
@pytest.mark.parametrize("slo", [(1e3, 1e3), (2.0, 0.1)])
def test_goodput_stays_under_the_bound(pool, model, slo, azure):
    """Exact search's goodput plans stay under ``upper_bound`` under SLOs (loose ones: colocated
    replicas at their whole batch), which is never above the programme without SLOs."""
    from hetserve.specs.model import load_model

    c = island("A100-SXM-80G", 4, "L4", 2) if pool == "island" else load_cluster(pool)
    m = load_model(model)
    opts = PlanOptions(seed=0, objective="goodput", slo_ttft_s=slo[0], slo_tpot_s=slo[1])
    x = ALGORITHMS["exact"](c, m, azure, opts)
    ctx = PlanContext(c, m, azure, opts)
    ub = bound.upper_bound(ctx)
    assert x.estimate["throughput_tokens_per_s"] <= ub.tokens_per_s * (1 + 1e-6)
    assert x.estimate["upper_bound_tokens_per_s"] == pytest.approx(ub.tokens_per_s, abs=1e-3)
    assert ub.tokens_per_s <= bound.group_bound(ctx.without_slo()).tokens_per_s * (1 + 1e-12)


def test_goodput_bound_uses_the_group_programme(case_study, llama70b, azure):
    """On HexGen-2's case-study pool the per-device LP (what upper_bound returned under SLOs before)
    is far above the group programme without SLOs; the bound is the latter, and a goodput plan stays under it."""
    c = case_study
    opts = PlanOptions(seed=0, max_iterations=4, objective="goodput", slo_ttft_s=2.0, slo_tpot_s=0.1)
    ctx = PlanContext(c, llama70b, azure, opts)
    free = bound.group_bound(ctx.without_slo())
    lp = bound.per_device_bound(ctx)
    ub = bound.upper_bound(ctx)
    assert ub.requests_per_period == free.requests_per_period < 0.8 * lp.requests_per_period
    p = ALGORITHMS["hexgen2"](c, llama70b, azure, opts)
    assert p.estimate["throughput_tokens_per_s"] <= ub.tokens_per_s * (1 + 1e-9)


def test_min_cost_is_a_floor_where_the_per_device_lp_is_not(llama7b, azure, roofline):
    """Exact's all-colocated plan on the island pool serves more than the per-device LP allows
    (the LP calls its rate impossible); ``min_cost`` stays at or below what that plan costs."""
    c = island("A100-SXM-80G", 4, "L4", 2)
    x = ALGORITHMS["exact"](c, llama7b, azure, PlanOptions(seed=0)).estimate
    ctx = PlanContext(c, llama7b, azure)
    need = x["requests_per_period"]
    assert bound.per_device_min_cost(ctx, need) is None
    floor = min_cost(ctx, need)
    assert floor is not None and 0 < floor[0] <= x["cost_usd_per_hour"]
    half = min_cost(ctx, need / 2)[0]
    assert 0 < half < floor[0]
    assert min_cost(ctx, 2 * bound.upper_bound(ctx).requests_per_period) is None


def test_cost_objective_serves_a_rate_the_per_device_lp_calls_impossible(llama7b, azure):
    """The cost objective without SLOs on the island pool, at a rate only colocated replicas reach:
    the old LP floor refused it outright; now the plan serves it and its floor is below its price."""
    c = island("A100-SXM-80G", 4, "L4", 2)
    x = ALGORITHMS["exact"](c, llama7b, azure, PlanOptions(seed=0)).estimate
    rate = 0.95 * x["requests_per_period"] / x["period_s"] * TARGET_LOAD
    p = plan(c, llama7b, azure, "exact", PlanOptions(seed=0, objective="cost", rate=rate))
    e = p.estimate
    assert served_requests_per_s(p) * TARGET_LOAD >= rate * (1 - 1e-9)
    assert 0 < e["min_cost_bound_usd_per_hour"] <= e["cost_usd_per_hour"] <= c.usd_per_hour() + 1e-9
