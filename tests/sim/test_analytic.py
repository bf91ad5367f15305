"""One request alone: the simulator reproduces the cost model's numbers exactly."""

import math

import pytest

from hetserve.cost.analytic import PrefillBatch
from hetserve.sim import SimOptions, simulate
from hetserve.specs.workload import Workload

from .plans import single


def one(inp=1000, out=50, at=0.0):
    return Workload.from_lists("one", [at], [inp], [out])


def test_disaggregated_single_request_matches_cost_model(cluster, model, cost):
    plan = single({"p0": ["m0:0", "m0:1"], "d0": ["m1:0", "m1:1"]})
    res = simulate(plan, cluster, model, one(1000, 50))
    pl, dl = plan.replica("p0").layout(cluster), plan.replica("d0").layout(cluster)
    assert res.t_start[0] == 0.0  # no queueing
    assert res.ttft[0] == pytest.approx(cost.ttft(pl, 1000), rel=1e-12)
    assert res.t_kv_done[0] - res.t_kv_start[0] == pytest.approx(cost.kv_transfer_time(pl, dl, 1000), rel=1e-9)
    # 49 decode iterations at batch 1, context 1001 .. 1049
    steps = sum(cost.decode_step_time(dl, 1, 1001 + i) for i in range(49))
    assert res.t_finish[0] - res.t_join[0] == pytest.approx(steps, rel=1e-9)
    assert res.atgt[0] == pytest.approx(cost.decode_step_time(dl, 1, 1025), rel=1e-6)
    assert res.t_join[0] == res.t_kv_done[0]  # an idle decode replica starts at once


def test_kv_transfer_crosses_the_slow_link(model):
    from .conftest import two_box_cluster
    from hetserve.cost.analytic import CostModel
    slow = two_box_cluster(gbps_between=1.0, latency_ms=20.0)
    c = CostModel(slow, model)
    plan = single({"p0": ["m0:0"], "d0": ["m1:0"]})
    res = simulate(plan, slow, model, one(2000, 10))
    nbytes = 2000 * model.kv_bytes_per_token
    assert res.t_kv_done[0] - res.t_kv_start[0] == pytest.approx(0.020 + nbytes / (1e9 / 8), rel=1e-9)
    assert res.t_kv_done[0] - res.t_kv_start[0] == pytest.approx(
        c.kv_transfer_time(plan.replica("p0").layout(slow), plan.replica("d0").layout(slow), 2000), rel=1e-12)


def test_colocated_single_request(cluster, model, cost):
    plan = single({"c0": ["m0:0", "m0:1"]})
    res = simulate(plan, cluster, model, one(700, 20, at=0.0))
    lay = plan.replica("c0").layout(cluster)
    assert res.ttft[0] == pytest.approx(cost.ttft(lay, 700), rel=1e-12)
    steps = sum(cost.decode_step_time(lay, 1, 701 + i) for i in range(19))
    assert res.e2e[0] == pytest.approx(cost.ttft(lay, 700) + steps, rel=1e-9)
    assert res.tpot[0] == pytest.approx(steps / 19, rel=1e-9)


def test_one_token_output_finishes_at_prefill(cluster, model, cost):
    plan = single({"p0": ["m0:0"], "d0": ["m1:0"]})
    res = simulate(plan, cluster, model, one(300, 1))
    assert res.e2e[0] == res.ttft[0] and math.isnan(res.t_kv_start[0]) and res.tpot[0] == 0.0


def test_same_time_arrivals_share_one_prefill_batch(cluster, model, cost):
    plan = single({"p0": ["m0:0"], "d0": ["m1:0"]})
    wl = Workload.from_lists("two", [0.0, 0.0], [400, 600], [5, 5])
    res = simulate(plan, cluster, model, wl)
    lay = plan.replica("p0").layout(cluster)
    both = cost.prefill_time(lay, PrefillBatch.of([400, 600]))
    assert res.ttft.tolist() == pytest.approx([both, both], rel=1e-12)


def test_token_budget_splits_prefill_batches(cluster, model, cost):
    plan = single({"p0": ["m0:0"], "d0": ["m1:0"]})
    wl = Workload.from_lists("two", [0.0, 0.0], [400, 600], [5, 5])
    res = simulate(plan, cluster, model, wl, SimOptions(token_budget=500))
    lay = plan.replica("p0").layout(cluster)
    t1 = cost.ttft(lay, 400)
    assert res.ttft[0] == pytest.approx(t1) and res.ttft[1] == pytest.approx(t1 + cost.ttft(lay, 600))
    assert res.t_start[1] == pytest.approx(t1)  # queued behind the first batch


def test_pipeline_prefill_overlaps_stages(cluster, model, cost):
    """Batch 2 enters stage 0 as batch 1 leaves it; its TTFT is below two full prefills."""
    from hetserve.planner.plan import Plan
    plan = Plan.from_dict({"model": "llama-2-7b", "cluster": "test", "replicas": [
        {"id": "p0", "role": "prefill", "stages": [{"devices": ["m0:0"], "layers": [0, 16]},
                                                    {"devices": ["m0:1"], "layers": [16, 32]}]},
        {"id": "d0", "role": "decode", "stages": [{"devices": ["m1:0"], "layers": [0, 32]}]}]})
    wl = Workload.from_lists("two", [0.0, 0.0], [1000, 1000], [3, 3])
    res = simulate(plan, cluster, model, wl, SimOptions(token_budget=1000))
    lay = plan.replica("p0").layout(cluster)
    one_ttft = cost.ttft(lay, 1000)
    assert res.ttft[0] == pytest.approx(one_ttft)
    s0 = cost.stage_prefill_time(lay.stages[0], PrefillBatch.single(1000))
    assert res.ttft[1] == pytest.approx(one_ttft + max(s0, cost.stage_prefill_time(lay.stages[1], PrefillBatch.single(1000), True)))
    assert res.ttft[1] < 2 * one_ttft
