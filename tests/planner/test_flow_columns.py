"""The max flow with capacity nodes solved by column generation (``flow_lp.solve_programme`` past
``RESTRICT_COLUMNS``) is the whole programme's optimum:

* the same value as the whole programme solved at once, with a feasible flow;
* prices feasible for every column (no column outside the restricted set could add flow), so the
  weak-duality bound the search prunes with (``flow.dual_bound``) is that value;
* programmes at or below the threshold are solved whole, exactly as before.
"""

import math
import random

import numpy as np
import pytest

from hetserve.planner.pool import flow_lp
from hetserve.planner.pool.flow import FlowNetwork, dual_bound, resource_loads, solve_with_resources


def _sites_network(seed: int) -> FlowNetwork:
    """Groups spread over four sites: wide KV columns inside a site, narrow ones across that load
    the pipe between the sites and both groups' NICs; colocated groups load their NICs too."""
    rng = random.Random(seed)
    site = {g: g % 4 for g in range(60)}
    pre, dec, col = list(range(0, 60, 3)), [g for g in range(60) if g % 3 == 1], [g for g in range(60) if g % 3 == 2][:6]
    cap: dict[str, float] = {f"nic:{g}": rng.uniform(2e9, 6e9) for g in range(60)}
    cap |= {f"pipe:{a}>{b}": rng.uniform(1e9, 3e9) for a in range(4) for b in range(4) if a != b}
    net = FlowNetwork(pre, dec, {g: rng.uniform(20, 60) for g in pre + dec + col}, {}, colocated=col,
                      resource_cap=cap)
    for p in pre:
        for d in dec:
            kv = rng.uniform(2e7, 6e7)
            if site[p] == site[d]:
                net.edge_cap[(p, d)] = rng.uniform(30, 80)
                net.edge_load[(p, d)] = {f"nic:{p}": kv, f"nic:{d}": kv}
            else:
                net.edge_cap[(p, d)] = rng.uniform(1, 4)
                net.edge_load[(p, d)] = {f"nic:{p}": kv, f"nic:{d}": kv, f"pipe:{site[p]}>{site[d]}": kv}
    for g in pre + dec + col:
        net.node_load[g] = {f"nic:{g}": rng.uniform(1e6, 1e8)}
    return net


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_column_generation_finds_the_whole_programmes_optimum(seed, monkeypatch):
    net = _sites_network(seed)
    whole = solve_with_resources(net)
    monkeypatch.setattr(flow_lp, "RESTRICT_COLUMNS", 0)
    monkeypatch.setattr(flow_lp, "SEED_COLUMNS", 1)  # a seed far short of the optimum's columns
    restricted = solve_with_resources(net)
    assert restricted.total == pytest.approx(whole.total, rel=1e-9)
    # the seed alone serves less: the optimum needed columns the pricing added
    lp = flow_lp.build_programme(net, [(p, d) for p in net.prefill for d in net.decode])
    seed_only = _seed_value(lp, len(net.prefill), len(net.decode))
    assert seed_only < whole.total * (1 - 1e-3)
    # a feasible flow: node, edge and resource capacities hold
    for g, f in restricted.node_flow.items():
        assert f <= net.node_cap[g] * (1 + 1e-9)
    for e, f in restricted.edge_flow.items():
        assert -1e-9 <= f <= net.edge_cap[e] * (1 + 1e-9)
    for r, v in resource_loads(net, restricted).items():
        assert v <= net.resource_cap[r] * (1 + 1e-9)
    # its prices are dual feasible for every column: weak duality gives back the optimum
    bound = dual_bound(net, restricted.node_dual, restricted.resource_dual)
    assert bound == pytest.approx(whole.total, rel=1e-7)
    assert bound >= whole.total * (1 - 1e-9)


def _seed_value(lp, P: int, D: int) -> float:
    """The restricted programme's optimum over the seed columns alone (no pricing round)."""
    from scipy.optimize import linprog

    upper = np.array([b[1] for b in lp.bounds])
    widest = np.argsort(-upper[:P * D].reshape(P, D), axis=1, kind="stable")[:, :1]
    chosen = np.zeros(len(upper), dtype=bool)
    chosen[P * D:] = True
    chosen[(np.arange(P)[:, None] * D + widest).ravel()] = True
    widest = np.argsort(-upper[:P * D].reshape(P, D), axis=0, kind="stable")[:1, :]
    chosen[(widest * D + np.arange(D)[None, :]).ravel()] = True
    idx = np.flatnonzero(chosen)
    res = linprog(-np.ones(len(idx)), A_ub=lp.matrix.tocsc()[:, idx], b_ub=lp.rhs,
                  bounds=np.column_stack((np.zeros(len(idx)), upper[idx])), method="highs")
    return -res.fun


def test_a_programme_at_the_threshold_is_solved_whole(monkeypatch):
    """At or below ``RESTRICT_COLUMNS`` the flow is the whole programme's, route for route."""
    from scipy.optimize import linprog

    net = _sites_network(4)
    lp = flow_lp.build_programme(net, [(p, d) for p in net.prefill for d in net.decode])
    monkeypatch.setattr(flow_lp, "RESTRICT_COLUMNS", lp.matrix.shape[1])
    got = solve_with_resources(net)
    res = linprog(-np.ones(lp.matrix.shape[1]), A_ub=lp.matrix, b_ub=lp.rhs, bounds=lp.bounds, method="highs")
    x = np.maximum(res.x, 0.0)
    edges = [(p, d) for p in net.prefill for d in net.decode]
    assert [got.edge_flow[e] for e in edges] == list(x[:len(edges)])
    assert math.isclose(got.total, float(x.sum()), rel_tol=1e-12)
