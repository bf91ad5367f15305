"""Placement over a fleet's many candidates reads the costly figures of only those a lower bound
cannot rule out: ``eft`` bounds every key at once (``finish_time._Bounds``), ``jsq`` the
outstanding tokens of the least loaded (``ReplicaState.outstanding_at_least``). On the simulator's
own kept snapshots, read as the clock moves on, each decides as reading every candidate would."""

import numpy as np
import pytest

from hetserve.planner.plan import Plan
from hetserve.policies import finish_time, placement
from hetserve.sim import SimOptions
from hetserve.sim.simulator import Simulator
from hetserve.specs.cluster import cluster_from_dict
from hetserve.specs.model import load_model
from hetserve.specs.workload import Workload

from .test_snapshot_cache import RankChecked

GPUS = ("A100-SXM-80G", "L40", "A6000", "RTX-4090")  # four speeds: four prices


def _fleet():
    """16 boxes of 4 GPUs on two sites; 4 prefill replicas (one with two KV routes), 4 decode
    and 56 colocated ones, one GPU each."""
    machines = [{"name": f"m{i}", "gpu": GPUS[i % 4], "count": 4, "site": f"s{i % 2}"} for i in range(16)]
    cluster = cluster_from_dict({"name": "fleet", "machines": machines,
                                 "network": {"intra_site": {"bandwidth_gbps": 200.0, "latency_ms": 0.1},
                                             "inter_site": {"bandwidth_gbps": 100.0, "latency_ms": 1.0}}})
    devices = [f"m{i}:{g}" for i in range(16) for g in range(4)]
    ids = [f"p{i}" for i in range(4)] + [f"d{i}" for i in range(4)] + [f"c{i}" for i in range(56)]
    roles = {"p": "prefill", "d": "decode", "c": "colocated"}
    plan = Plan.from_dict({"model": "llama-2-7b", "cluster": "fleet", "kv_routes": (
        [{"from": f"p{i}", "to": f"d{i}", "weight": 1.0} for i in range(4)] + [{"from": "p0", "to": "d1", "weight": 0.5}]),
        "replicas": [{"id": rid, "role": roles[rid[0]], "stages": [{"devices": [dev], "layers": [0, 32]}]}
                     for rid, dev in zip(ids, devices)]})
    return cluster, plan


def _busy(n=1500, seed=0):
    """Requests faster than the fleet serves them for a while, so backlogs build up and drain."""
    rng = np.random.default_rng(seed)
    return Workload.from_lists("busy", np.sort(rng.uniform(0.0, 12.0, n)), rng.integers(100, 1500, n),
                               rng.integers(20, 400, n))


class Checking:
    """Delegates to ``eft``; first checks that its least candidates are those of the least
    ``finish_s`` over every candidate."""

    needs_requests = False
    reads_waits = False

    def __init__(self, inner):
        self.inner, self.name, self.decisions = inner, inner.name, 0

    def choose(self, request, candidates, now):
        assert len(candidates) >= finish_time.VECTORIZE_FROM  # the bounded path decides
        keys = [self.inner.finish_s(request, c) for c in candidates]
        least = [c for c, k in zip(candidates, keys) if k == min(keys)]
        assert [id(c) for c in self.inner._least(request, candidates, now)] == [id(c) for c in least]
        self.decisions += 1
        return self.inner.choose(request, candidates, now)

    def on_finish(self, request_id, input_tokens, output_tokens):
        self.inner.on_finish(request_id, input_tokens, output_tokens)


class JsqChecking(RankChecked):
    """``RankChecked`` (each decision from the least loaded kept snapshots against ``choose`` over
    fresh ones, which carry no bounds: every outstanding figure read), counting the decisions among
    enough equally loaded candidates for the bounds to be used."""

    def __init__(self):
        super().__init__()
        self.bounded = 0

    def choose_lowest(self, request, least, now):
        self.bounded += least.size >= placement.BOUND_FROM
        return super().choose_lowest(request, least, now)


def _run(policy):
    """The fleet under ``policy`` (a name, or a checking policy: ``Checking`` wraps ``eft``)."""
    cluster, plan = _fleet()
    sim = Simulator(plan, cluster, load_model("llama-2-7b"), _busy(),
                    SimOptions(placement="eft" if policy is Checking else policy))
    if policy is Checking:
        sim.placement = Checking(sim.placement)
    elif isinstance(policy, JsqChecking):
        policy.sim = sim
    return sim, sim.run()


def test_the_bounded_least_are_those_of_every_key():
    sim, res = _run(Checking)
    assert sim.placement.decisions == res.summary()["completed"] == 1500


def test_jsq_reads_the_fewest_tokens_as_reading_every_candidate_would():
    check = JsqChecking()
    _, res = _run(check)
    assert check.decisions == res.summary()["completed"] == 1500
    assert check.bounded > 100  # many decisions among many equally loaded candidates


@pytest.mark.parametrize("policy, module, threshold", [("eft", finish_time, "VECTORIZE_FROM"),
                                                       ("jsq", placement, "BOUND_FROM")])
def test_a_fleet_simulates_the_same_reading_every_candidate(monkeypatch, policy, module, threshold):
    _, bounded = _run(policy)
    monkeypatch.setattr(module, threshold, 10**9)
    _, plain = _run(policy)
    a, b = bounded.summary(), plain.summary()
    for s in (a, b):
        del s["run"]["wall_s"]
    assert a == b
    assert bounded.prefill_replica == plain.prefill_replica
    assert np.array_equal(bounded.t_finish, plain.t_finish)
