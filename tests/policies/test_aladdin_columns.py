"""Aladdin's per-worker view read from the simulator's request columns (``RequestColumns``,
``KeptColumns``) equals the view built from ``RunningRequest`` objects, decision by decision."""

from dataclasses import replace

import numpy as np
import pytest

from hetserve.policies.aladdin import AladdinPlacement
from hetserve.policies.predictor import BucketMeanPredictor, NoisyOraclePredictor
from hetserve.sim import SimOptions
from hetserve.sim import pipeline as pipeline_module
from hetserve.sim.simulator import Simulator
from hetserve.specs.workload import SLO
from tests.interpreted import only_interpreted
from tests.sim.conftest import two_box_cluster
from tests.sim.plans import single
from tests.sim.test_snapshot_cache import waves


class Checked(AladdinPlacement):
    """Aladdin whose every view from columns is compared with the view from the objects."""

    columns_from = 0  # columns however few the requests

    def _view(self, r):
        v = super()._view(r)
        if getattr(r.requests, "columns", None) is not None:
            plain = super()._view(replace(r, requests=tuple(r.requests)))
            for f in ("l_in", "gen", "pred", "started", "dec_time"):
                a, b = getattr(v, f), getattr(plain, f)
                assert a.dtype == b.dtype and np.array_equal(a, b), f
            assert (v.under_l, v.under_b) == (plain.under_l, plain.under_b)
            self.compared += 1
            self.under += v.under_b > 0
            self.waiting_decoded += bool(np.any(~v.started & (v.dec_time > 0)))
        return v


def _check(policy, sim):
    policy.__class__ = Checked
    policy.compared = policy.under = policy.waiting_decoded = 0
    return policy


PD = {"p0": ["m0:0"], "p1": ["m0:1"], "d0": ["m1:0"], "d1": ["m1:1", "m1:2"]}
PD_ROUTES = [("p0", "d0", 0.5), ("p0", "d1", 0.5), ("p1", "d0", 1), ("p1", "d1", 1)]
COLO = {"c0": ["m0:0"], "c1": ["m0:1"], "c2": ["m1:0", "m1:1"]}
SLOS = SLO(ttft_s=2.0, tpot_s=0.1)


def _noisy(n, seed=3):
    return NoisyOraclePredictor(waves(n).output_tokens, sigma=0.8, seed=seed)


@pytest.mark.parametrize("plan, opts, route, own", [
    (single(COLO), SimOptions(), False, False),
    (single(COLO), SimOptions(chunked_prefill=True), False, False),
    (single(COLO), SimOptions(kv_admission="paged", kv_capacity_tokens=9000), False, False),
    (single(COLO), SimOptions(predictor=_noisy(240)), False, False),
    (single(COLO), SimOptions(predictor=_noisy(240)), False, True),
    (single(PD, routes=PD_ROUTES), SimOptions(route="aladdin", predictor=_noisy(240)), True, False),
    (single(PD, routes=PD_ROUTES), SimOptions(route="aladdin", kv_admission="paged", kv_capacity_tokens=9000),
     True, False),
], ids=["colocated", "chunked", "paged", "noisy", "own-predictor", "pd-route", "pd-route-paged"])
def test_views_from_columns_equal_views_from_requests(model, plan, opts, route, own):
    sim = Simulator(plan, two_box_cluster(gbps_between=10.0), model, waves(240),
                    replace(opts, placement="aladdin", slo=SLOS))
    pol = _check(sim.router.placement if route else sim.placement, sim)
    if own:
        pol.predictor = BucketMeanPredictor(prior=50.0)
    res = sim.run()
    assert res.summary()["completed"] == 240
    assert pol.compared > 200
    if opts.predictor is not None:  # outlived predictions: the re-predicted and the sums of the rise
        assert pol.under > 0
    if opts.kv_admission == "paged":  # pre-empted requests wait with decode time behind them
        assert res.info["preemptions"] > 0
        assert route or pol.waiting_decoded > 0


@only_interpreted(pipeline_module, "patches a PipelineReplica's state method")
def test_detailed_pipeline_views_from_columns(model):
    stage = lambda dev, lo, hi: {"devices": [dev], "layers": [lo, hi]}  # noqa: E731
    from hetserve.planner.plan import Plan
    plan = Plan.from_dict({"model": "llama-2-7b", "cluster": "test", "replicas": [
        {"id": "c0", "role": "colocated", "stages": [stage("m0:0", 0, 16), stage("m1:0", 16, 32)]},
        {"id": "c1", "role": "colocated", "stages": [stage("m0:1", 0, 32)]}]})
    sim = Simulator(plan, two_box_cluster(gbps_between=10.0), model, waves(240),
                    SimOptions(placement="aladdin", slo=SLOS, pipeline="detailed", predictor=_noisy(240)))
    pol = _check(sim.placement, sim)
    rep = sim.by_id["c0"]
    assert type(rep).__name__ == "PipelineReplica"
    taken = rep.state
    seen = []

    def state(with_requests=False, waits=True):  # the columns' objects equal the plain builder's
        s = taken(with_requests, waits)
        if with_requests:
            assert tuple(s.requests) == rep._requests()
            seen.append(hasattr(s.requests, "columns"))
        return s

    rep.state = state
    res = sim.run()
    assert res.summary()["completed"] == 240 and pol.compared > 200 and pol.under > 0 and sum(seen) > 20


@pytest.fixture
def model():
    from hetserve.specs.model import load_model
    return load_model("llama-2-7b")
