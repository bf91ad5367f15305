"""Aladdin wired into the rest: built from the policy registries, run inside the simulator (packing,
no-SLO spreading, the snapshots it reads), and its knobs reaching it from ``SimOptions`` and the CLI.
The policy's own decisions, scenario by scenario: ``test_aladdin.py``."""

import dataclasses

import pytest

from hetserve.policies.aladdin import AladdinPlacement
from hetserve.policies.aladdin_route import AladdinRoute
from hetserve.specs.workload import SLO


def test_registry_builds_aladdin_from_the_policy_context():
    from hetserve.cost.analytic import CostModel
    from hetserve.cost.layout import ReplicaLayout, StageLayout
    from hetserve.policies.placement import PolicyContext, make_placement, placement_names
    from hetserve.specs.cluster import load_cluster
    from hetserve.specs.model import load_model

    cluster, model = load_cluster("aladdin-a100"), load_model("llama-2-7b")
    layouts = {f"w{i}": ReplicaLayout((StageLayout((i,), (0, model.num_layers)),)) for i in range(2)}
    pol = make_placement("aladdin", PolicyContext(slo=SLO(0.4, 0.015), cost=CostModel(cluster, model),
                                                  layouts=layouts))
    assert isinstance(pol, AladdinPlacement) and "aladdin" in placement_names()
    assert pol.model_for("w0") is pol.model_for("w1")  # identical shapes share one fit
    assert pol.model_for("w0").decode.c3 < 0.015


def test_in_the_simulator_aladdin_packs_where_round_robin_spreads():
    import numpy as np

    from hetserve.capacity.simulated import run_pool
    from hetserve.specs.model import load_model
    from hetserve.specs.workload import Workload

    model = load_model("llama-2-7b")
    slo = SLO(0.4, 0.015)
    wl = Workload.from_lists("t", np.arange(120) * 0.25, np.full(120, 300), np.full(120, 80))
    used = {}
    for pol in ("aladdin", "rr"):
        res = run_pool(model, "A100-SXM-80G", wl, slo, pol, 6, 1)
        used[pol] = len(set(res.prefill_replica))
    assert used["rr"] == 6
    assert used["aladdin"] <= 2  # best fit keeps opening as few workers as the constraints allow


def test_no_slo_aladdin_in_the_simulator_spreads_prompts(model):
    import numpy as np

    from hetserve.sim import SimOptions, simulate
    from hetserve.specs.workload import Workload
    from tests.sim.conftest import two_box_cluster
    from tests.sim.plans import single

    cluster = two_box_cluster()
    plan = single({"p0": ["m0:0"], "p1": ["m0:1"], "p2": ["m0:2"], "d0": ["m1:0"], "d1": ["m1:1"]})
    rng = np.random.default_rng(0)
    wl = Workload.from_lists("t", np.sort(rng.uniform(0, 20, 400)), rng.integers(500, 3000, 400),
                             rng.integers(20, 200, 400))
    res = {pol: simulate(plan, cluster, model, wl, SimOptions(placement=pol)) for pol in ("aladdin", "jsq")}
    used = {x for x in res["aladdin"].prefill_replica}
    assert used == {"p0", "p1", "p2"}
    assert res["aladdin"].summary()["ttft_s"]["p99"] <= 1.5 * res["jsq"].summary()["ttft_s"]["p99"]
    assert res["aladdin"].info["policy_stats"]["placement"]["unbounded"] == 400


@pytest.fixture
def model():
    from hetserve.specs.model import load_model
    return load_model("llama-2-7b")


class Recorder:
    """A placement policy that records what the simulator shows it (and places round robin)."""

    name = "recorder"
    needs_requests = True

    def __init__(self):
        self.seen, self._n = [], 0

    def choose(self, request, candidates, now):
        # the request views describe this moment: copy them now (they are built lazily)
        self.seen.append((now, [dataclasses.replace(c, requests=tuple(c.requests)) for c in candidates]))
        self._n += 1
        return candidates[self._n % len(candidates)].id

    def on_finish(self, *a):
        pass


