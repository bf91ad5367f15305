"""Elastic re-plan on the real engine (HexGen's "GPUs leave and join"): a killed worker's device
leaves, the planner re-plans the freed devices warm-started from the running plan, the new replicas
come up while the unchanged one keeps serving, no request is lost, and a device that comes back joins."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import pytest

from hetserve.runtime.params import SamplingParams

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
def test_killed_worker_is_replanned_and_a_returning_device_joins(model_dirs, cluster_file, caplog):
    """``--replan-on-failure`` semantics: the Replanner's watcher notices the death and re-plans."""
    from hetserve.runtime.engine import Engine
    from hetserve.runtime.engine_config import EngineConfig
    from hetserve.serve.replan import Replanner

    params = SamplingParams(max_tokens=24, ignore_eos=True)
    eng = Engine.from_plan(_plan(), cluster_file, model_dirs["opt"], EngineConfig(kv_capacity_tokens=2048))
    replanner = Replanner(eng, "azure-conv", time_limit_s=5, on_failure=True)
    try:
        want = eng.generate(PROMPTS, params, timeout=60)
        handles = [eng.submit(p, params) for p in PROMPTS]
        next(iter(handles[0]))
        os.kill(eng.worker_pids()["m0:1"], signal.SIGKILL)  # c1's first stage: device m0:1 leaves
        deadline = time.monotonic() + 120
        while not replanner.history and time.monotonic() < deadline:
            time.sleep(0.05)
        (record,) = replanner.history
        assert record["trigger"] == "failure" and record["lost"] == ["m0:1"]
        # a re-plan a failure forced is logged at the default level (warning), naming the lost device
        assert any(r.levelno == logging.WARNING and "re-plan (failure; lost devices: ['m0:1'])" in r.getMessage()
                   for r in caplog.records)
        assert record["kept"] == ["c0"] and record["retired"] == ["c1"] and record["added"]
        # the new workers' process ids are named, as the start-up banner names the first ones
        new = eng.plan.replica(record["added"][0]).devices[0]
        assert any(f"{new} pid {eng.worker_pids()[new]}" in r.getMessage() for r in caplog.records)
        assert "m0:1" not in _devices(eng.plan) and {"m0:2", "m0:3"} <= _devices(eng.plan)  # freed + idle planned
        assert [h.result(timeout=60) for h in handles] == want  # no request lost, same tokens
        # new requests are served by the re-planned replica set: each new replica answers one
        for rid in record["added"]:
            assert eng.submit(PROMPTS[0], params, replica=rid).result(timeout=60) == want[0]
            assert eng.stats()["replicas"][rid]["steps"] > 0
        assert set(eng.stats()["replicas"]) == {"c0", *record["added"]}
        # the device comes back: it joins, the rest stays as it is
        record2 = replanner.replan(returned=["m0:1"])
        assert sorted(record2["kept"]) == sorted(["c0", *record["added"]]) and not record2["retired"]
        (joined,) = record2["added"]
        assert joined not in record["retired"]  # a new replica never takes a retired one's id
        assert eng.plan.replica(joined).devices == ("m0:1",)
        assert eng.submit(PROMPTS[1], params, replica=joined).result(timeout=60) == want[1]
        stats = eng.stats()
        assert stats["failed"] == 0 and stats["broken"] is None
        # /metrics counts the death and both re-plans, by trigger and outcome, as an operator alerts on them
        from hetserve.serve.fake import ByteCodec
        from hetserve.serve.coordinator import Coordinator
        from hetserve.serve.engine_backend import EngineBackend

        coord = Coordinator(EngineBackend(eng), ByteCodec(), "tiny")
        coord.replanner = replanner
        text = coord.metrics.render()[0].decode()
        assert "hetserve_worker_deaths_total 1.0" in text, text
        assert 'hetserve_replans_total{outcome="done",trigger="failure"} 1.0' in text
        assert 'hetserve_replans_total{outcome="done",trigger="request"} 1.0' in text
    finally:
        replanner.close()
        eng.shutdown()
    assert all(p.exitcode is not None for p in eng.procs.values())


