"""How a worker's start-up failure is worded (``WorkerGroup._await_all``): by what failed. A worker
that could not start (its endpoint found no port to listen on) says so, not that loading failed;
a failure while it loads keeps its traceback's last line and the whole traceback as a note."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hetserve.errors import RuntimeFailure, WorkerStartFailure
from hetserve.runtime.workers.wire import Message
from hetserve.runtime.workers.worker_group import WorkerGroup

NO_PORT = ("--port-range 22000-22004: no free port left on 127.0.0.1 for endpoint m1:0, every one of its 5 "
           "is taken; widen the range")
LOAD_ERROR = ('Traceback (most recent call last):\n  File "worker.py", line 1, in load\n'
              "RuntimeError: checkpoint shard model-00002.safetensors is truncated\n")


def _group(start_timeout_s: float = 30) -> WorkerGroup:
    worker = SimpleNamespace(name="m1:0", replica="d1", stage=0, tp_rank=0)
    layout = (SimpleNamespace(id="d1", workers=(worker,)),)
    return WorkerGroup(layout, transport=None, start_timeout_s=start_timeout_s)


def _failure(error: str) -> RuntimeFailure:
    """The failure the ready round raises when worker m1:0 reports ``error`` and exits."""
    messages = [Message("error", {"worker": "m1:0", "error": error})]
    proc = SimpleNamespace(exitcode=None)
    with pytest.raises(RuntimeFailure) as info:
        _group()._await_all("ready", "load its shard and capture its graphs", {"m1:0": proc},
                            lambda timeout: messages.pop() if messages else None)
    return info.value


def test_a_worker_that_could_not_listen_is_not_said_to_have_failed_to_load():
    exc = _failure(NO_PORT)
    assert str(exc) == f"worker m1:0 (replica d1, stage 0, TP rank 0) could not start: {NO_PORT}"
    assert exc.workers == ("m1:0",)  # the device a re-plan's next try plans without


def test_a_worker_that_failed_while_loading_says_so_with_its_traceback_as_a_note():
    exc = _failure(LOAD_ERROR)
    assert str(exc) == ("worker m1:0 (replica d1, stage 0, TP rank 0) failed to load its shard and capture its "
                        "graphs: RuntimeError: checkpoint shard model-00002.safetensors is truncated")
    assert exc.__notes__ == [LOAD_ERROR]


def test_a_worker_that_exited_after_reporting_it_could_not_listen_is_worded_the_same():
    messages = [Message("error", {"worker": "m1:0", "error": NO_PORT})]
    with pytest.raises(RuntimeFailure, match=r"^worker m1:0 \(replica d1, stage 0, TP rank 0\) could not start: "
                                             r"--port-range 22000-22004: no free port left"):
        _group()._await_all("ready", "load its shard and capture its graphs", {"m1:0": SimpleNamespace(exitcode=1)},
                            lambda timeout: messages.pop() if messages else None)


def test_a_new_replicas_worker_failing_in_a_re_plan_is_named_from_the_replicas_being_started(monkeypatch):
    """A re-plan's new replicas are not in the group's layout until they have started: a worker of
    one that fails while loading is named from them (it was a bare StopIteration from the lookup)."""
    group = _group()
    new = SimpleNamespace(name="m2:0", replica="c2", stage=1, tp_rank=0)
    started = {"m2:0": SimpleNamespace(exitcode=None, kill=lambda: None, join=lambda timeout=None: None)}
    monkeypatch.setattr(group, "_spawn", lambda replicas, make_config, start_method: started)
    messages = [Message("error", {"worker": "m2:0", "error": LOAD_ERROR})]
    with pytest.raises(RuntimeFailure, match=r"^worker m2:0 \(replica c2, stage 1, TP rank 0\) failed to load its "
                                             r"shard and capture its graphs: RuntimeError: checkpoint shard"):
        group.start_more((SimpleNamespace(id="c2", workers=(new,)),), (), None, "spawn",
                         lambda timeout: messages.pop() if messages else None)


def test_a_start_up_failure_names_the_workers_that_failed():
    """A re-plan tried again plans without the devices of the workers that failed to start
    (``serve.replan``): an error, an exit, or silence past the start-up timeout names them."""
    for error in (NO_PORT, LOAD_ERROR):
        exc = _failure(error)
        assert isinstance(exc, WorkerStartFailure) and exc.workers == ("m1:0",), error
    with pytest.raises(WorkerStartFailure, match="did not load") as info:
        _group(start_timeout_s=0)._await_all("ready", "load its shard", {"m1:0": SimpleNamespace(exitcode=None)},
                                             lambda timeout: None)
    assert info.value.workers == ("m1:0",)
