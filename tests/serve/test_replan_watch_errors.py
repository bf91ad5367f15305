"""A failure's re-plan that breaks on an internal error (a bug, not a plan that cannot be made) says
so: the log line and the reason the held requests fail with name the exception's type, and the log
has its traceback. A KeyError's own text is the bare key (``'c0.2'``), which tells an operator nothing."""

from __future__ import annotations

import logging
import time

from hetserve.serve.replan import Replanner
from tests.serve.test_replan_servable import _Engine


class _BrokenEngine(_Engine):
    _closed = False

    def __init__(self):
        super().__init__()
        self.ended = []

    def hold_while_empty(self, seconds):
        pass

    def end_hold(self, reason):
        self.ended.append(reason)

    def reconfigure(self, plan, cluster):
        raise KeyError("c0.2")


def test_an_internal_error_in_a_failures_replan_is_named_with_its_type(caplog):
    eng = _BrokenEngine()
    with caplog.at_level(logging.INFO, logger="hetserve.serve"):
        replanner = Replanner(eng, workload="azure-conv", time_limit_s=2, on_failure=True)
        try:
            end = time.monotonic() + 60
            while not eng.ended and time.monotonic() < end:
                time.sleep(0.05)
        finally:
            replanner.close()
    assert eng.ended == ["the re-plan failed: KeyError: 'c0.2'"], eng.ended
    (rec,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert rec.getMessage().endswith("failed: KeyError: 'c0.2'"), rec.getMessage()
    assert rec.exc_info is not None  # the traceback says where


def test_a_replan_that_cannot_be_made_keeps_its_own_words(caplog):
    """A planner's refusal (a PlanError) is the operator's news, not a bug: no type, no traceback."""
    from hetserve.errors import PlanError

    eng = _BrokenEngine()
    eng.reconfigure = lambda plan, cluster: (_ for _ in ()).throw(PlanError("re-plan: no replica fits"))
    with caplog.at_level(logging.INFO, logger="hetserve.serve"):
        replanner = Replanner(eng, workload="azure-conv", time_limit_s=2, on_failure=True)
        try:
            end = time.monotonic() + 60
            while not eng.ended and time.monotonic() < end:
                time.sleep(0.05)
        finally:
            replanner.close()
    assert eng.ended == ["the re-plan failed: re-plan: no replica fits"], eng.ended
    (rec,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert rec.exc_info is None
