"""The re-plan's record and log line name the roles kept replicas moved to since the last plan, the
switch a worker's death made included, so they agree with ``/health`` (which shows the live role)."""

from __future__ import annotations

import logging

from hetserve.serve.replan import Replanner, role_changes
from tests.serve.test_replan_servable import _Engine


def test_role_changes_chain_the_plans_role_the_live_one_and_the_replans():
    planned = {"p0": "prefill", "c0": "colocated", "c1": "colocated"}
    live = {"p0": "colocated", "c0": "colocated", "c1": "colocated"}
    replanned = {"c1": ["colocated", "decode"]}
    assert role_changes(planned, live, replanned, ["p0", "c0", "c1"]) == {
        "p0": ["prefill", "colocated"], "c1": ["colocated", "decode"]}
    # switched at the death, then back by the re-plan: both moves shown
    assert role_changes({"p0": "prefill"}, {"p0": "colocated"}, {"p0": ["colocated", "prefill"]}, ["p0"]) == {
        "p0": ["prefill", "colocated", "prefill"]}


class _SwitchedEngine(_Engine):
    """The decode replica's death switched prefill replica p0 to colocated, as the engine does."""

    def stats(self):
        return {"deaths": [{"worker": "m1:1", "why": "killed", "at": 0.0}],
                "replicas": {"p0": {"alive": True, "role": "colocated"}, "d0": {"alive": False, "role": "decode"}}}


def test_a_replan_after_a_death_logs_the_role_the_death_switched(caplog):
    eng = _SwitchedEngine()
    with caplog.at_level(logging.INFO, logger="hetserve.serve"):
        record = Replanner(eng, workload="azure-conv", time_limit_s=2).replan(trigger="failure")
    assert record["kept"] == ["p0"] and record["role_changes"] == {"p0": ["prefill", "colocated"]}, record
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("re-plan (failure"))
    assert "since the last plan: p0 prefill -> colocated" in line, line
