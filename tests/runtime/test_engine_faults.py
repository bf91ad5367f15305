"""Faults on the real engine: a killed or frozen worker loses no request while a live replica can
serve it; the last replica's death fails what is left with one clear error."""

from __future__ import annotations

import os
import signal
import time

import pytest

from hetserve.errors import RuntimeFailure
from hetserve.runtime.params import SamplingParams

PROMPTS = [[i + 1] * (i + 2) for i in range(4)]


def two_colocated_plan():
    from hetserve.planner.plan import Plan

    return Plan.from_dict({"model": "tiny", "cluster": "runtime-test", "replicas": [
        {"id": f"c{i}", "role": "colocated", "stages": [{"devices": [f"m0:{i}"], "layers": [0, 3]}]}
        for i in range(2)]})


def _wait_first_tokens(handles):
    for h in handles:
        next(iter(h))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("worker,dead,survivor", [
    ("m0:3", "d0", "p0"),  # the decode replica's second stage: the prefill replica decodes in place
    ("m0:0", "p0", "d0"),  # the prefill replica's TP rank 0: the decode replica prefills in place
])
def test_a_pd_plan_losing_one_side_reruns_on_the_other(model_dirs, cluster_file, plans, caplog,
                                                      worker, dead, survivor):
    """Kill -9 the only replica of one role mid-stream: the other turns colocated, every stream
    continues to exactly the greedy output an undisturbed run gives, later requests succeed, and the
    deployment is not declared broken while a live replica can hold the requests."""
    from hetserve.runtime.engine import Engine
    from hetserve.runtime.engine_config import EngineConfig

    params = SamplingParams(max_tokens=40, ignore_eos=True)
    eng = Engine.from_plan(plans.disaggregated(), cluster_file, model_dirs["opt"], EngineConfig(kv_capacity_tokens=4096))
    try:
        want = eng.generate(PROMPTS, params, timeout=60)  # undisturbed, through the hand-off
        handles = [eng.submit(p, params) for p in PROMPTS]
        _wait_first_tokens(handles)
        os.kill(eng.worker_pids()[worker], signal.SIGKILL)
        assert [h.result(timeout=60) for h in handles] == want
        assert all(h.finish_reason == "length" for h in handles)
        assert eng.submit(PROMPTS[0], params).result(timeout=60) == want[0]
        stats = eng.stats()
        assert stats["failed"] == 0 and stats["broken"] is None
        assert [d["replica"] for d in stats["deaths"]] == [dead]
        assert stats["replicas"][dead]["alive"] is False and stats["replicas"][survivor]["role"] == "colocated"
        # a dead replica holds no KV: its pool went with its workers (its gauges read 0, not the moment it died)
        assert (stats["replicas"][dead]["kv_used_blocks"], stats["replicas"][dead]["state"]["kv_used_tokens"]) == (0, 0)
        # the operator hears of it (the server's log), not only /health and /metrics
        assert any(worker in r.getMessage() and f"{survivor} colocated" in r.getMessage() for r in caplog.records)
    finally:
        eng.shutdown()
    assert all(p.exitcode is not None for p in eng.procs.values())


@pytest.mark.timeout(180)
def test_requests_decoding_elsewhere_survive_their_prefill_replicas_death(model_dirs, cluster_file, plans):
    """Kill -9 the prefill replica once every request decodes on the decode replica: nothing of
    theirs was on it, so none is re-run (a re-run beside the decode steps in flight streamed each
    token twice), and every stream ends as an undisturbed run does."""
    from hetserve.runtime.engine import Engine
    from hetserve.runtime.engine_config import EngineConfig

    params = SamplingParams(max_tokens=40, ignore_eos=True)
    eng = Engine.from_plan(plans.disaggregated(), cluster_file, model_dirs["opt"], EngineConfig(kv_capacity_tokens=4096))
    try:
        want = eng.generate(PROMPTS, params, timeout=60)
        # placed on p0 as the server's placement places them (the request remembers it: ``pinned``)
        handles = [eng.submit(p, params, replica="p0") for p in PROMPTS]
        for h in handles:  # the first token comes from the prefill, the next ones from the decode replica
            tokens = iter(h)
            for _ in range(3):
                next(tokens)
        os.kill(eng.worker_pids()["m0:0"], signal.SIGKILL)
        assert [h.result(timeout=60) for h in handles] == want
        stats = eng.stats()
        assert [(d["replica"], d["requests"]) for d in stats["deaths"]] == [("p0", 0)]
        assert stats["failed"] == 0 and stats["replicas"]["d0"]["role"] == "colocated"
    finally:
        eng.shutdown()


