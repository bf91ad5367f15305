"""A re-plan keeps a surviving replica whose devices and stages the new plan keeps, whatever role it
gives it: the runtime changes the role in place (its workers never restart), so a disaggregated
plan whose decode replica died keeps serving on its prefill replica through the re-plan."""

from __future__ import annotations

import os
import signal
import time

import pytest

from hetserve.runtime.params import SamplingParams

PROMPTS = [[i + 1] * (i + 2) for i in range(4)]
PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)


def _plan(*replicas, routes=()):
    """Replicas as (id, role, one device per stage), the 3 layers split evenly over the stages."""
    from hetserve.planner.plan import Plan

    def stages(devices):
        cut = [round(3 * i / len(devices)) for i in range(len(devices) + 1)]
        return [{"devices": [d], "layers": [cut[i], cut[i + 1]]} for i, d in enumerate(devices)]

    return Plan.from_dict({"model": "tiny", "cluster": "runtime-test", "replicas": [
        {"id": rid, "role": role, "stages": stages(devs)} for rid, role, devs in replicas],
        "kv_routes": [{"from": a, "to": b, "weight": 1.0} for a, b in routes]})


PD = _plan(("p0", "prefill", ["m0:0"]), ("d0", "decode", ["m0:1"]), routes=[("p0", "d0")])


