"""Concurrent transfers over shared NICs and site pipes (hetserve.cost.network)."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetserve.cost.analytic import CostModel
from hetserve.cost.layout import ReplicaLayout, StageLayout
from hetserve.cost.network import max_min_rates, transfer_times
from hetserve.specs.cluster import GBPS, cluster_from_dict
from hetserve.specs.model import MODEL_PRESETS
from hetserve.specs.network import Path, Resource

TWO_SITES = cluster_from_dict({
    "name": "two-sites",
    "machines": [{"name": "a0", "gpu": "H100-SXM-80G", "count": 4, "site": "east"},
                 {"name": "a1", "gpu": "H100-SXM-80G", "count": 4, "site": "east"},
                 {"name": "b0", "gpu": "A100-SXM-80G", "count": 4, "site": "west"}],
    "network": {"intra_site": {"bandwidth_gbps": 100, "latency_ms": 0.5},
                "inter_site": {"bandwidth_gbps": 2, "latency_ms": 30}}})


def res(name, bw):
    return Resource(name, "nic_out", bw, 0.0)


def test_max_min_by_hand():
    # x: 10 B/s shared by flows 0, 1, 2; y: 4 B/s crossed by flow 2 only.
    # progressive filling: y gives flow 2 at most 4? no: x's share 10/3 < y's 4, so all get 10/3.
    x, y = res("x", 10.0), res("y", 4.0)
    assert max_min_rates([(x,), (x,), (x, y)]) == pytest.approx([10 / 3] * 3)
    # y at 2 B/s: flow 2 frozen at 2, the other two split the remaining 8 on x.
    y = res("y", 2.0)
    assert max_min_rates([(x,), (x,), (x, y)]) == pytest.approx([4.0, 4.0, 2.0])
    # unlimited resources leave a flow unbounded
    assert math.isinf(max_min_rates([(res("z", math.inf),)])[0])
    # the competing-flow penalty: two flows on x deliver 10 / 1.5 in total
    assert max_min_rates([(x,), (x,)], competing_penalty=0.5) == pytest.approx([10 / 3, 10 / 3])


def test_fluid_completion_by_hand():
    x = res("x", 10.0)
    p = Path((x,), 1.0)
    # 10 B and 30 B together: 5 B/s each until the first is done at 2 s, then 10 B/s for the last 20 B
    assert transfer_times([(p, 10.0), (p, 30.0)]) == pytest.approx([2.0 + 1.0, 4.0 + 1.0])
    assert transfer_times([(p, 10.0)], overhead_s=0.25) == pytest.approx([2.25])


paths = st.lists(st.sets(st.integers(0, 3), min_size=1, max_size=3), min_size=1, max_size=5)


@settings(max_examples=60, deadline=None)
@given(paths, st.lists(st.floats(1.0, 1e6), min_size=6, max_size=6), st.integers(0, 3), st.floats(1.0, 1e6))
def test_adding_a_transfer_never_speeds_up_the_others(members, sizes, extra_on, extra_bytes):
    """A new transfer on a resource never makes a transfer that crosses only that resource finish
    earlier. (Transfers that cross others too may: under max-min fairness a flow slowed on the new
    one's resource frees capacity on another, where such a transfer may be the one held back — a
    property of fair sharing, not a bug.)"""
    pool = [Resource(f"r{i}", "pipe", bw, 0.001) for i, bw in enumerate((5.0, 7.0, 11.0, 13.0))]
    transfers = [(Path(tuple(pool[i] for i in sorted(m)), 0.001), sizes[k]) for k, m in enumerate(members)]
    before = transfer_times(transfers)
    after = transfer_times(transfers + [(Path((pool[extra_on],), 0.001), extra_bytes)])
    for k, (b, a) in enumerate(zip(before, after)):
        if members[k] == {extra_on}:
            assert a >= b * (1 - 1e-9)
    # and each transfer never beats its uncontended time (the per-pair formula is the lower bound)
    for (p, n), t in zip(transfers, before):
        assert t >= p.latency_s + n / p.bandwidth - 1e-9


def test_two_sites_shared_and_uncontended_disagree():
    """Two prefill boxes in the east each send a KV cache to the west over one 2 Gbps pipe:
    alone each takes α + bytes/β; together they share the pipe and take about twice as long."""
    cost = CostModel(TWO_SITES, MODEL_PRESETS["llama-2-7b"])
    p0 = ReplicaLayout((StageLayout((0, 1, 2, 3), (0, 32)),))
    p1 = ReplicaLayout((StageLayout((4, 5, 6, 7), (0, 32)),))
    d = ReplicaLayout((StageLayout((8, 9, 10, 11), (0, 32)),))
    tokens = 1000
    nbytes = tokens * cost.model.kv_bytes_per_token
    alone = cost.kv_transfer_time(p0, d, tokens)
    assert alone == pytest.approx(0.030 + nbytes / (2 * GBPS), rel=1e-6)
    # the uncontended (per-pair) view: 4×4 shard pairs each on a private 2 Gbps link
    assert cost.kv_transfer_time_uncontended(p0, d, tokens) == pytest.approx(0.030 + nbytes / 4 / (2 * GBPS), rel=1e-6)
    parts = [(TWO_SITES.path(a, b), n) for src in (p0, p1) for a, b, n in cost.kv_transfer_pairs(src, d, tokens)]
    together = max(transfer_times(parts))
    assert together == pytest.approx(0.030 + 2 * nbytes / (2 * GBPS), rel=1e-6)
    assert together > 1.9 * alone - 0.030
