"""The simulator places a request, and routes its KV, only where the replica's pool can ever hold
it, as the server does (``policies.request_checks.able_to_hold``): a small replica never takes a
request it cannot hold while another can."""

from hetserve.sim import SimOptions, simulate
from hetserve.specs.workload import Workload

from .plans import single


def trace(rows):
    a, i, o = zip(*rows)
    return Workload.from_lists("t", list(a), list(i), list(o))


# two long requests (300 + 300 tokens: they fit only the large pools), then two short ones, and so on
LONG = [k for k in range(12) if k % 4 < 2]
ROWS = [(0.5 * k, 300 if k in LONG else 20, 300 if k in LONG else 10) for k in range(12)]
SHORT = [k for k in range(12) if k not in LONG]


def test_placement_skips_a_colocated_replica_too_small_for_the_request(cluster, model):
    plan = single({"c0": ["m0:0"], "c1": ["m1:0"]})
    res = simulate(plan, cluster, model, trace(ROWS),
                   SimOptions(placement="rr", kv_capacity_tokens={"c0": 128, "c1": 4096}))
    assert res.summary()["completed"] == 12
    assert {res.prefill_replica[k] for k in LONG} == {"c1"}  # round robin would send half of them to c0
    assert "c0" in {res.prefill_replica[k] for k in SHORT}  # the short ones still go round


def test_a_kv_route_skips_a_decode_replica_too_small_for_the_request(cluster, model):
    plan = single({"p0": ["m0:0"], "d0": ["m0:1"], "d1": ["m1:0"]}, routes=[("p0", "d0", 0.9), ("p0", "d1", 0.1)])
    res = simulate(plan, cluster, model, trace(ROWS),
                   SimOptions(kv_capacity_tokens={"p0": 4096, "d0": 128, "d1": 4096}))
    assert res.summary()["completed"] == 12
    assert {res.decode_replica[k] for k in LONG} == {"d1"}
    assert "d0" in {res.decode_replica[k] for k in SHORT}
