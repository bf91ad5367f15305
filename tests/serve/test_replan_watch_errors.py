"""A failure's re-plan that breaks on an internal error (a bug, not a plan that cannot be made) says
so: the log line and the reason the held requests fail with name the exception's type, and the log
has its traceback. A KeyError's own text is the bare key (``'c0.2'``), which tells an operator nothing."""

from __future__ import annotations

import logging
import time

import pytest

from hetserve.errors import PlanError
from hetserve.serve.replan import Replanner
from tests.serve.test_replan_servable import _Engine


class _BrokenEngine(_Engine):
    _closed = False

    def __init__(self, error: Exception):
        super().__init__()
        self.ended, self.error = [], error

    def hold_while_empty(self, seconds):
        pass

    def end_hold(self, reason):
        self.ended.append(reason)

    def reconfigure(self, plan, cluster):
        raise self.error


@pytest.mark.parametrize("error,said,traceback", [
    (KeyError("c0.2"), "KeyError: 'c0.2'", True),  # a bug: its type named, its traceback logged
    # a planner's refusal is the operator's news, not a bug: its own words, no type, no traceback
    (PlanError("re-plan: no replica fits"), "re-plan: no replica fits", False)])
def test_a_failures_replan_that_breaks_says_why(caplog, error, said, traceback):
    eng = _BrokenEngine(error)
    with caplog.at_level(logging.INFO, logger="hetserve.serve"):
        replanner = Replanner(eng, workload="azure-conv", time_limit_s=2, on_failure=True)
        try:
            end = time.monotonic() + 60
            while not eng.ended and time.monotonic() < end:
                time.sleep(0.05)
        finally:
            replanner.close()
    assert eng.ended == [f"the re-plan failed: {said}"], eng.ended
    (rec,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert rec.getMessage().endswith(f"failed: {said}"), rec.getMessage()
    assert (rec.exc_info is not None) == traceback  # the traceback says where a bug is
