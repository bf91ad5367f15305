"""The simulator's link model re-shares only the component a send touches (``sim.links.SharedLinks``):
its deliveries, counters and simulation figures equal the all-at-once ``LinkModel``'s."""

from __future__ import annotations

import random

import pytest

import hetserve.sim.links as sim_links
from hetserve.policies.links import LinkModel
from hetserve.policies.transmission import TRANSMISSION_POLICIES
from hetserve.sim import SimOptions, simulate
from hetserve.sim.links import SharedLinks
from hetserve.specs.cluster import load_cluster
from hetserve.specs.model import load_model
from hetserve.specs.workload import load_workload
from tests.sim.plans import het1_disaggregated


def _drive(model_cls, policy: str, seed: int):
    """Random messages between devices of a three-site pool (NICs and site pipes shared)."""
    cluster = load_cluster("hexgen2-het3")
    model = model_cls(TRANSMISSION_POLICIES[policy])
    rng, n, now, out = random.Random(seed), len(cluster), 0.0, []
    for mid in range(400):
        now += rng.expovariate(200.0)
        while (t := model.next_event_s()) is not None and t <= now:
            out += model.advance(t)
        a, b = rng.sample(range(n), 2)
        kind = rng.choice(("decode", "prefill", "kv"))
        out += model.put(mid, kind, cluster.path(a, b), rng.choice((2e4, 3e6, 4e7)), now)
    while (t := model.next_event_s()) is not None:
        out += model.advance(t)
    counters = {name: (q.busy_s, dict(q.bytes_sent)) for name, q in model.queues.items()}
    return dict(out), counters


@pytest.mark.parametrize("policy", ["fair", "serial"])
def test_deliveries_equal_the_global_reshare(policy):
    old, old_counters = _drive(LinkModel, policy, seed=3)
    new, new_counters = _drive(SharedLinks, policy, seed=3)
    assert len(new) == len(old) == 400
    for mid, at in old.items():
        assert new[mid] == pytest.approx(at, rel=1e-9, abs=1e-9), mid
    for name, (busy, sent) in old_counters.items():
        assert new_counters[name][0] == pytest.approx(busy, rel=1e-9, abs=1e-9)
        for k, v in sent.items():
            assert new_counters[name][1][k] == pytest.approx(v, rel=1e-9, abs=1e-3)


@pytest.mark.parametrize("transmission", ["fair", "molink"])
def test_disaggregated_simulation_unchanged(monkeypatch, transmission):
    cluster, model = load_cluster("hexgen2-het1"), load_model("llama-2-70b")
    wl = load_workload("azure-conv").head(120).scale_rate(4.0)
    opts = SimOptions(transmission=transmission, pipeline="detailed")
    new = simulate(het1_disaggregated(), cluster, model, wl, opts).summary()
    monkeypatch.setattr(sim_links, "SharedLinks", LinkModel)
    old = simulate(het1_disaggregated(), cluster, model, wl, opts).summary()
    assert new["run"]["events"] == old["run"]["events"]
    assert new["completed"] == old["completed"]
    for key in ("ttft_s", "tpot_s", "e2e_s"):
        for stat, v in old[key].items():
            assert new[key][stat] == pytest.approx(v, rel=1e-9), (key, stat)
