"""Queueing behaviour: overload, KV admission, colocated interruption, determinism, outputs."""

import json

import numpy as np
import pytest

from hetserve.sim import SimOptions, simulate
from hetserve.specs.workload import SLO, Workload, load_workload

from .plans import single


def burst(n, inp=800, out=100, gap=0.0, seed=0):
    rng = np.random.default_rng(seed)
    return Workload.from_lists("burst", np.arange(n) * gap, rng.integers(inp // 2, inp * 3 // 2, n),
                               rng.integers(out // 2, out * 3 // 2, n))


def test_nothing_is_dropped_under_overload(cluster, model):
    plan = single({"p0": ["m0:0"], "d0": ["m1:0"]})
    wl = burst(600, inp=1500, out=300)  # all at t = 0: far beyond what one decode GPU holds at once
    res = simulate(plan, cluster, model, wl)
    assert res.summary()["completed"] == 600
    assert np.all(np.isfinite(res.t_finish)) and np.all(res.t_finish >= res.t_first)
    assert res.replicas[1].kv_peak_tokens <= res.replicas[1].kv_capacity_tokens


def test_kv_admission_makes_requests_wait(cluster, model, cost):
    """The decode pool holds ~4 requests' footprint: the rest wait with their KV on the prefill side."""
    plan = single({"p0": ["m0:0", "m0:1", "m0:2", "m0:3"], "d0": ["m1:0"]})
    cap = cost.kv_capacity_tokens(plan.replica("d0").layout(cluster))
    per = int(cap // 4)
    wl = Workload.from_lists("big", [0.0] * 12, [per - 200] * 12, [200] * 12)
    res = simulate(plan, cluster, model, wl, SimOptions(beyond_context="run"))  # longer than the context
    d0 = res.replicas[1]
    assert d0.kv_peak_tokens <= cap
    wait = res.t_kv_start - res.t_first  # admission wait before the KV may move
    assert (wait > 1.0).sum() >= 6  # later requests waited for earlier ones to finish
    assert np.all(res.t_kv_start[4:] >= np.sort(res.t_finish)[:8] - 1e-9)  # a slot frees first
    running = [(res.t_join <= t) & (res.t_finish > t) for t in np.linspace(0, res.t_finish.max(), 400)]
    assert max(r.sum() for r in running) <= 4


def test_max_batch_bounds_the_running_batch(cluster, model):
    plan = single({"c0": ["m0:0"]})
    res = simulate(plan, cluster, model, burst(40, inp=100, out=400), SimOptions(max_batch=8))
    running = [(res.t_first <= t) & (res.t_finish > t) for t in np.linspace(0, res.t_finish.max(), 300)]
    assert max(r.sum() for r in running) <= 8


def test_colocated_prefill_first_interrupts_decode(cluster, model, cost):
    plan = single({"c0": ["m0:0"]})
    lay = plan.replica("c0").layout(cluster)
    opts = SimOptions(prefill_mode="prefill_first")
    alone = simulate(plan, cluster, model, Workload.from_lists("a", [0.0], [200], [400]), opts)
    t_b = alone.t_finish[0] / 2  # B arrives while A decodes
    both = simulate(plan, cluster, model, Workload.from_lists("ab", [0.0, t_b], [200, 3000], [400, 2]), opts)
    step = cost.decode_step_time(lay, 1, 200 + 400)
    prefill_b = cost.ttft(lay, 3000)
    # B waits at most one decode iteration, then its prefill runs with A's decode paused
    assert prefill_b <= both.ttft[1] <= prefill_b + step
    # A is delayed by at least B's whole prefill
    assert both.t_finish[0] - alone.t_finish[0] >= prefill_b
    gap = both.t_first[1] - both.t_start[1]
    assert gap == pytest.approx(prefill_b, rel=1e-9)


def test_colocated_mixed_prompt_rides_in_the_decode_step(cluster, model, cost):
    """The default (the runtime's engine): B's prompt runs in one iteration together with A's decode
    token, so A loses less than B's prefill and B's first token comes after one mixed iteration."""
    plan = single({"c0": ["m0:0"]})
    lay = plan.replica("c0").layout(cluster)
    alone = simulate(plan, cluster, model, Workload.from_lists("a", [0.0], [200], [400]))
    t_b = alone.t_finish[0] / 2
    both = simulate(plan, cluster, model, Workload.from_lists("ab", [0.0, t_b], [200, 3000], [400, 2]))
    prefill_b = cost.ttft(lay, 3000)
    step = cost.decode_step_time(lay, 1, 200 + 400)
    assert both.t_first[1] - both.t_start[1] >= prefill_b * 0.99  # the mixed iteration costs the prompt
    delay = both.t_finish[0] - alone.t_finish[0]
    assert 0 < delay < prefill_b  # A's token came out of the mixed iteration: no whole-prefill pause
    assert both.ttft[1] <= both.t_first[1] - both.t_start[1] + step


def test_chunked_prefill_spreads_the_prompt_over_iterations(cluster, model, cost):
    plan = single({"c0": ["m0:0"]})
    alone = simulate(plan, cluster, model, Workload.from_lists("a", [0.0], [200], [400]))
    t_b = alone.t_finish[0] / 2
    wl = Workload.from_lists("ab", [0.0, t_b], [200, 3000], [400, 2])
    chunked = simulate(plan, cluster, model, wl, SimOptions(chunked_prefill=True, chunk_tokens=512))
    plain = simulate(plan, cluster, model, wl)
    # 3000 prompt tokens in chunks of 511 (one slot goes to A's decode token): 6 mixed iterations
    assert chunked.ttft[1] > plain.ttft[1]
    # A never stalls for a whole 3000-token prefill: its delay is smaller than in the plain engine
    assert chunked.t_finish[0] - alone.t_finish[0] < plain.t_finish[0] - alone.t_finish[0]
    assert chunked.summary()["completed"] == 2


def test_deterministic_with_seed(cluster, model):
    plan = single({"p0": ["m0:0"], "p1": ["m0:1"], "p2": ["m0:2"], "d0": ["m1:0"], "d1": ["m1:1"]},
                  routes=[("p0", "d0", 0.5), ("p0", "d1", 0.5), ("p1", "d0", 1), ("p2", "d1", 1)])
    wl = burst(300, gap=0.05, seed=3)
    a = simulate(plan, cluster, model, wl, SimOptions(placement="po2", seed=7))
    b = simulate(plan, cluster, model, wl, SimOptions(placement="po2", seed=7))
    c = simulate(plan, cluster, model, wl, SimOptions(placement="po2", seed=8))
    assert np.array_equal(a.t_finish, b.t_finish) and a.prefill_replica == b.prefill_replica
    assert a.prefill_replica != c.prefill_replica


def test_jsq_beats_round_robin_with_a_slow_replica(model):
    """One fast and one slow colocated replica: JSQ sends the slow one less work than RR does."""
    from hetserve.specs.cluster import cluster_from_dict
    mixed = cluster_from_dict({"name": "test", "machines": [{"name": "m0", "gpu": "H100-SXM-80G", "count": 1},
                                                            {"name": "m1", "gpu": "A6000", "count": 1}],
                              "network": {"intra_site": {"bandwidth_gbps": 100, "latency_ms": 0.1}}})
    plan = single({"c0": ["m0:0"], "c1": ["m1:0"]})
    wl = burst(400, inp=600, out=150, gap=0.05, seed=1)
    rr = simulate(plan, mixed, model, wl, SimOptions(placement="rr"))
    jsq = simulate(plan, mixed, model, wl, SimOptions(placement="jsq"))
    share = lambda r: sum(x == "c1" for x in r.prefill_replica) / len(r)  # noqa: E731
    assert share(rr) == pytest.approx(0.5)
    assert share(jsq) < 0.45
    assert jsq.summary()["e2e_s"]["mean"] < rr.summary()["e2e_s"]["mean"]


def test_summary_keys_and_files(cluster, model, tmp_path):
    plan = single({"p0": ["m0:0"], "d0": ["m1:0"]})
    res = simulate(plan, cluster, model, burst(50, gap=0.2), SimOptions(slo=SLO(ttft_s=1.0, tpot_s=0.05)))
    s = res.summary()
    design = {"requests", "completed", "duration_s", "throughput_tokens_per_s", "goodput_requests_per_s",
              "slo_attainment", "ttft_s", "tpot_s", "e2e_s"}
    assert design <= set(s)
    for k in ("ttft_s", "tpot_s", "e2e_s", "atgt_s"):
        assert set(s[k]) == {"mean", "p50", "p90", "p99"}
    for k in ("output_tokens_per_s", "gpu_hours", "usd_per_million_output_tokens", "replicas"):
        assert k in s
    assert set(s["replicas"]["d0"]) >= {"utilisation", "kv_mean_use", "kv_peak_use"}
    assert 0 <= s["slo_attainment"] <= 1 and s["completed"] == 50
    files = res.save(tmp_path)
    assert json.loads((tmp_path / "summary.json").read_text())["requests"] == 50
    lines = (tmp_path / "requests.csv").read_text().splitlines()
    assert len(lines) == 51 and lines[0].startswith("id,arrival_s")
    assert all(f.exists() for f in files) and (tmp_path / "latency_cdf.png").stat().st_size > 1000


def test_queue_is_the_wait_for_a_replica_not_the_request_overhead(cluster, model):
    """A served request reaches the replicas after the front end's request overhead (HTTP,
    tokenisation): requests spaced far apart never wait for a replica, so their queue is 0, while
    their TTFT still carries the overhead."""
    plan = single({"p0": ["m0:0"], "d0": ["m1:0"]})
    wl = burst(5, inp=100, out=5, gap=10.0)
    alone = simulate(plan, cluster, model, wl)
    served = simulate(plan, cluster, model, wl, SimOptions(request_overhead_s=0.05))
    assert served.summary()["queue_s"]["p99"] == pytest.approx(0.0, abs=1e-9)
    assert np.allclose(served.ttft, alone.ttft + 0.05)


def test_slo_attainment_counts_every_target(cluster, model):
    plan = single({"p0": ["m0:0"], "d0": ["m1:0"]})
    wl = burst(100, gap=0.01)
    loose = simulate(plan, cluster, model, wl, SimOptions(slo=SLO(ttft_s=1e3, tpot_s=1e3)))
    tight = simulate(plan, cluster, model, wl, SimOptions(slo=SLO(ttft_s=1e3, tpot_s=1e-4)))
    assert loose.summary()["slo_attainment"] == 1.0 and tight.summary()["slo_attainment"] == 0.0


def test_real_trace_smoke(cluster, model):
    wl = load_workload("azure-conv").head(300)
    plan = single({"p0": ["m0:0", "m0:1"], "d0": ["m1:0", "m1:1"], "d1": ["m1:2", "m1:3"]},
                  routes=[("p0", "d0", 0.5), ("p0", "d1", 0.5)])
    s = simulate(plan, cluster, model, wl, SimOptions(route="load")).summary()
    # the trace's requests beyond the model's context are rejected, as a server rejects them
    beyond = int(((wl.input_tokens + wl.output_tokens) > model.max_context).sum())
    assert beyond > 0 and s["rejected"] == beyond and s["rejected_by"] == {"context": beyond}
    assert s["completed"] == 300 - beyond and s["throughput_tokens_per_s"] > 0


def test_rate_sweep_rows_and_plot(cluster, model, tmp_path):
    from hetserve.sim import rate_sweep
    plan = single({"p0": ["m0:0"], "d0": ["m1:0"]})
    wl = burst(120, gap=0.5, seed=2)
    rows = rate_sweep(plan, cluster, model, wl, [1.0, 4.0, 16.0], SimOptions(slo=SLO(ttft_s=0.5)),
                      label="p1d1", plot=tmp_path / "sweep.png")
    assert [r["rate"] for r in rows] == [1.0, 4.0, 16.0]
    att = [r["summary"]["slo_attainment"] for r in rows]
    assert att[0] >= att[-1] and rows[-1]["summary"]["throughput_tokens_per_s"] > rows[0]["summary"]["throughput_tokens_per_s"]
    assert (tmp_path / "sweep.png").stat().st_size > 1000


def test_colocated_prefills_never_overlap(cluster, model):
    """One prefill at a time on a colocated replica: a boundary event scheduled by an admission just
    before a prefill starts must not start another prefill (or decode) during it (regression)."""
    plan = single({"c0": ["m0:0"]})
    res = simulate(plan, cluster, model, load_workload("azure-conv").head(300).scale_rate(3),
                   SimOptions(beyond_context="run"))
    starts = np.unique(res.t_start)
    ends = np.array([res.t_first[res.t_start == s].max() for s in starts])
    assert np.all(starts[1:] >= ends[:-1] - 1e-9)  # each prefill batch starts after the previous ended
    assert res.replicas[0].utilisation <= 1.0 + 1e-9


def test_cpu_slots_sharing_cores_slow_concurrent_work(model, roofline):
    """Two replicas on CPU worker slots that share one core: a prompt that runs while the other
    replica decodes takes twice as long (k / c = 2), or (1 + (s - 1)) with a measured slow-down s;
    the same plan on GPUs (no cpu_cores) is not slowed."""
    from hetserve.specs.cluster import cluster_from_dict

    def cluster(cores):
        m = {"name": "m0", "gpu": "A100-SXM-80G", "count": 2, "site": "s0"}
        if cores:
            m["cpu_cores"] = cores
        return cluster_from_dict({"name": "test", "machines": [m]})

    plan = single({"c0": ["m0:0"], "c1": ["m0:1"]})
    wl = Workload.from_lists("two", [0.0, 0.001], [100, 3000], [400, 2])  # c1's prompt while c0 decodes
    opts = SimOptions(placement="rr")
    free = simulate(plan, cluster(None), model, wl, opts)
    shared = simulate(plan, cluster(1), model, wl, opts)
    loose = simulate(plan, cluster(2), model, wl, opts)
    measured = simulate(plan, cluster(2), model, wl, SimOptions(placement="rr", contention_slowdown=1.5))
    prefill = free.t_first[1] - free.t_start[1]
    assert shared.t_first[1] - shared.t_start[1] == pytest.approx(2 * prefill, rel=1e-6)
    assert loose.t_first[1] - loose.t_start[1] == pytest.approx(prefill, rel=1e-6)  # 2 workers, 2 cores
    assert measured.t_first[1] - measured.t_start[1] == pytest.approx(1.5 * prefill, rel=1e-6)
    assert free.t_finish[0] < shared.t_finish[0]  # c0's decode, started alone, slows once c1 works
