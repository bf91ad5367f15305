"""Paged KV on a disaggregated plan: the decode replica's pool is too small for the outputs, so it
pre-empts; a pre-empted request goes back to the prefill replica, is recomputed (prompt + the tokens
it had streamed), handed off again, and still streams exactly the model's greedy tokens.

(The colocated case, step by step against the simulator, is ``test_batching_equivalence.py``.)"""

from __future__ import annotations

import time

import pytest

from .test_batching_equivalence import PAGED, _prompt, greedy


@pytest.mark.timeout(180)
def test_a_request_preempted_on_a_decode_replica_is_recomputed_and_completes(model_dirs, cluster_file, plans):
    from hetserve.runtime.engine import Engine
    from hetserve.runtime.engine_config import EngineConfig
    from hetserve.runtime.params import SamplingParams

    model_dir = model_dirs["llama"]
    cfg = EngineConfig(kv_capacity_tokens={"p0": 1024, "d0": PAGED.kv_tokens}, kv_admission="paged")
    with Engine.from_plan(plans.disaggregated(), cluster_file, model_dir, cfg) as eng:
        handles = [eng.submit(_prompt(i, n), SamplingParams(max_tokens=out, ignore_eos=True))
                   for i, (n, out) in enumerate(PAGED.requests)]
        outputs = [h.result(timeout=120) for h in handles]  # raises if one failed
        deadline = time.monotonic() + 10
        while eng.stats()["completed"] < len(handles) and time.monotonic() < deadline:
            time.sleep(0.01)  # the coordinator publishes its stats after the loop round that finished them
        stats = eng.stats()
    assert stats["replicas"]["d0"]["preemptions"] > 0 and stats["replicas"]["p0"]["preemptions"] == 0
    # what /metrics shows (hetserve_replica_preemptions_total): the snapshot the server reads
    from hetserve.runtime.snapshot import state_from_stats

    assert state_from_stats("d0", stats["replicas"]["d0"]).preemptions == stats["replicas"]["d0"]["preemptions"]
    assert stats["completed"] == len(PAGED.requests) and stats["failed"] == 0
    for i, (n, out) in enumerate(PAGED.requests):
        assert outputs[i] == greedy(model_dir, _prompt(i, n), out), f"request {i}"
