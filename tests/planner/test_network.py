"""The flow network's capacity nodes: shared NICs and site pipes bound the KV flow."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetserve.cost.layout import ReplicaLayout, StageLayout
from hetserve.planner.context import PlanContext
from hetserve.planner.pool.flow import FlowNetwork, max_flow_total, max_flow_value, resource_loads, solve
from hetserve.planner.pool.evaluator import Evaluator
from hetserve.planner.pool.groups import Group
from hetserve.specs.cluster import cluster_from_dict


def test_capacity_node_by_hand():
    # p0 and p1 (caps 10 each) feed d0 (cap 30); KV edges uncapped. Both routes cross the pipe "x"
    # (60 bytes per T): p0's request puts 2 bytes on it, p1's 4. Best: p0 at 10 (20 bytes), p1 gets
    # the remaining 40 bytes = 10 requests -> 20; with x at 40 bytes: p0 10 (20 B), p1 5 (20 B) -> 15.
    net = FlowNetwork([0, 1], [2], {0: 10, 1: 10, 2: 30}, {(0, 2): float("inf"), (1, 2): float("inf")},
                      resource_cap={"x": 60.0}, edge_load={(0, 2): {"x": 2.0}, (1, 2): {"x": 4.0}})
    assert max_flow_value(net) == pytest.approx(20)
    net.resource_cap["x"] = 40.0
    res = solve(net)
    assert res.value == pytest.approx(15)
    assert res.edge_flow[(0, 2)] == pytest.approx(10) and res.edge_flow[(1, 2)] == pytest.approx(5)
    assert resource_loads(net, res)["x"] == pytest.approx(40)
    # a colocated group loading the same pipe shares it: 1 byte per request, cap 100
    net.colocated, net.node_cap[3], net.node_load[3] = [3], 100.0, {"x": 1.0}
    assert max_flow_total(net) == pytest.approx(40)  # the pipe's 40 bytes go to the cheapest requests


def _pool(nic_gbps: float, pipe_gbps: float):
    return cluster_from_dict({
        "name": "nic-sweep",
        "machines": [{"name": "h0", "gpu": "H100-SXM-80G", "count": 4, "site": "a"},
                     {"name": "h1", "gpu": "H100-SXM-80G", "count": 4, "site": "a",
                      "nic": {"bandwidth_gbps": nic_gbps, "latency_ms": 0.5}},
                     {"name": "a0", "gpu": "A100-SXM-80G", "count": 4, "site": "b"}],
        "network": {"intra_site": {"bandwidth_gbps": 25, "latency_ms": 0.5},
                    "inter_site": {"bandwidth_gbps": pipe_gbps, "latency_ms": 15}}})


def _fixed_estimate(cluster, model, workload) -> float:
    """Prefill on h0 and h1, decode on a0 and one replica pipelined across h1 and a0."""
    ctx = PlanContext(cluster, model, workload)
    groups = [Group.of(range(0, 4), "prefill"), Group.of((4, 5), "prefill"), Group.of((8, 9), "decode"),
              Group.of((6, 7, 10, 11), "decode")]
    layouts = [ReplicaLayout((StageLayout((0, 1, 2, 3), (0, 80)),)),
               ReplicaLayout((StageLayout((4, 5), (0, 80)),)),
               ReplicaLayout((StageLayout((8, 9), (0, 80)),)),
               ReplicaLayout((StageLayout((6, 7), (0, 40)), StageLayout((10, 11), (40, 80))))]
    return Evaluator(ctx).score_layouts(groups, layouts)


@settings(max_examples=12, deadline=None)
@given(nic=st.floats(1.0, 200.0), factor=st.floats(1.0, 5.0), pipe=st.floats(0.5, 20.0))
def test_more_nic_bandwidth_never_lowers_the_estimate(nic, factor, pipe, llama70b, azure):
    low = _fixed_estimate(_pool(nic, pipe), llama70b, azure)
    high = _fixed_estimate(_pool(nic * factor, pipe), llama70b, azure)
    assert high >= low * (1 - 1e-6)


def test_narrow_pipe_bounds_the_plan(llama70b, azure):
    wide = _fixed_estimate(_pool(100, 100), llama70b, azure)
    narrow = _fixed_estimate(_pool(100, 1), llama70b, azure)
    assert narrow < 0.5 * wide  # the 1 Gbit/s pipe carries all the KV and one PP hand-off
