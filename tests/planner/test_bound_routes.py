"""KV routes summed by site (planner/bound/routes.py) give the bounds the same optimum as routes
per machine pair: the site sums are an exact reformulation, not a looser relaxation."""

import numpy as np
import pytest
from scipy.optimize import linprog

from hetserve.planner.bound import groups as bound_groups
from hetserve.planner.bound import routes
from hetserve.planner.bound import throughput as bound
from hetserve.planner.bound.devices import device_kinds, role_rates
from hetserve.planner.bound.rows import Rows
from hetserve.planner.context import PlanContext
from hetserve.planner.options import PlanOptions
from hetserve.specs.cluster import cluster_from_dict


def _sites_pool(nics=None):
    """Three sites of three 8-GPU boxes; NICs (one per machine where ``nics`` gives them) and
    pipes narrow enough to bind; too many compositions for machine columns (the group programme
    takes GPU types, whose KV rows are the ones summed by site)."""
    machines = [{"name": f"m{i}", "gpu": ("H100-SXM-80G", "A100-SXM-80G", "L40")[i // 3], "count": 8,
                 "site": f"s{i // 3}"} for i in range(9)]
    for m, gbps in zip(machines, nics or ()):
        m["nic"] = {"bandwidth_gbps": gbps, "latency_ms": 0.5}
    return cluster_from_dict({"name": "sites", "machines": machines, "network": {
        "intra_site": {"bandwidth_gbps": 20, "latency_ms": 0.5},
        "inter_site": {"bandwidth_gbps": 2, "latency_ms": 20},
        "links": [{"between": ["s0", "s1"], "bandwidth_gbps": 0.5, "latency_ms": 20}]}})


def _per_pair(monkeypatch):
    monkeypatch.setattr(routes, "sums_by_site", lambda topology: False)


def _transport(ctx, supply, demand) -> float:
    """Max KV flow from machines' supplies to machines' demands over ``RouteVars``' routes."""
    kinds = device_kinds(ctx)
    machines = sorted({k.machine for k in kinds})
    r = routes.RouteVars(ctx, kinds, machines, 0)
    row = Rows(r.nv)
    for m in machines:
        row(r.leaving(m), supply[m], f"supply {m}")
        row(r.reaching(m), demand[m], f"demand {m}")
    r.rows(row)
    obj = np.zeros(r.nv)
    obj[list(r.all())] = -1.0
    res = linprog(obj, A_ub=row.sparse(), b_ub=row.rhs, bounds=(0, None), method="highs")
    assert res.status == 0
    return -res.fun


def test_routes_by_site_carry_what_routes_by_pair_carry(llama7b, azure, monkeypatch):
    """A transport over random NICs, supplies and demands (sources and sinks on distinct machines,
    so every unit crosses NICs, and pipes where sites differ): the same maximum both ways."""
    rng = np.random.default_rng(0)
    for trial in range(6):
        ctx = PlanContext(_sites_pool(list(rng.uniform(1, 40, 9))), llama7b, azure, PlanOptions())
        unit = 20e9 / 8 * ctx.period_s / (ctx.input_tokens * ctx.model.kv_bytes_per_token)  # a 20 Gbit/s NIC's flow
        names = [f"m{i}" for i in range(9)]
        source = rng.random(9) < 0.5
        supply = {m: float(rng.uniform(0, 2) * unit) if s else 0.0 for m, s in zip(names, source)}
        demand = {m: 0.0 if s else float(rng.uniform(0, 2) * unit) for m, s in zip(names, source)}
        by_site = _transport(ctx, supply, demand)
        with monkeypatch.context() as mp:
            _per_pair(mp)
            by_pair = _transport(ctx, supply, demand)
        assert by_site == pytest.approx(by_pair, rel=1e-6)
        assert by_site < min(sum(supply.values()), sum(demand.values())) * 0.99  # the network binds


@pytest.fixture(scope="module")
def ctx(llama7b, azure):
    return PlanContext(_sites_pool(), llama7b, azure, PlanOptions())


def test_the_per_device_lp_is_the_same_by_site_and_by_pair(ctx, monkeypatch):
    by_site = bound.per_device_bound(ctx)
    _per_pair(monkeypatch)
    assert by_site.tokens_per_s == pytest.approx(bound.per_device_bound(ctx).tokens_per_s, rel=1e-6)


def test_the_group_programmes_relaxation_is_the_same_by_site_and_by_pair(ctx, monkeypatch):
    mk = device_kinds(ctx)
    cols = bound_groups.columns(ctx, mk)
    assert not cols.machine_kinds  # GPU-type columns: the loose KV rows, the ones summed by site
    rates = [role_rates(ctx, k) for k in mk]

    def relaxation():
        return bound_groups.solve(ctx, mk, rates, cols, None, 1, 30.0)[0]

    by_site = relaxation()
    _per_pair(monkeypatch)
    assert by_site == pytest.approx(relaxation(), rel=1e-6)


def test_dedicated_machine_links_keep_routes_per_pair(llama7b, azure):
    c = cluster_from_dict({"name": "linked", "machines": [
        {"name": "a", "gpu": "L4", "count": 2, "site": "x"}, {"name": "b", "gpu": "L4", "count": 2, "site": "y"}],
        "network": {"intra_site": {"bandwidth_gbps": 10, "latency_ms": 0.5},
                    "inter_site": {"bandwidth_gbps": 1, "latency_ms": 20},
                    "links": [{"between": ["a", "b"], "bandwidth_gbps": 5, "latency_ms": 5}]}})
    ctx = PlanContext(c, llama7b, azure, PlanOptions())
    r = routes.RouteVars(ctx, device_kinds(ctx), ["a", "b"], 0)
    assert not r.by_site and len(r.iu) == 4
