"""A failure's re-plan whose new workers fail to start is tried again with back-off, the devices whose
workers failed counted lost for the next plan; each try is counted (``hetserve_replans_total``),
logged once and kept in the history, until one serves or no try is left (the held requests then
fail); a graceful shutdown stops the tries."""

from __future__ import annotations

import asyncio
import copy
import logging
import threading

import pytest

from hetserve.errors import WorkerStartFailure
from hetserve.planner.plan import Plan
from hetserve.serve import replan as replan_module
from hetserve.serve.coordinator import Coordinator
from hetserve.serve.fake import ByteCodec, FakeBackend
from hetserve.serve.replan import Replanner
from tests.planner.test_replan_roles import RUNNING
from tests.serve.test_replan_servable import _Engine


def planned_without(lost: set[str]) -> Plan:
    """What the stand-in planner gives: p0 kept (colocated), and a colocated replica c1 on the freed
    m0:0 unless m0:0 is lost."""
    plan = copy.deepcopy(RUNNING)
    p0 = dict(plan["replicas"][0], role="colocated")
    c1 = {"id": "c1", "role": "colocated", "stages": [{"devices": ["m0:0"], "layers": [0, 8]}]}
    plan.update(replicas=[p0] + ([] if "m0:0" in lost else [c1]), kv_routes=[])
    return Plan.from_dict(plan)


class _FailingStarts(_Engine):
    """The engine whose decode worker on m1:1 died; the workers a re-plan adds fail to start the
    first ``fails`` times (None: always)."""

    _closed = False

    def __init__(self, fails: int | None):
        super().__init__()
        self.fails, self.tries, self.ended = fails, 0, []
        self.hold_ended = threading.Event()

    def hold_while_empty(self, seconds):
        pass

    def end_hold(self, reason):
        self.ended.append(reason)
        self.hold_ended.set()

    def reconfigure(self, plan, cluster):
        self.tries += 1
        added = [r for r in plan.replicas if r.id not in {x.id for x in self.plan.replicas}]
        if added and (self.fails is None or self.tries <= self.fails):
            device = added[0].devices[0]
            raise WorkerStartFailure(f"worker {device} (replica {added[0].id}, stage 0, TP rank 0) could not "
                                     "start: no free port left", (device,))
        return super().reconfigure(plan, cluster)


@pytest.fixture
def planner(monkeypatch):
    """The stand-in planner (``planned_without``); the lost devices of each call, in order."""
    calls = []

    def plan(cluster, spec, workload, running, lost, **kwargs):
        calls.append(set(lost))
        return planned_without(set(lost))

    monkeypatch.setattr("hetserve.planner.replan.replan", plan)
    return calls


def watched(eng, done, wait_until) -> Replanner:
    """A failure-watching re-planner over ``eng``, run until ``done(replanner)`` (bounded) and closed."""
    replanner = Replanner(eng, workload="azure-conv", time_limit_s=2, on_failure=True)
    try:
        assert wait_until(lambda: done(replanner), timeout_s=60)
    finally:
        replanner.close()
    return replanner


def test_a_replan_whose_workers_failed_to_start_is_tried_again_without_their_device(planner, monkeypatch,
                                                                                   caplog, wait_until):
    monkeypatch.setattr(replan_module, "RETRY_FIRST_S", 0.01)
    eng = _FailingStarts(fails=1)
    with caplog.at_level(logging.INFO, logger="hetserve.serve"):
        replanner = watched(eng, lambda r: len(r.history) == 2, wait_until)
    assert planner == [{"m1:1"}, {"m1:1", "m0:0"}]  # the next plan is made without the failed device
    failed, done = replanner.history
    assert (failed["trigger"], failed["outcome"], failed["try"], failed["retry_in_s"]) == ("failure", "failed", 1, 0.01)
    assert "m0:0" in failed["error"] and failed["lost"] == ["m0:0", "m1:1"]
    assert (done["trigger"], done["outcome"], done["try"], done["added"]) == ("retry", "done", 2, []), done
    assert replanner.lost == {"m0:0", "m1:1"}  # until an operator returns it
    assert dict(replanner.counts) == {("failure", "failed"): 1, ("retry", "done"): 1}
    assert eng.ended == []  # the held requests were served by the second try, not failed
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(("re-plan after", "re-plan ("))]
    assert len(lines) == 2, lines  # each try once, with its outcome
    assert "failed (try 1 of 9)" in lines[0] and "m0:0 counted lost, trying again in 0.01 s" in lines[0], lines
    assert lines[1].startswith("re-plan (retry, try 2 of 9;"), lines


def test_the_tries_back_off_and_end_where_none_is_left(planner, monkeypatch, caplog, wait_until):
    monkeypatch.setattr(replan_module, "RETRY_FIRST_S", 0.001)
    monkeypatch.setattr(replan_module, "RETRY_MAX_S", 0.004)
    monkeypatch.setattr(replan_module, "RETRIES", 4)
    eng = _FailingStarts(fails=None)
    # each plan adds m0:0 again, as a planner may where nothing else is free
    monkeypatch.setattr("hetserve.planner.replan.replan", lambda *a, **k: planned_without(set()))
    with caplog.at_level(logging.INFO, logger="hetserve.serve"):
        replanner = watched(eng, lambda r: eng.ended, wait_until)
    assert [h["retry_in_s"] for h in replanner.history] == [0.001, 0.002, 0.004, 0.004, None]  # doubling, capped
    assert [h["trigger"] for h in replanner.history] == ["failure"] + ["retry"] * 4 and eng.tries == 5
    assert len(eng.ended) == 1 and eng.ended[0].startswith("the re-plan failed: worker m0:0"), eng.ended
    warned = [r for r in caplog.records if "re-plan after" in r.getMessage()]
    assert [r.levelno for r in warned] == [logging.WARNING] * 4 + [logging.ERROR], [r.getMessage() for r in warned]
    assert "(try 5 of 5)" in warned[-1].getMessage() and "not tried again" in warned[-1].getMessage()
    coord = Coordinator(FakeBackend(), ByteCodec(), "tiny")
    coord.replanner = replanner
    text = coord.metrics.render()[0].decode()
    assert 'hetserve_replans_total{outcome="failed",trigger="failure"} 1.0' in text
    assert 'hetserve_replans_total{outcome="failed",trigger="retry"} 4.0' in text


def test_a_graceful_shutdown_stops_the_tries(planner, monkeypatch, wait_until):
    monkeypatch.setattr(replan_module, "RETRY_FIRST_S", 600.0)  # the next try would wait this long
    eng = _FailingStarts(fails=None)
    replanner = Replanner(eng, workload="azure-conv", time_limit_s=2, on_failure=True)
    try:
        assert wait_until(lambda: replanner.history, timeout_s=60)
        coord = Coordinator(FakeBackend(), ByteCodec(), "tiny")
        coord.replanner = replanner
        asyncio.run(coord.drain(0.1))
        assert eng.hold_ended.wait(30)  # without the stop: not before the 600 s back-off
    finally:
        replanner.close()
    assert eng.ended == ["the server is shutting down: no re-plan will bring a replica back"]
    assert eng.tries == 1 and dict(replanner.counts) == {("failure", "failed"): 1}
