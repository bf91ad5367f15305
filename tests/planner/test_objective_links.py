"""Within the SLOs a shared link carries KV hand-offs only as far as their queueing allows
(``planner.slo.link_load_cap``): a plan that fills a site pipe is not priced as a pipe-light one."""

import pytest

from hetserve.cost.layout import ReplicaLayout, StageLayout
from hetserve.planner.context import PlanContext
from hetserve.planner.options import PlanOptions
from hetserve.planner.pool.evaluator import Evaluator
from hetserve.planner.pool.estimate import network_estimate
from hetserve.planner.pool.flow import resource_loads
from hetserve.planner.pool.groups import Group
from hetserve.planner.slo import link_load_cap
from hetserve.specs.cluster import cluster_from_dict

GOODPUT = PlanOptions(objective="goodput", slo_ttft_s=2.0, slo_tpot_s=0.1)
PIPE = "pipe:a>b"


def _pool(pipe_gbps: float = 3.0):
    """Four H100s at site a, four A100s at site b, a site pipe between them (3 Gbit/s: hexgen2-het1's)."""
    return cluster_from_dict({
        "name": "two-sites",
        "machines": [{"name": "h0", "gpu": "H100-SXM-80G", "count": 4, "site": "a"},
                     {"name": "a0", "gpu": "A100-SXM-80G", "count": 4, "site": "b"}],
        "network": {"inter_site": {"bandwidth_gbps": pipe_gbps, "latency_ms": 15}}})


def _across(ctx):
    """Prefill on the H100s, decode on the A100s: every prompt's KV crosses the pipe."""
    groups = [Group.of((0, 1, 2, 3), "prefill"), Group.of((4, 5, 6, 7), "decode")]
    layouts = [ReplicaLayout((StageLayout((0, 1, 2, 3), (0, 80)),)),
               ReplicaLayout((StageLayout((4, 5, 6, 7), (0, 80)),))]
    return Evaluator(ctx).evaluate_layouts(groups, layouts)


def _a100s_alone(ctx):
    """One colocated replica on the A100s, the H100s idle: nothing crosses the pipe."""
    groups = [Group.of((4, 5, 6, 7), "colocated")]
    return Evaluator(ctx).evaluate_layouts(groups, [ReplicaLayout((StageLayout((4, 5, 6, 7), (0, 80)),))])


def test_link_load_cap_is_where_the_mean_hand_off_reaches_the_ttft():
    rho = link_load_cap(0.5, 2.0)
    assert 0.5 / (1 - rho) == pytest.approx(2.0)
    assert link_load_cap(0.5, None) == 1.0 and link_load_cap(2.0, 2.0) == 0.0


def test_goodput_loads_a_pipe_only_up_to_its_kv_queueing_cap(llama70b, azure):
    cluster = _pool()
    plain, slo = PlanContext(cluster, llama70b, azure), PlanContext(cluster, llama70b, azure, GOODPUT)
    pipe = slo.resources[PIPE]
    kv_s = llama70b.kv_bytes_per_token * slo.input_tokens / pipe.bandwidth
    cap = link_load_cap(kv_s, 2.0)
    assert 0 < cap < 0.9  # the mean prompt's KV alone takes a good share of the TTFT on 3 Gbit/s
    # throughput: the pipe binds and is filled (less the hand-offs' 15 ms latency the KV edge
    # charges); goodput: filled only up to the cap, and the estimate falls with it (the replicas'
    # SLO capacities are far above what the pipe carries); the plan's estimate says what it sends
    ev_plain, ev_slo = _across(plain), _across(slo)
    assert network_estimate(plain, ev_plain)[PIPE]["utilisation"] > 0.97
    assert network_estimate(slo, ev_slo)[PIPE]["utilisation"] == pytest.approx(cap, abs=1e-3)
    assert ev_slo.flow.value < ev_plain.flow.value * cap * 1.03
    assert ev_slo.flow.value < 0.9 * min(ev_slo.capacities)


def test_a_pipe_filling_plan_is_priced_below_a_pipe_light_one_within_the_slos(llama70b, azure, monkeypatch):
    # on a 10 Gbit/s pipe the disaggregated plan fills the pipe and, priced with the pipe full,
    # would beat the A100s alone; the mean prompt's KV takes 0.23 s on it alone, so within
    # TTFT ≤ 2 s the pipe carries at most 88 % and the A100s alone serve more
    slo = PlanContext(_pool(10.0), llama70b, azure, GOODPUT)
    across, alone = _across(slo), _a100s_alone(slo)
    assert not resource_loads(alone.network, alone.flow)
    assert across.requests_per_period < alone.requests_per_period
    # what the cap changes: the same plan priced with its pipe full beats the A100s alone
    monkeypatch.setattr("hetserve.planner.context.kv_loads_within", lambda loads, resources, slo: loads)
    full = PlanContext(_pool(10.0), llama70b, azure, GOODPUT)
    assert _across(full).requests_per_period > alone.requests_per_period