@pytest.mark.timeout(180)
def test_frozen_worker_is_declared_dead_and_the_last_death_fails_cleanly(model_dirs, cluster_file):
    """SIGSTOP one of two replicas: no heartbeat, declared dead, its requests finish on the other
    with the same tokens. Then kill the last one: what is left fails with one error, submit refuses."""
    from hetserve.runtime.engine import Engine
    from hetserve.runtime.engine_config import EngineConfig

    params = SamplingParams(max_tokens=40, ignore_eos=True)
    config = EngineConfig(kv_capacity_tokens=4096, heartbeat_interval_s=0.1, heartbeat_timeout_s=2.0)
    eng = Engine.from_plan(two_colocated_plan(), cluster_file, model_dirs["llama"], config)
    try:
        want = eng.generate(PROMPTS, params, timeout=60)
        handles = [eng.submit(p, params, replica=f"c{i % 2}") for i, p in enumerate(PROMPTS)]
        _wait_first_tokens(handles)
        os.kill(eng.worker_pids()["m0:1"], signal.SIGSTOP)
        assert [h.result(timeout=60) for h in handles] == want
        death = eng.stats()["deaths"][0]
        assert death["replica"] == "c1" and "no heartbeat" in death["why"]
        # the frozen process was killed, not left behind. Polled: the coordinator thread reaps it too
        # (WorkerGroup.reap), and a read racing that thread's waitpid sees None for a moment (ECHILD)
        deadline = time.monotonic() + 10
        while eng.procs["m0:1"].exitcode is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert eng.procs["m0:1"].exitcode is not None

        long = eng.submit(PROMPTS[0], SamplingParams(max_tokens=400, ignore_eos=True))
        next(iter(long))
        os.kill(eng.worker_pids()["m0:0"], signal.SIGKILL)
        with pytest.raises(RuntimeFailure, match="m0:0.*no replica left"):
            long.result(timeout=30)
        with pytest.raises(RuntimeFailure, match="cannot serve"):
            eng.submit([1, 2, 3])
    finally:
        eng.shutdown()


@pytest.mark.timeout(120)
def test_workers_leave_stop_signals_to_the_server(model_dirs, cluster_file):
    """SIGTERM and SIGINT reach every worker when they are sent to the server's process group
    (``kill -- -PGID``, a service manager, Ctrl-C): the workers ignore them, so the stream the server
    is draining finishes with the tokens an undisturbed run gives, and no replica is lost."""
    from hetserve.runtime.engine import Engine
    from hetserve.runtime.engine_config import EngineConfig

    params = SamplingParams(max_tokens=40, ignore_eos=True)
    eng = Engine.from_plan(two_colocated_plan(), cluster_file, model_dirs["llama"], EngineConfig(kv_capacity_tokens=4096))
    try:
        want = eng.generate(PROMPTS[:2], params, timeout=60)
        handles = [eng.submit(p, params, replica=f"c{i}") for i, p in enumerate(PROMPTS[:2])]
        _wait_first_tokens(handles)
        for pid in eng.worker_pids().values():
            os.kill(pid, signal.SIGTERM)
            os.kill(pid, signal.SIGINT)
        assert [h.result(timeout=60) for h in handles] == want
        assert eng.stats().get("deaths", []) == [] and all(p.exitcode is None for p in eng.procs.values())
    finally:
        eng.shutdown()
    assert all(p.exitcode is not None for p in eng.procs.values())