@pytest.mark.timeout(240)
@pytest.mark.parametrize("replan_works", [True, False])
def test_when_the_last_replica_dies_requests_wait_for_the_replan(model_dirs, cluster_file, monkeypatch, replan_works):
    """With no replica left, the on-failure re-plan's replicas serve the requests held meanwhile
    (and those submitted meanwhile), continuing their streams; a re-plan that fails ends the hold."""
    from hetserve.errors import RuntimeFailure
    from hetserve.planner.plan import Plan
    from hetserve.runtime.engine import Engine
    from hetserve.runtime.engine_config import EngineConfig
    from hetserve.serve.replan import Replanner
    from hetserve.serve.coordinator import Coordinator
    from hetserve.serve.engine_backend import EngineBackend
    from hetserve.serve.fake import ByteCodec

    held = threading.Event()  # the test has seen the hold and submitted into it
    if not replan_works:
        def refuse(*_a, **_k):
            held.wait(30)  # failing at once would end the hold before the test could see it
            raise TimeoutError()  # no message: the error still says what went wrong
        monkeypatch.setattr("hetserve.planner.replan.replan", refuse)
    only = Plan.from_dict({"model": "tiny", "cluster": "runtime-test", "replicas": [
        {"id": "c0", "role": "colocated", "stages": [{"devices": ["m0:0"], "layers": [0, 3]}]}]})
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    eng = Engine.from_plan(only, cluster_file, model_dirs["opt"], EngineConfig(kv_capacity_tokens=2048))
    replanner = Replanner(eng, "azure-conv", time_limit_s=5, on_failure=True)
    try:
        want = eng.generate(PROMPTS, params, timeout=60)
        handles = [eng.submit(p, params) for p in PROMPTS[:2]]
        next(iter(handles[0]))
        os.kill(eng.worker_pids()["m0:0"], signal.SIGKILL)  # the only replica
        deadline = time.monotonic() + 30
        while eng.stats().get("holding_s") is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert eng.stats()["holding_s"] is not None and eng.broken is None
        handles += [eng.submit(p, params) for p in PROMPTS[2:]]  # taken while none serves
        held.set()
        if replan_works:
            assert [h.result(timeout=120) for h in handles] == want
            (record,) = replanner.history
            assert record["retired"] == ["c0"] and record["added"]
            assert eng.stats()["failed"] == 0 and eng.stats()["holding_s"] is None
        else:
            for h in handles:
                with pytest.raises(RuntimeFailure, match=r"the re-plan failed: TimeoutError\(\)"):
                    h.result(timeout=60)
            assert "no replica left" in eng.broken
            # the server in front refuses at the door (503 naming why), not inside a started stream
            why = Coordinator(EngineBackend(eng), ByteCodec(), "tiny").unavailable()
            assert why and "the re-plan failed: TimeoutError()" in why, why
    finally:
        replanner.close()
        eng.shutdown()


@pytest.mark.timeout(180)
def test_a_kept_prefill_replica_hands_off_to_a_new_decode_replica(model_dirs, cluster_file):
    """The running prefill workers learn the new layout: their KV reaches a decode replica (TP 2)
    that did not exist when they started, and the outputs are the undisturbed ones."""
    from hetserve.planner.plan import Plan
    from hetserve.runtime.engine import Engine
    from hetserve.runtime.engine_config import EngineConfig

    def plan(decode, routes):
        return Plan.from_dict({"model": "tiny", "cluster": "runtime-test", "replicas": [
            {"id": "p0", "role": "prefill", "stages": [{"devices": ["m0:0"], "layers": [0, 3]}]}, *decode],
            "kv_routes": [{"from": "p0", "to": d, "weight": 1.0} for d in routes]})

    d0 = {"id": "d0", "role": "decode", "stages": [{"devices": ["m0:1"], "layers": [0, 3]}]}
    d1 = {"id": "d1", "role": "decode", "stages": [{"devices": ["m0:2"], "layers": [0, 1]},
                                                   {"devices": ["m0:3"], "layers": [1, 3]}]}
    d2 = {"id": "d2", "role": "decode", "stages": [{"devices": ["m0:2", "m0:3"], "layers": [0, 3]}]}
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    eng = Engine.from_plan(plan([d0, d1], ["d0", "d1"]), cluster_file, model_dirs["opt"],
                           EngineConfig(kv_capacity_tokens=1024))
    try:
        want = eng.generate(PROMPTS, params, timeout=60)
        os.kill(eng.worker_pids()["m0:2"], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not eng.stats()["deaths"] and time.monotonic() < deadline:
            time.sleep(0.05)
        record = eng.reconfigure(plan([d0, d2], ["d2"]))  # the plan routes all of p0's KV to the new d2
        assert record["kept"] == ["d0", "p0"] and record["retired"] == ["d1"] and record["added"] == ["d2"]
        assert eng.generate(PROMPTS, params, timeout=60) == want
        assert eng.stats()["replicas"]["d2"]["steps"] > 0 and eng.stats()["failed"] == 0
    finally:
        eng.shutdown()


@pytest.mark.timeout(180)
def test_a_new_replica_never_takes_the_id_of_one_retired_before(model_dirs, cluster_file):
    """Metrics and logs name a replica by id for the engine's whole life: a later plan's replica
    named like a retired one is renamed."""
    from hetserve.planner.plan import Plan
    from hetserve.runtime.engine import Engine
    from hetserve.runtime.engine_config import EngineConfig

    def plan(*replicas):
        return Plan.from_dict({"model": "tiny", "cluster": "runtime-test", "replicas": [
            {"id": rid, "role": "colocated", "stages": [{"devices": [dev], "layers": [0, 3]}]} for rid, dev in replicas]})

    params = SamplingParams(max_tokens=4, ignore_eos=True)
    eng = Engine.from_plan(plan(("c0", "m0:0"), ("c1", "m0:1")), cluster_file, model_dirs["opt"],
                           EngineConfig(kv_capacity_tokens=1024))
    try:
        assert eng.reconfigure(plan(("c0", "m0:0")))["retired"] == ["c1"]
        record = eng.reconfigure(plan(("c0", "m0:0"), ("c1", "m0:2")))
        assert record["added"] == ["c1.1"] and set(eng.stats()["replicas"]) == {"c0", "c1.1"}
        assert len(eng.submit(PROMPTS[0], params, replica="c1.1").result(timeout=60)) == 4
    finally:
        eng.shutdown()