def test_simulator_snapshots_list_waiting_requests_and_decode_time(model):
    import numpy as np

    from hetserve.sim import SimOptions, simulate
    from hetserve.specs.workload import Workload
    from tests.sim.conftest import two_box_cluster
    from tests.sim.plans import single

    rec = Recorder()
    n = 60
    wl = Workload.from_lists("t", np.arange(n) * 0.05, np.full(n, 1500), np.full(n, 300))
    res = simulate(single({"c0": ["m0:0"]}), two_box_cluster(), model, wl, SimOptions(placement=rec))
    waiting_seen = running_seen = 0
    for now, (c0,) in rec.seen:
        ids = [q.id for q in c0.requests]
        assert len(ids) == len(set(ids)) and len(ids) >= c0.load  # every request on it, listed once
        for q in c0.requests:
            if q.started:
                running_seen += 1
                assert q.decode_time_s == pytest.approx(now - res.t_join[q.id])
                assert q.generated_tokens >= 1
            else:
                waiting_seen += 1
                assert q.generated_tokens == 0 and q.decode_time_s == 0.0
                assert not res.t_first[q.id] <= now  # not prefilled yet at that moment
    assert waiting_seen > 0 and running_seen > 0


def test_decode_snapshots_list_inbound_requests(model):
    import numpy as np

    from hetserve.capacity.simulated import PlacementAsRoute
    from hetserve.sim import SimOptions, simulate
    from hetserve.specs.workload import Workload
    from tests.sim.conftest import two_box_cluster
    from tests.sim.plans import single

    rec = Recorder()
    n = 40
    wl = Workload.from_lists("t", np.arange(n) * 0.02, np.full(n, 2000), np.full(n, 200))
    plan = single({"p0": ["m0:0"], "d0": ["m1:0"], "d1": ["m1:1"]}, routes=[("p0", "d0", 0.5), ("p0", "d1", 0.5)])
    res = simulate(plan, two_box_cluster(1.0), model, wl, SimOptions(route=PlacementAsRoute(rec)))
    inbound = 0
    for now, cands in rec.seen:
        for c in cands:
            assert len(c.requests) >= c.load
            for q in c.requests:
                if not q.started:
                    inbound += 1
                    assert q.generated_tokens == 1 and not res.t_join[q.id] <= now
    assert inbound > 0


def test_route_registry_builds_aladdin_lazily():
    from hetserve.cost.analytic import CostModel
    from hetserve.cost.layout import ReplicaLayout, StageLayout
    from hetserve.policies.placement import PolicyContext
    from hetserve.policies.routing import make_route
    from hetserve.specs.cluster import load_cluster
    from hetserve.specs.model import load_model

    cluster, m = load_cluster("aladdin-a100"), load_model("llama-2-7b")
    layouts = {f"d{i}": ReplicaLayout((StageLayout((i,), (0, m.num_layers)),)) for i in range(2)}
    route = make_route("aladdin", PolicyContext(slo=SLO(None, 0.02), cost=CostModel(cluster, m), layouts=layouts,
                                                options={"gamma": 0.8, "theta": 0.9}))
    assert isinstance(route, AladdinRoute) and route.needs_requests
    assert (route.placement.gamma, route.placement.theta) == (0.8, 0.9)


def test_gamma_and_theta_reach_aladdin_from_sim_options_and_cli(tmp_path, capsys, model):
    import json

    from hetserve.cli.main import main
    from hetserve.sim.simulator import SimOptions, Simulator
    from hetserve.specs.workload import load_workload
    from tests.sim.conftest import two_box_cluster
    from tests.sim.plans import single

    plan = single({"c0": ["m0:0"], "c1": ["m0:1"]})
    sim = Simulator(plan, two_box_cluster(), model, load_workload("azure-conv").head(5),
                    SimOptions(placement="aladdin", slo=SLO(1.0, 0.05), policy_options={"gamma": 0.25, "theta": 0.6}))
    assert (sim.placement.gamma, sim.placement.theta) == (0.25, 0.6)

    from tests.sim.test_cli import files
    p, c = files(tmp_path)
    base = ["simulate", "--plan", p, "--cluster", c, "--workload", "azure-conv", "--limit", "20", "--json"]
    assert main(base + ["--router", "aladdin", "--slo-tpot", "0.1", "--gamma", "0.9", "--theta", "0.7"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["run"]["policy_options"] == {"gamma": 0.9, "theta": 0.7} and s["run"]["placement"] == "aladdin"
    assert main(base + ["--kv-admission", "paged"]) == 0
    assert json.loads(capsys.readouterr().out)["run"]["kv_admission"] == "paged"
    assert main(base + ["--router", "aladdin", "--gamma", "1.5"]) == 2  # out of range: one-line error
    assert "gamma" in capsys.readouterr().err
    assert main(base + ["--router", "jsq", "--gamma", "0.5"]) == 2  # knob without the policy
    assert "aladdin" in capsys.readouterr().err
