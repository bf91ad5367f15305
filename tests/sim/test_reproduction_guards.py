"""Guards the paper reproductions rely on (issue 12): the simulator's SLO attainment honours the
TTFT target, KV routes follow the plan's weights, MoLink runs inside the simulator (JIT case 3 as
T_o + T_m), Aladdin keeps its own TTFT promise and stays linear under overload."""

import numpy as np
import pytest

from hetserve.policies.transmission import MoLinkTransmission, round_trip_time
from hetserve.sim import SimOptions, simulate
from hetserve.sim import pipeline as pipeline_module
from hetserve.specs.cluster import cluster_from_dict
from hetserve.specs.workload import SLO, Workload

from tests.interpreted import only_interpreted

from .plans import single


def burst(n, inp=800, out=100, gap=0.0, seed=0):
    rng = np.random.default_rng(seed)
    return Workload.from_lists("burst", np.arange(n) * gap, rng.integers(inp // 2, inp * 3 // 2, n),
                               rng.integers(out // 2, out * 3 // 2, n))


def test_slo_attainment_honours_the_ttft_target(cluster, model):
    """With a loose TPOT target and the TTFT target at the run's median TTFT, about half the
    requests attain — exactly those whose TTFT is within it (the simulator's and capacity's count)."""
    from hetserve.capacity.simulated import attainment

    plan = single({"p0": ["m0:0"], "d0": ["m1:0"]})
    wl = burst(120, inp=1500, gap=0.02, seed=4)
    probe = simulate(plan, cluster, model, wl)
    target = float(np.median(probe.ttft))
    slo = SLO(ttft_s=target, tpot_s=1e3)
    res = simulate(plan, cluster, model, wl, SimOptions(slo=slo))
    expect = float(np.mean(res.ttft <= target))
    assert 0.3 < expect < 0.7
    assert res.summary()["slo_attainment"] == pytest.approx(expect)
    assert attainment(res, slo) == pytest.approx(expect)


def test_kv_routes_follow_the_plans_weights_in_the_simulator(cluster, model):
    plan = single({"p0": ["m0:0", "m0:1"], "d0": ["m1:0"], "d1": ["m1:1"]},
                  routes=[("p0", "d0", 0.8), ("p0", "d1", 0.2)])
    res = simulate(plan, cluster, model, burst(100, inp=200, out=20, gap=0.05))
    share = sum(d == "d0" for d in res.decode_replica) / len(res)
    assert share == pytest.approx(0.8, abs=0.02)  # uniform weights would give 0.5


def molink_cluster():
    return cluster_from_dict({"name": "test", "machines": [
        {"name": f"pc{i}", "gpu": "RTX-4090", "count": 1, "site": f"home-{i}"} for i in range(3)],
        "network": {"inter_site": {"bandwidth_gbps": 0.1, "latency_ms": 30}}})


def pipeline3(model):
    from hetserve.planner.plan import Plan
    cuts = [(0, 11), (11, 22), (22, 32)]
    return Plan.from_dict({"model": model.name, "cluster": "test", "replicas": [
        {"id": "c0", "role": "colocated",
         "stages": [{"devices": [f"pc{i}:0"], "layers": list(c)} for i, c in enumerate(cuts)]}]})


class WindowSpy(MoLinkTransmission):
    """MoLink that records every just-in-time window it computes (shared by the per-link copies)."""

    windows: list = []

    def chunk_bytes(self, remaining, link, now, next_decode_in_s):
        out = super().chunk_bytes(remaining, link, now, next_decode_in_s)
        WindowSpy.windows.append((self.last_window, link.decode))
        return out


def test_molink_runs_in_the_simulator_with_jit_case_3_as_round_trip(model):
    """On a 100 Mbps / 30 ms three-stage pipeline with prompts arriving while others decode:
    MoLink's chunk windows in case 3 are t_p + T_o + T_m − now with T_o + T_m the priced round
    trip (never more than the whole ring at the largest batch), and decode-first beats one
    ordered queue at the same micro-batch count."""
    cl = molink_cluster()
    plan = pipeline3(model)
    wl = burst(16, inp=600, out=60, gap=1.5, seed=2)
    WindowSpy.windows = []
    opts = dict(pipeline="detailed", micro_batches=3)
    mol = simulate(plan, cl, model, wl, SimOptions(transmission=WindowSpy(), **opts))
    fair = simulate(plan, cl, model, wl, SimOptions(transmission="fair", **opts))
    case3 = [(w, t) for w, t in WindowSpy.windows if w is not None and w.case == 3]
    assert case3, "MoLink never sized a chunk by the round trip (case 3)"
    # the ring at the largest batch, all requests in one micro-batch at the longest context
    from hetserve.cost.analytic import CostModel
    cost = CostModel(cl, model)
    lay = plan.replicas[0].layout(cl)
    n, ctx = len(wl), float(n_ctx := (wl.input_tokens + wl.output_tokens).sum())
    times = [cost.stage_decode_time(s, n, ctx, i == 2) for i, s in enumerate(lay.stages)]
    links = [cl.link(lay.stages[i].devices[0], lay.stages[(i + 1) % 3].devices[0]) for i in range(3)]
    bound = round_trip_time(times, [la for la, _ in links], [b for _, b in links],
                            model.hidden * model.dtype_bytes, 4, n)
    assert n_ctx > 0 and all(0 < t.round_trip_s <= bound for _, t in case3)
    assert all(w.available_s <= t.round_trip_s + 1e-9 for w, t in case3)
    assert mol.summary()["completed"] == len(wl)
    # decode first: far better TPOT than one ordered queue (Helix); on these ideal processor-sharing
    # links fair sharing already gives a small decode message half the link at once, so MoLink's
    # 2 ms chunk floor leaves it within a few per cent of fair (docs/experiments/molink_tables.md)
    serial = simulate(plan, cl, model, wl, SimOptions(transmission="serial", **opts))
    assert np.mean(mol.tpot) < 0.8 * np.mean(serial.tpot)
    assert np.mean(mol.tpot) <= np.mean(fair.tpot) * 1.03


def test_aladdin_keeps_its_own_ttft_promise(model):
    """Colocated pool with a TTFT target only (so (c) alone decides where prompts go): with the
    running prefill's rest and the queued prompts' age counted, Aladdin's packing keeps TTFT
    misses rare (measured 0.4 %); counting the queued prompt tokens alone misses 11.6 %."""
    from hetserve.capacity.simulated import run_pool
    from hetserve.specs.workload import load_workload

    slo = SLO(ttft_s=0.2, tpot_s=None)
    wl = load_workload("sharegpt").filter_lengths(2048, 2048).head(250).with_poisson_arrivals(6.0, 1)
    res = run_pool(model, "A100-SXM-80G", wl, slo, "aladdin", 6, 1)
    assert res.info["policy_stats"]["placement"]["overflow"] == 0
    assert np.mean(res.ttft > slo.ttft_s) < 0.02


def test_aladdin_builds_no_views_of_overloaded_workers(model, monkeypatch):
    """At 10× the rate a small pool can serve, Aladdin decides from the snapshots' totals: the
    per-request views it builds stay a small share of (decisions × workers) — not one per queued
    request per decision, which made simulations quadratic under overload."""
    from hetserve.capacity.simulated import run_pool
    from hetserve.policies.aladdin import AladdinPlacement
    from hetserve.specs.workload import load_workload

    calls = {"views": 0, "listed": 0}
    orig = AladdinPlacement._view

    def counting(self, r):
        calls["views"] += 1
        calls["listed"] += len(r.requests)
        return orig(self, r)

    monkeypatch.setattr(AladdinPlacement, "_view", counting)
    wl = load_workload("azure-conv").filter_lengths(2048, 2048).head(1200).with_rate(40.0)
    res = run_pool(model, "A100-SXM-80G", wl, SLO(ttft_s=0.6, tpot_s=0.03), "aladdin", 4, 1)
    assert res.info["policy_stats"]["placement"]["overflow"] > 1000  # overloaded indeed
    # measured: ~1,500 views listing ~53,000 requests, the same at 600 requests (all before the
    # queues build up); views of every worker at every decision would be 4,800 listing millions
    assert calls["views"] < 0.5 * 4 * len(wl)
    assert calls["listed"] < 60 * len(wl)


def test_next_decode_return_is_the_earliest_group_not_group_0():
    from hetserve.policies.transmission import next_decode_return
    # group 0 left at 0.0 and needs 1.0 s round the ring; group 1 left at 0.5 and is back at 0.7
    assert next_decode_return([(0.0, 1.0), (0.5, 0.2), (0.3, 0.9)]) == (0.5, 0.2)
    assert next_decode_return([]) is None


@only_interpreted(pipeline_module, "patches PipelineReplica._timing")
def test_case_3_predicts_the_next_decode_of_any_group_in_the_simulator(model, monkeypatch):
    """MoLink §4.2 case 3 in the detailed pipeline: t_p + T_o + T_m is the earliest expected return
    over every micro-batch group in flight, not group 0's only (6 groups on 3 stages, so another
    group is often back first)."""
    from hetserve.sim.pipeline import PipelineReplica
    seen = {"calls": 0, "other": 0}
    real = PipelineReplica._timing

    def spy(self, s, now):
        t = real(self, s, now)
        back = [(g, tp + self._round_trip(g)) for g, tp in enumerate(self._done_at[s])
                if tp is not None and self.groups[g].in_flight and self.groups[g].batch.size]
        if back:
            g_first, t_first = min(back, key=lambda b: b[1])
            assert t.iteration_first_done_s + t.round_trip_s == pytest.approx(t_first)
            seen["calls"] += 1
            seen["other"] += g_first != 0
        return t

    monkeypatch.setattr(PipelineReplica, "_timing", spy)
    wl = burst(24, inp=600, out=60, gap=0.5, seed=3)
    res = simulate(pipeline3(model), molink_cluster(), model, wl,
                   SimOptions(transmission="molink", pipeline="detailed", micro_batches=6))
    assert res.summary()["completed"] == len(wl)
    assert seen["calls"] and seen["other"], seen  # the estimate had to look past group 0