def _kill(eng, worker: str) -> None:
    deaths = len(eng.stats()["deaths"])
    os.kill(eng.worker_pids()[worker], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while len(eng.stats()["deaths"]) == deaths and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(eng.stats()["deaths"]) > deaths


@pytest.fixture
def start(model_dirs, cluster_file):
    """``start(plan)``: an engine serving ``plan`` on the tiny OPT, shut down after the test."""
    from hetserve.runtime.engine import Engine
    from hetserve.runtime.engine_config import EngineConfig

    engines = []

    def run(plan):
        engines.append(Engine.from_plan(plan, cluster_file, model_dirs["opt"], EngineConfig(kv_capacity_tokens=1024)))
        return engines[-1]
    try:
        yield run
    finally:
        for eng in engines:
            eng.shutdown()


@pytest.mark.timeout(180)
def test_a_prefill_survivor_the_new_plan_makes_colocated_is_kept(start):
    """The decode replica died, so the prefill replica already decodes in place; a plan that has it
    colocated on the same devices and stages keeps it (same worker), it is not retired and restarted."""
    eng = start(PD)
    want = eng.generate(PROMPTS, PARAMS, timeout=60)
    pid = eng.worker_pids()["m0:0"]
    _kill(eng, "m0:1")
    record = eng.reconfigure(_plan(("p0", "colocated", ["m0:0"])))
    assert record["kept"] == ["p0"] and record["retired"] == ["d0"] and record["added"] == []
    assert eng.worker_pids()["m0:0"] == pid and eng.stats()["replicas"]["p0"]["role"] == "colocated"
    assert eng.generate(PROMPTS, PARAMS, timeout=60) == want
    assert eng.stats()["failed"] == 0


def _hands_off(eng, src: str, dst: str, want) -> None:
    """The prompts give ``want`` again, ``src`` running one prefill step per prompt at most and
    the decode steps running on ``dst``, none failed."""
    steps = eng.stats()["replicas"][src]["steps"]
    assert eng.generate(PROMPTS, PARAMS, timeout=60) == want
    stats = eng.stats()["replicas"]
    assert stats[dst]["steps"] > 0 and stats[src]["steps"] - steps <= len(PROMPTS)
    assert eng.stats()["failed"] == 0


@pytest.mark.timeout(180)
def test_a_survivor_turned_colocated_hands_off_to_a_new_decode_replica(start):
    """The same survivor, re-planned as a prefill replica beside a new decode replica: it turns
    prefill in place and its KV reaches the new replica (no decode in place on it any more)."""
    eng = start(PD)
    want = eng.generate(PROMPTS, PARAMS, timeout=60)
    pid = eng.worker_pids()["m0:0"]
    _kill(eng, "m0:1")
    assert eng.stats()["replicas"]["p0"]["role"] == "colocated"
    record = eng.reconfigure(_plan(("p0", "prefill", ["m0:0"]), ("d1", "decode", ["m0:2", "m0:3"]),
                                   routes=[("p0", "d1")]))
    assert record["kept"] == ["p0"] and record["retired"] == ["d0"] and record["added"] == ["d1"]
    assert eng.worker_pids()["m0:0"] == pid and eng.stats()["replicas"]["p0"]["role"] == "prefill"
    _hands_off(eng, "p0", "d1", want)


@pytest.mark.timeout(180)
def test_colocated_replicas_replanned_as_prefill_and_decode_keep_their_workers(start):
    """Roles change in place both ways: two colocated replicas planned as a prefill and a decode
    replica on the same devices hand off KV between the workers they started with."""
    eng = start(_plan(("c0", "colocated", ["m0:0"]), ("c1", "colocated", ["m0:1"])))
    want = eng.generate(PROMPTS, PARAMS, timeout=60)
    pids = eng.worker_pids()
    record = eng.reconfigure(_plan(("c0", "prefill", ["m0:0"]), ("c1", "decode", ["m0:1"]), routes=[("c0", "c1")]))
    assert record["kept"] == ["c0", "c1"] and not record["retired"] and not record["added"]
    assert record["roles"] == {"c0": ["colocated", "prefill"], "c1": ["colocated", "decode"]}
    assert eng.worker_pids() == pids
    _hands_off(eng, "c0", "c1", want)


@pytest.mark.timeout(240)
def test_the_on_failure_replan_keeps_the_prefill_survivor_serving(start):
    """``--replan-on-failure`` after the decode replica's death: the re-plan keeps the prefill
    replica, a two-stage pipeline, as it is (same workers; planning its devices afresh would make
    other replicas of them) and the engine never has no replica to serve while it runs."""
    from hetserve.serve.replan import Replanner

    eng = start(_plan(("p0", "prefill", ["m0:0", "m0:2"]), ("d0", "decode", ["m0:1"]), routes=[("p0", "d0")]))
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    want = eng.generate(PROMPTS, params, timeout=60)
    pids = {d: eng.worker_pids()[d] for d in ("m0:0", "m0:2")}
    replanner = Replanner(eng, "azure-conv", time_limit_s=5, on_failure=True)
    try:
        handles = [eng.submit(p, params) for p in PROMPTS]
        next(iter(handles[0]))
        os.kill(eng.worker_pids()["m0:1"], signal.SIGKILL)
        held = []  # whether the engine held requests for want of a replica, sampled until the re-plan ends
        deadline = time.monotonic() + 120
        while not replanner.history and time.monotonic() < deadline:
            held.append(eng.stats().get("holding_s") is not None)
            time.sleep(0.02)
        (record,) = replanner.history
        assert "p0" in record["kept"] and record["retired"] == ["d0"], record
        assert eng.plan.replica("p0").role == "colocated" and not any(held)
        assert {d: eng.worker_pids()[d] for d in pids} == pids
        assert [h.result(timeout=60) for h in handles] == want
        assert eng.stats()["failed"] == 0
    finally:
        replanner.close()


def test_a_replica_turned_colocated_feeds_chunks_under_chunked_prefill():
    """Chunked prefill follows the live role: a prefill replica that turns colocated (its decode
    replicas died, or a re-plan) feeds prompts in chunks like one planned colocated."""
    from collections import deque

    from hetserve.runtime.handle import RequestHandle
    from hetserve.runtime.kv_cache import BlockManager
    from hetserve.runtime.scheduler import ReplicaScheduler
    from hetserve.runtime.sequence import Sequence

    sched = ReplicaScheduler("p0", "prefill", BlockManager(64, 16), num_stages=1, prefill_mode="chunked",
                             chunk_tokens=8)
    sched.role = "colocated"
    (seq,) = sched.next_step(deque([Sequence(1, [1] * 20, PARAMS, 0, frozenset(), RequestHandle(1, 20))]))
    assert seq.next_input() == (0, [1] * 8)
