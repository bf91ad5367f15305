"""A worker that dies while the re-plan's planner runs: the plan is made again without its device.
Handed on as it was, the plan would keep the replica that just died, and the engine (which keeps only
live replicas) would start a fresh copy of it on the same devices, the dead one's included; the next
re-plan would then retire that copy again."""

from __future__ import annotations

from hetserve.serve.replan import Replanner
from tests.serve.test_replan_servable import _Engine


class _DyingEngine(_Engine):
    """d0's worker on m1:1 died before the re-plan; p0's on m1:0 dies while it plans."""

    def __init__(self):
        super().__init__()
        self.deaths = [{"worker": "m1:1", "why": "killed", "at": 0.0}]
        self.alive = {"p0": True, "d0": False}

    def stats(self):
        return {"deaths": list(self.deaths),
                "replicas": {rid: {"alive": up, "role": "colocated" if rid == "p0" else "decode"}
                             for rid, up in self.alive.items()}}


def test_a_death_while_planning_is_planned_around(monkeypatch):
    import hetserve.planner.replan as planner_replan

    eng = _DyingEngine()
    real, calls = planner_replan.replan, []

    def planning(*args, **kwargs):
        calls.append(set(args[4]))
        if len(calls) == 1:  # p0's worker dies while the first plan is made
            eng.deaths.append({"worker": "m1:0", "why": "killed", "at": 0.0})
            eng.alive["p0"] = False
        return real(*args, **kwargs)

    monkeypatch.setattr(planner_replan, "replan", planning)
    record = Replanner(eng, workload="azure-conv", time_limit_s=2).replan(trigger="failure")
    assert calls == [{"m1:1"}, {"m1:0", "m1:1"}], calls
    assert record["lost"] == ["m1:0", "m1:1"]
    assert not {"m1:0", "m1:1"} & {d for r in eng.given.replicas for d in r.devices}, eng.given.replicas
    assert "p0" not in {r.id for r in eng.given.replicas}  # the dead replica is not handed on as kept
