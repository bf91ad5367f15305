"""Elastic re-plan on the real engine (HexGen's "GPUs leave and join"): a killed worker's device
leaves, the planner re-plans the freed devices warm-started from the running plan, the new replicas
come up while the unchanged one keeps serving, no request is lost, and a device that comes back joins."""

from __future__ import annotations

import os
import signal
import time

import pytest

from hetserve.runtime.sampling import SamplingParams

PROMPTS = [[i + 1] * (i + 2) for i in range(4)]


def _plan():
    from hetserve.planner.plan import Plan

    return Plan.from_dict({"model": "tiny", "cluster": "runtime-test", "replicas": [
        {"id": "c0", "role": "colocated", "stages": [{"devices": ["m0:0"], "layers": [0, 3]}]},
        {"id": "c1", "role": "colocated", "stages": [{"devices": ["m0:1"], "layers": [0, 2]},
                                                     {"devices": ["m0:2"], "layers": [2, 3]}]}]})


def _devices(plan):
    return {d for r in plan.replicas for d in r.devices}


@pytest.mark.timeout(240)
def test_killed_worker_is_replanned_and_a_returning_device_joins(model_dirs, cluster_file):
    from hetserve.planner.options import PlanOptions
    from hetserve.planner.replan import replan
    from hetserve.runtime.deployment import model_spec
    from hetserve.runtime.engine import Engine, EngineConfig
    from hetserve.specs.cluster import load_cluster
    from hetserve.specs.workload import load_workload

    cluster = load_cluster(str(cluster_file))
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    eng = Engine.from_plan(_plan(), cluster, model_dirs["opt"], EngineConfig(kv_capacity_tokens=2048))
    try:
        spec, workload = model_spec(eng.arch, 4), load_workload("azure-conv")
        options = PlanOptions(seed=0, time_limit_s=5)
        want = eng.generate(PROMPTS, params, timeout=60)
        handles = [eng.submit(p, params) for p in PROMPTS]
        next(iter(handles[0]))
        os.kill(eng.worker_pids()["m0:1"], signal.SIGKILL)  # c1's first stage: device m0:1 leaves
        deadline = time.monotonic() + 30
        while not eng.stats().get("deaths") and time.monotonic() < deadline:
            time.sleep(0.05)
        new = replan(cluster, spec, workload, eng.plan, {"m0:1"}, options=options,
                     dead_replicas={d["replica"] for d in eng.stats()["deaths"]})
        assert "m0:1" not in _devices(new) and {"m0:2", "m0:3"} <= _devices(new)  # freed + idle devices planned
        record = eng.reconfigure(new, cluster)
        assert record["kept"] == ["c0"] and record["retired"] == ["c1"] and record["added"]
        assert [h.result(timeout=60) for h in handles] == want  # no request lost, same tokens
        # new requests are served by the re-planned replica set: each new replica answers one
        for rid in record["added"]:
            assert eng.submit(PROMPTS[0], params, replica=rid).result(timeout=60) == want[0]
            assert eng.stats()["replicas"][rid]["steps"] > 0
        assert set(eng.stats()["replicas"]) == {"c0", *record["added"]}
        # the device comes back: re-plan with nothing lost, it joins, the rest stays as it is
        again = replan(cluster, spec, workload, eng.plan, set(), options=options)
        record2 = eng.reconfigure(again, cluster)
        assert sorted(record2["kept"]) == sorted(["c0", *record["added"]]) and not record2["retired"]
        (joined,) = record2["added"]
        assert eng.plan.replica(joined).devices == ("m0:1",)
        assert eng.submit(PROMPTS[1], params, replica=joined).result(timeout=60) == want[1]
        stats = eng.stats()
        assert stats["failed"] == 0 and stats["broken"] is None
    finally:
        eng.shutdown()
    assert all(p.exitcode is not None for p in eng.procs.values())
