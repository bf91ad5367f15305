"""KV admission modes: "reserve" (prompt + whole output held from admission) and "paged" (vLLM:
KV grows with the context, overflow pre-empts the newest request, which recomputes later)."""

import numpy as np
import pytest

from hetserve.sim import SimOptions, simulate
from hetserve.sim.batch import DecodeBatch
from hetserve.specs.workload import Workload

from .plans import single


def running_at(res, ts):
    return [int(((res.t_join <= t) & (res.t_finish > t)).sum()) for t in ts]


# the footprints below (a quarter of an A100's pool) lie beyond llama-2-7b's context: run them as given
RUN = {"beyond_context": "run"}


def long_outputs(cap, n=12):
    """Short prompts, long outputs: each request's final footprint is a quarter of the pool."""
    per = int(cap // 4)
    return Workload.from_lists("long", [0.0] * n, [100] * n, [per - 100] * n)


@pytest.mark.parametrize("role", ["d", "c"])
def test_paged_admits_more_then_preempts_newest_and_finishes_all(cluster, model, cost, role):
    plan = single({"p0": ["m0:0", "m0:1"], "d0": ["m1:0"]}) if role == "d" else single({"c0": ["m1:0"]})
    rid = "d0" if role == "d" else "c0"
    cap = cost.kv_capacity_tokens(plan.replica(rid).layout(cluster))
    wl = long_outputs(cap)
    reserve = simulate(plan, cluster, model, wl, SimOptions(**RUN))
    paged = simulate(plan, cluster, model, wl, SimOptions(kv_admission="paged", **RUN))
    ts = np.linspace(0, paged.t_finish.max(), 500)
    assert max(running_at(reserve, ts)) <= 4  # whole footprints: 4 fit
    assert max(running_at(paged, ts)) >= 8  # paged: every short prompt fits at first
    assert paged.info["preemptions"] > 0 and reserve.info["preemptions"] == 0
    d = next(r for r in paged.replicas if r.id == rid)
    assert d.kv_peak_tokens <= cap + 1e-6
    assert paged.summary()["completed"] == len(wl)
    # the newest requests are the ones pre-empted: their decode is stretched by the recompute stall;
    # the oldest never is (it runs at the pace of the batch it is in)
    assert paged.atgt[-1] > paged.atgt[0]
    if role == "d":  # each pre-empted request was recomputed by the prefill replica (as in the runtime)
        p = next(r for r in paged.replicas if r.id == "p0")
        assert p.requests == len(wl) + paged.info["preemptions"]


def test_paged_equals_reserve_when_the_pool_is_ample(cluster, model):
    plan = single({"p0": ["m0:0"], "d0": ["m1:0"]})
    rng = np.random.default_rng(1)
    wl = Workload.from_lists("small", np.sort(rng.uniform(0, 5, 30)), rng.integers(50, 400, 30),
                             rng.integers(5, 200, 30))
    a = simulate(plan, cluster, model, wl)
    b = simulate(plan, cluster, model, wl, SimOptions(kv_admission="paged"))
    assert b.info["preemptions"] == 0
    np.testing.assert_allclose(a.t_finish, b.t_finish, rtol=1e-12)
    # paged holds less KV on average: only what the contexts have grown to
    assert b.replicas[1].kv_mean_tokens < a.replicas[1].kv_mean_tokens


def test_paged_with_chunked_prefill_finishes(cluster, model, cost):
    plan = single({"c0": ["m1:0"]})
    cap = cost.kv_capacity_tokens(plan.replica("c0").layout(cluster))
    wl = long_outputs(cap, n=10)
    res = simulate(plan, cluster, model, wl, SimOptions(kv_admission="paged", chunked_prefill=True, **RUN))
    assert res.summary()["completed"] == 10 and res.info["preemptions"] > 0
    assert res.replicas[0].kv_peak_tokens <= cap + 1e-6


def test_bad_mode_and_detailed_pipeline_are_refused():
    with pytest.raises(ValueError, match="kv_admission"):
        SimOptions(kv_admission="lazy")
    with pytest.raises(ValueError, match="aggregate"):
        SimOptions(kv_admission="paged", pipeline="detailed")


def test_batch_remove_keeps_the_aggregates():
    b = DecodeBatch(lambda n, c: 0.01)
    b.add(1, 10, 5, 15)
    b.add(2, 20, 3, 23)
    b.start(0.0)
    b.advance(1)
    b.remove(2, 21)
    assert b.size == 1 and b.context == 11 and list(b.members) == [1]
    assert b.next_finish_iteration == 5
    assert b.advance(4) == [1] and b.size == 0


def test_a_token_budget_below_the_batch_cap_is_refused_as_the_runtime_refuses_it(cluster, model):
    """A step decodes up to ``max_batch`` sequences, one budget token each: a smaller budget would be
    accepted and change nothing, so the simulator refuses it with the runtime's rule."""
    from hetserve.runtime.engine_config import EngineConfig

    plan, wl = single({"c0": ["m1:0"]}), Workload.from_lists("three", [0.0] * 3, [100] * 3, [10] * 3)
    with pytest.raises(ValueError, match="token_budget must be at least max_batch \\(16\\).*got 8"):
        simulate(plan, cluster, model, wl, SimOptions(token_budget=8, max_batch=16))
    with pytest.raises(ValueError, match="max_batched_tokens must be at least max_num_seqs \\(16\\)"):
        EngineConfig(max_batched_tokens=8, max_num_seqs=16)
    assert simulate(plan, cluster, model, wl, SimOptions(token_budget=16, max_batch=16)).summary()["completed"] > 0
