"""The measurement hooks benchmarks put into the real engine still fit it (a bench is no test, so a
changed signature in the coordinator broke ``bench_frontend`` unnoticed once)."""

from __future__ import annotations

import pytest

from hetserve.runtime.params import SamplingParams


@pytest.mark.timeout(120)
def test_bench_frontend_step_timer_times_a_real_engines_steps(model_dirs, cluster_file, plans):
    from bench.bench_frontend import StepTimer
    from hetserve.runtime.engine import Engine
    from hetserve.runtime.engine_config import EngineConfig

    plan = plans.single()
    with Engine.from_plan(plan, cluster_file, model_dirs["llama"], EngineConfig(kv_capacity_tokens=4096)) as eng, \
            StepTimer("c0") as timer:
        handles = [eng.submit([65 + i, 66, 67], SamplingParams(max_tokens=6, ignore_eos=True)) for i in range(3)]
        outs = [h.result(timeout=60) for h in handles]
    assert [len(o) for o in outs] == [6, 6, 6]
    kinds = [k for k, _ in timer.events]
    assert kinds.count("send") >= 6 and kinds.count("result") >= 6
    summary = timer.summary()
    assert summary["steps"] >= 5 and summary["trip_ms"] > 0
