"""Every algorithm, on every bundled preset, returns a plan that passes the validator."""

import pytest

from hetserve.planner import ALGORITHMS, PlanOptions, validate_plan
from hetserve.planner.traffic import network_warnings, plan_traffic
from hetserve.specs.cluster import cluster_presets, load_cluster
from hetserve.specs.model import load_model

# A model that fits each preset (HexGen-2's settings serve Llama-2 70B; small pools get 7B).
MODEL_FOR = {"hexgen2-homo": "llama-2-70b", "hexgen2-het1": "llama-2-70b", "hexgen2-het2": "llama-2-70b",
             "hexgen2-het3": "llama-2-70b", "hexgen2-het4": "llama-2-70b", "hexgen2-het5": "llama-2-70b",
             "aladdin-a100": "llama-2-70b", "hexgen-half-price": "llama-2-70b"}
# A small, deterministic budget: the test is about validity, not quality. Two iterations run every
# kind of step (the start, a refinement, the alternatives after it) and return on almost every
# preset the plan four iterations and a restart return, in under half the time.
QUICK = PlanOptions(seed=0, time_limit_s=60, max_iterations=2, restarts=0, patience=2)


@pytest.fixture(autouse=True)
def _per_device_bound(monkeypatch):
    """Validity, not quality: the plans here carry the per-device LP's bound rather than the group
    programme's, a MILP of up to a minute and a half per preset that the bound tests solve."""
    from hetserve.planner.bound import throughput

    monkeypatch.setattr(throughput, "group_bound", lambda *args, **kwargs: None)


def cases():
    for name in cluster_presets():
        if name == "demo-tiny":  # sized for the demo's own tiny model (hetserve make-model), not a preset
            continue
        n = len(load_cluster(name))
        for algo in ALGORITHMS:
            if algo.startswith("exact") and n > 8:
                continue
            yield name, algo


@pytest.mark.parametrize("preset,algorithm", list(cases()))
def test_plan_is_valid(preset, algorithm, azure):
    cluster = load_cluster(preset)
    model = load_model(MODEL_FOR.get(preset, "llama-2-7b"))
    plan = ALGORITHMS[algorithm](cluster, model, azure, QUICK)
    validate_plan(plan, cluster, model)
    e = plan.estimate
    assert plan.algorithm == algorithm and plan.replicas
    assert e["throughput_tokens_per_s"] > 0
    assert e["devices_used"] <= len(cluster)
    assert set(e["replicas"]) == {r.id for r in plan.replicas}
    price = cluster.usd_per_hour([cluster.device(d).index for d in plan.devices])
    assert e["cost_usd_per_hour"] == (None if price is None else pytest.approx(price, rel=1e-3))
    if plan.is_disaggregated:
        for r in plan.by_role("prefill"):
            assert sum(k.weight for k in plan.routes_from(r.id)) == pytest.approx(1.0)
    # routed traffic, recomputed from the plan file alone, fits every shared NIC and site pipe, and
    # the plan's own estimate.network says the same
    traffic = plan_traffic(plan, cluster, model)
    for t in traffic:
        assert t.utilisation <= 1 + 1e-3, f"{t.name}: {t.utilisation:.3f} of capacity"
    assert network_warnings(plan, cluster, model) == []
    planned = {name: v["planned_gbps"] for name, v in e["network"].items()}
    assert planned == pytest.approx({t.name: t.gbps for t in traffic}, rel=1e-3, abs=1e-3)


def test_unknown_algorithm(azure, llama7b):
    from hetserve.errors import PlanError
    from hetserve.planner import plan

    with pytest.raises(PlanError, match="unknown planning algorithm 'magic'"):
        plan(load_cluster("demo-cpu"), llama7b, azure, "magic")
