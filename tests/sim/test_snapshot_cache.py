"""Placement snapshots kept between decisions (``SnapshotCache``) equal fresh ones at every decision."""

from dataclasses import replace

import numpy as np
import pytest

from hetserve.planner.plan import Plan
from hetserve.policies.finish_time import ExpectedFinishTime
from hetserve.policies.placement import JoinShortestQueue
from hetserve.sim import SimOptions
from hetserve.sim.simulator import Simulator
from hetserve.specs.workload import Workload

from .conftest import two_box_cluster
from .plans import single


def _without_waits(s):
    return replace(s, prefill_wait_s=0.0, queued_age_s=0.0)


class Checking:
    """Delegates to the simulator's placement; first compares each candidate with ``state()`` now
    (the waits only where the placement reads them: otherwise the cache need not keep them), and
    its ``outstanding_floor`` with its outstanding tokens."""

    needs_requests = False

    def __init__(self, sim):
        self.sim, self.inner, self.name = sim, sim.placement, sim.placement.name
        self.waits = getattr(sim.placement, "reads_waits", True)
        self.decisions = self.drained = 0  # drained: decisions x candidates whose drain bound told something

    def choose(self, request, candidates, now):
        fresh = [e.state(False) for e in self.sim.entry]
        if self.waits:
            assert list(candidates) == fresh
        else:
            assert [_without_waits(c) for c in candidates] == [_without_waits(c) for c in fresh]
        # a kept snapshot's floor and drain hold for as long as it is read
        assert all(c.outstanding_floor <= c.outstanding_tokens for c in candidates)
        drains = [(c.outstanding_drain, c.outstanding_tokens) for c in candidates if c.outstanding_drain]
        assert all(t <= now and tokens - rate * (now - t) <= held for (t, tokens, rate), held in drains)
        self.drained += sum(tokens - rate * (now - t) > 0 for (t, tokens, rate), _ in drains)
        self.decisions += 1
        return self.inner.choose(request, candidates, now)

    def on_finish(self, request_id, input_tokens, output_tokens):
        self.inner.on_finish(request_id, input_tokens, output_tokens)


