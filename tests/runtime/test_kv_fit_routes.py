"""A request goes only where it fits: a KV hand-off never waits for a decode replica whose pool can
never hold the request, while another decode replica could (it would wait forever, unnoticed)."""

from __future__ import annotations

import pytest

from hetserve.runtime.params import SamplingParams

LAYERS = 3


@pytest.mark.timeout(120)
def test_a_hand_off_skips_a_decode_replica_too_small_for_it(model_dirs, cluster_file):
    from hetserve.planner.plan import Plan
    from hetserve.runtime.engine import Engine
    from hetserve.runtime.engine_config import EngineConfig

    def rep(rid, role, dev):
        return {"id": rid, "role": role, "stages": [{"devices": [dev], "layers": [0, LAYERS]}]}

    # the plan sends most hand-offs to d0, whose pool (32 tokens) never holds 4 + 40 tokens
    plan = Plan.from_dict({"model": "tiny", "cluster": "runtime-test",
                           "replicas": [rep("p0", "prefill", "m0:0"), rep("d0", "decode", "m0:1"),
                                        rep("d1", "decode", "m0:2")],
                           "kv_routes": [{"from": "p0", "to": "d0", "weight": 0.9},
                                         {"from": "p0", "to": "d1", "weight": 0.1}]})
    cfg = EngineConfig(kv_capacity_tokens={"p0": 512, "d0": 32, "d1": 512})
    with Engine.from_plan(plan, cluster_file, model_dirs["llama"], cfg) as eng:
        big = [eng.submit([65 + i, 66, 67, 68], SamplingParams(max_tokens=40, ignore_eos=True)) for i in range(3)]
        small = eng.submit([70, 71], SamplingParams(max_tokens=4, ignore_eos=True))  # fits d0: d0 still serves
        # before: the first hand-off to d0 waited for room that never comes, and the result timed out
        assert [len(h.result(timeout=30)) for h in big] == [40, 40, 40]
        assert len(small.result(timeout=30)) == 4


@pytest.mark.timeout(120)
def test_paged_admission_leaves_a_request_too_big_for_its_pool_to_a_larger_replica(model_dirs, cluster_file):
    """Paged admission takes a request on its prompt alone: a replica whose whole pool can never
    hold it would take it from the shared queue and stall once it outgrew the pool."""
    from hetserve.planner.plan import Plan
    from hetserve.runtime.engine import Engine
    from hetserve.runtime.engine_config import EngineConfig

    plan = Plan.from_dict({"model": "tiny", "cluster": "runtime-test", "replicas": [
        {"id": c, "role": "colocated", "stages": [{"devices": [d], "layers": [0, LAYERS]}]}
        for c, d in (("c0", "m0:0"), ("c1", "m0:1"))]})
    cfg = EngineConfig(kv_capacity_tokens={"c0": 32, "c1": 512}, kv_admission="paged")
    with Engine.from_plan(plan, cluster_file, model_dirs["llama"], cfg) as eng:
        big = [eng.submit([65 + i, 66, 67, 68], SamplingParams(max_tokens=40, ignore_eos=True)) for i in range(3)]
        assert [len(h.result(timeout=30)) for h in big] == [40, 40, 40]