def _is_zombie_or_gone(pid: int) -> bool | None:
    """True: ``pid`` (a child of this process) is a zombie; False: it runs; None: it is gone (reaped).
    ``WNOWAIT`` leaves a zombie as it is, so the check does not reap it as ``Process.exitcode`` would."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return None


@pytest.mark.timeout(120)
def test_a_dead_replicas_workers_are_reaped_not_left_as_zombies(model_dirs, cluster_file, plans):
    """Kill -9 one stage of a two-stage replica: the engine notices, kills the other stage, and
    waits for both, so neither stays a zombie process until shutdown."""
    from hetserve.runtime.engine import Engine
    from hetserve.runtime.engine_config import EngineConfig

    plan = plans.single(stages=((("m0:0",), (0, 2)), (("m0:1",), (2, 3))))
    eng = Engine.from_plan(plan, cluster_file, model_dirs["llama"], EngineConfig(kv_capacity_tokens=1024))
    try:
        pids = eng.worker_pids()
        os.kill(pids["m0:0"], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not eng.stats().get("deaths") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert eng.stats().get("deaths"), "the engine did not notice the killed worker"
        # reaping takes one exit poll after the kill (0.1 s); a zombie stays one for good
        while time.monotonic() < deadline and any(_is_zombie_or_gone(p) is not None for p in pids.values()):
            time.sleep(0.05)
        assert {n: _is_zombie_or_gone(p) for n, p in pids.items()} == {"m0:0": None, "m0:1": None}
    finally:
        eng.shutdown()


@pytest.mark.timeout(180)
def test_a_handoff_its_sender_cannot_make_reruns_and_then_fails_loudly(model_dirs, cluster_file, plans, caplog):
    """A prefill worker told to hand off to a replica its layout lacks says so (``kv_refused``)
    instead of sending nothing: the request re-runs, and once its re-runs are spent it fails with
    an error naming the cause; it never waits for KV that cannot come. The workers' layout is made
    stale by the coordinator's own address-book message, as a re-plan sends it."""
    from hetserve.runtime.engine import Engine
    from hetserve.runtime.engine_config import EngineConfig
    from hetserve.runtime.workers.transport import Priority
    from hetserve.runtime.workers.wire import Message

    params = SamplingParams(max_tokens=8, ignore_eos=True)
    eng = Engine.from_plan(plans.disaggregated(), cluster_file, model_dirs["llama"],
                           EngineConfig(kv_capacity_tokens=4096, max_reruns=1))
    try:
        assert len(eng.generate(PROMPTS[:1], params, timeout=60)[0]) == 8  # the hand-off works
        prefill = tuple(r for r in eng.layout if r.role == "prefill")
        for w in prefill[0].workers:
            eng.transport.send(w.name, Message("peers", {"addresses": {}, "layout": prefill}), Priority.CONTROL)
        with pytest.raises(RuntimeFailure, match="refused by worker m0:[01]: 'd0' is not a decode replica"):
            eng.submit(PROMPTS[1], params).result(timeout=60)
        assert any("hand-off refused" in r.getMessage() for r in caplog.records)
        # nothing leaks: every fence closed, and both replicas' KV blocks free again
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (eng.stats()["kv_fenced"]["pending"] or any(
                r["state"]["kv_used_tokens"] for r in eng.stats()["replicas"].values())):
            time.sleep(0.05)
        stats = eng.stats()
        assert stats["failed"] == 1 and stats["kv_fenced"]["pending"] == 0 and stats["kv_fenced"]["opened"] >= 1
        assert all(r["state"]["kv_used_tokens"] == 0 for r in stats["replicas"].values()), stats["replicas"]
    finally:
        eng.shutdown()