def waves(n, inp=900, out=200, seed=0):
    """Bursts (requests arriving together) and quiet spells: replicas fill up, drain, and sit idle
    while their KV is pulled."""
    rng = np.random.default_rng(seed)
    arrivals = np.sort(np.concatenate([np.round(rng.uniform(0, 1, n // 2), 1) + 4.0 * rng.integers(0, 3, n // 2),
                                       rng.uniform(12, 12 + n // 8, n - n // 2)]))
    return Workload.from_lists("waves", arrivals, rng.integers(inp // 2, inp * 3 // 2, n),
                               rng.integers(out // 2, out * 3 // 2, n))


def two_stage_prefill() -> Plan:
    """A prefill replica over two stages: its first stage is free while its last still works."""
    stage = lambda dev, lo, hi: {"devices": [dev], "layers": [lo, hi]}  # noqa: E731
    return Plan.from_dict({"model": "llama-2-7b", "cluster": "test", "replicas": [
        {"id": "p0", "role": "prefill", "stages": [stage("m0:0", 0, 16), stage("m0:1", 16, 32)]},
        {"id": "p1", "role": "prefill", "stages": [stage("m0:2", 0, 32)]},
        {"id": "d0", "role": "decode", "stages": [stage("m1:0", 0, 32)]}],
        "kv_routes": [{"from": "p0", "to": "d0", "weight": 1}, {"from": "p1", "to": "d0", "weight": 1}]})


class WaitReading(JoinShortestQueue):
    """A placement that reads the waits: the kept snapshots must bring them up to now."""

    reads_waits = True


PD = {"p0": ["m0:0"], "p1": ["m0:1"], "p2": ["m0:2", "m0:3"], "d0": ["m1:0"], "d1": ["m1:1", "m1:2"]}
PD_ROUTES = [("p0", "d0", 0.5), ("p0", "d1", 0.5), ("p1", "d0", 1), ("p2", "d1", 1)]


@pytest.mark.parametrize("plan, opts", [
    (single(PD, routes=PD_ROUTES), SimOptions(placement="eft")),
    (single(PD, routes=PD_ROUTES), SimOptions(placement="jsq")),
    (single({"p0": ["m0:0"], "p1": ["m0:1"], "d0": ["m1:0"]}, routes=[("p0", "d0", 1), ("p1", "d0", 1)]),
     SimOptions(placement="lot", kv_admission="paged", kv_capacity_tokens=12000)),
    (single({"c0": ["m0:0"], "c1": ["m1:0", "m1:1"]}), SimOptions(placement="eft")),
    (single({"c0": ["m0:0"], "c1": ["m1:0"]}), SimOptions(placement="jsq", chunked_prefill=True)),
    (single({"c0": ["m0:0"], "c1": ["m1:0"]}), SimOptions(prefill_mode="prefill_first", kv_admission="paged",
                                                         kv_capacity_tokens=12000)),
    (single({"p0": ["m0:0"], "c0": ["m0:1"], "d0": ["m1:0"]}, routes=[("p0", "d0", 1)]),
     SimOptions(placement="rr")),
    (two_stage_prefill(), SimOptions(placement="jsq")),
    (single(PD, routes=PD_ROUTES), SimOptions(placement=WaitReading())),
    (single({"p0": ["m0:0"], "c0": ["m0:1"], "d0": ["m1:0"]}, routes=[("p0", "d0", 1)]),
     SimOptions(placement=WaitReading())),
], ids=["pd-eft", "pd-jsq", "pd-paged", "colocated-eft", "chunked", "prefill-first-paged", "mixed-roles",
        "two-stage-prefill", "pd-waits", "mixed-roles-waits"])
def test_every_decision_sees_the_snapshots_of_now(model, plan, opts):
    cluster = two_box_cluster(gbps_between=10.0)  # KV hand-offs outlast the gaps between arrivals
    sim = Simulator(plan, cluster, model, waves(240), opts)
    assert sim._snaps is not None  # the kept snapshots are what placement gets
    sim.placement = check = Checking(sim)
    res = sim.run()
    assert check.decisions == res.summary()["completed"] == 240
    if isinstance(check.inner, ExpectedFinishTime) and any(r.role == "colocated" for r in plan.replicas):
        assert check.drained > 0  # running batches' drain bounds were read
    if opts.kv_admission == "paged":  # pre-empted requests come back to their prefill replica
        assert res.info["preemptions"] > 0


class RankChecked(JoinShortestQueue):
    """JSQ whose every decision from the replicas filed by load (``choose_lowest``) is checked
    against ``choose`` over fresh snapshots of every entry replica, from the same turn; the least
    loaded it is handed are those of the fresh snapshots, each one's outstanding tokens as a fresh
    snapshot reads them and its bound at most those."""

    def __init__(self):
        super().__init__()
        self.sim, self.decisions = None, 0

    def choose_lowest(self, request, least, now):
        plain = JoinShortestQueue()
        plain._next = self._next
        fresh = [e.state(False) for e in self.sim.entry]
        expected = plain.choose(request, fresh, now)
        fewest = min(s.load for s in fresh)
        by_id = {s.id: s for s in fresh if s.load == fewest}
        ids = [least.id(i) for i in range(least.size)]
        assert ids == list(by_id)
        assert [least.tokens(i) for i in range(least.size)] == [by_id[i].outstanding_tokens for i in ids]
        assert all(least.bound(i) <= least.tokens(i) for i in range(least.size))
        bounds = [least.bound(i) for i in range(least.size)]
        assert least.least_bound() == bounds.index(min(bounds))
        got = super().choose_lowest(request, least, now)
        assert got == expected
        self.decisions += 1
        return got


@pytest.mark.parametrize("plan, opts", [
    (single(PD, routes=PD_ROUTES), SimOptions()),
    (single({"c0": ["m0:0"], "c1": ["m0:1"], "c2": ["m1:0", "m1:1"], "c3": ["m1:2"]}), SimOptions()),
    (single({"c0": ["m0:0"], "c1": ["m0:1"], "c2": ["m1:0"]}), SimOptions(chunked_prefill=True)),
    (single({"p0": ["m0:0"], "p1": ["m0:1"], "c0": ["m0:2"], "c1": ["m0:3"], "d0": ["m1:0"]},
            routes=[("p0", "d0", 1), ("p1", "d0", 1)]),
     SimOptions(kv_admission="paged", kv_capacity_tokens={"p0": 12000, "p1": 12000, "c0": 1200, "c1": 12000,
                                                          "d0": 12000})),
], ids=["pd", "colocated", "chunked", "mixed-roles-small-pool"])
def test_the_snapshots_filed_by_load_decide_as_every_snapshot_would(model, plan, opts):
    cluster = two_box_cluster(gbps_between=10.0)
    check = RankChecked()
    sim = Simulator(plan, cluster, model, waves(240), replace(opts, placement=check))
    check.sim = sim
    res = sim.run()
    assert res.summary()["completed"] == 240
    assert check.decisions > 120  # most decisions went through the ranked snapshots
