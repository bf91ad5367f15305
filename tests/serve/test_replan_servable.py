"""A re-plan is made for the requests the engine serves, as ``hetserve plan`` plans: on demo-tiny,
after decode replica d0's device m1:1 dies, the freed m0:0 holds a colocated replica only when the
requests beyond the model's context (whose KV no single device holds) are left out, as the CLI
leaves them out; the re-plan must add that replica, not leave m0:0 idle."""

from __future__ import annotations

import json

import pytest

from hetserve.planner.plan import Plan
from hetserve.runtime.model.config import ArchConfig
from hetserve.serve.replan import Replanner
from hetserve.specs.cluster import load_cluster
from tests.planner.test_replan_roles import CONFIG as ROLES_CONFIG, RUNNING

# the planner's re-plan tests' engine: a P/D plan on demo-tiny whose decode worker on m1:1 died
CONFIG = ROLES_CONFIG  # no _name_or_path: the architecture alone names nothing


class _Engine:
    """What the re-planner reads of an engine whose decode worker on m1:1 died."""

    cluster = load_cluster("demo-tiny")
    arch = ArchConfig.from_dict(json.loads(json.dumps(CONFIG)))
    dtype = "float32"
    plan = Plan.from_dict(RUNNING)

    def __init__(self):
        self.given = None

    def stats(self):
        return {"deaths": [{"worker": "m1:1", "why": "killed", "at": 0.0}],
                "replicas": {"p0": {"alive": True}, "d0": {"alive": False}}}

    def worker_pids(self):
        return {}

    def reconfigure(self, plan, cluster):
        self.given = plan
        old = {r.id for r in self.plan.replicas}
        return {"kept": sorted(old & {r.id for r in plan.replicas}), "roles": [],
                "retired": sorted(old - {r.id for r in plan.replicas}),
                "added": sorted({r.id for r in plan.replicas} - old), "start_s": 0.0}


def test_a_replan_after_a_loss_uses_the_survivor_the_context_rule_makes_plannable():
    eng = _Engine()
    record = Replanner(eng, workload="azure-conv", time_limit_s=2).replan(trigger="failure")
    assert record["lost"] == ["m1:1"] and record["retired"] == ["d0"]
    added = [r for r in eng.given.replicas if r.id in record["added"]]
    assert [r.devices for r in added] == [("m0:0",)], [(r.id, r.role, r.devices) for r in eng.given.replicas]


def test_a_replan_workload_with_no_request_within_the_context_is_refused_when_serving_starts(tmp_path):
    """With --replan-on-failure the re-plan runs only after a failure, where its error could only be
    logged: a workload none of whose requests fits the model's context is refused at start."""
    from hetserve.errors import SpecError

    trace = tmp_path / "long.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n0,5000,10\n1,6000,10\n")
    eng = _Engine()
    eng.hold_while_empty = lambda s: pytest.fail("held before the workload was checked")
    with pytest.raises(SpecError, match="long.csv.*tiny-llama's context"):  # the plan's name for the model
        Replanner(eng, workload=str(trace), on_failure=True)


@pytest.mark.parametrize("starts", [True, False])
def test_a_returned_device_counts_as_lost_until_its_replica_serves(starts):
    """/health reads ``Replanner.lost``: a returned device leaves it only once the re-plan's replicas
    have started, and stays in it if they could not (it said ``ok`` while they started, and kept
    saying so after they failed)."""
    from hetserve.errors import RuntimeFailure

    class _Starting(_Engine):
        fails = False

        def reconfigure(self, plan, cluster):
            self.lost_meanwhile = set(replanner.lost)
            if self.fails:
                raise RuntimeFailure("worker m1:1 (replica p1, stage 0, TP rank 0) failed to load its shard")
            return super().reconfigure(plan, cluster)

    eng = _Starting()
    replanner = Replanner(eng, workload="azure-conv", time_limit_s=2)
    replanner.replan(trigger="failure")
    assert replanner.lost == {"m1:1"}
    eng.fails = not starts
    if starts:
        replanner.replan(returned=["m1:1"])
    else:
        with pytest.raises(RuntimeFailure):
            replanner.replan(returned=["m1:1"])
    assert eng.lost_meanwhile == {"m1:1"}
    assert replanner.lost == (set() if starts else {"m1:1"})
