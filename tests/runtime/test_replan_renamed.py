"""A re-plan whose new replica the engine renames (the planner named it like a replica retired
before) must still answer its record and log its line: the record names replicas by the engine's
ids, so the log line looks their devices up in the engine's plan, not the planner's."""

from __future__ import annotations

import logging

import pytest

from hetserve.runtime.params import SamplingParams

CLUSTER_YAML = "name: two\nmachines:\n  - {name: m0, gpu: RTX-4090, count: 2}\n"


@pytest.mark.timeout(240)
def test_a_returned_device_under_a_retired_replicas_name_is_recorded(model_dirs, tmp_path, caplog):
    from hetserve.planner.plan import Plan
    from hetserve.runtime.engine import Engine
    from hetserve.runtime.engine_config import EngineConfig
    from hetserve.serve.replan import Replanner

    cluster = tmp_path / "two.yaml"
    cluster.write_text(CLUSTER_YAML)
    plan = Plan.from_dict({"model": "tiny", "cluster": "two", "replicas": [
        {"id": f"c{i}", "role": "colocated", "stages": [{"devices": [f"m0:{i}"], "layers": [0, 3]}]}
        for i in range(2)]})
    eng = Engine.from_plan(plan, cluster, model_dirs["opt"], EngineConfig(kv_capacity_tokens=1024))
    replanner = Replanner(eng, "azure-conv", time_limit_s=2)
    try:
        gone = replanner.replan(lost=["m0:0"])  # c0 retired; no device is free for another replica
        assert gone["retired"] == ["c0"] and not gone["added"]
        with caplog.at_level(logging.INFO, logger="hetserve.serve"):
            back = replanner.replan(returned=["m0:0"])  # the planner names the new replica c0 again
        (joined,) = back["added"]
        assert joined != "c0" and eng.plan.replica(joined).devices == ("m0:0",)
        assert replanner.history[-1] is back  # the record is kept, as every re-plan's is
        pid = eng.worker_pids()["m0:0"]
        assert any(f"added {joined} (m0:0 pid {pid})" in r.getMessage() for r in caplog.records)
        out = eng.submit([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True), replica=joined)
        assert len(out.result(timeout=60)) == 4
    finally:
        replanner.close()
        eng.shutdown()
