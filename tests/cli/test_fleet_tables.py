"""The per-replica tables of ``plan`` / ``describe plan`` and ``simulate`` at fleet scale: a plan of
hundreds of replicas prints a row per kind of replica with its count and totals, not a row each;
a plan of a few replicas still lists every one."""

import io

from rich.console import Console

from hetserve.cli.commands.simulate import print_summary
from hetserve.cli.plan_report import print_plan
from hetserve.cli.replica_tables import MAX_ROWS
from hetserve.planner.plan import Plan


def _plan(pairs: int) -> Plan:
    """``pairs`` prefill / decode pairs, one GPU each, every route p<k> -> d<k>; prefill replicas of
    two capacities (100 and 300 requests per period), each carrying its capacity."""
    replicas, per, routes = [], {}, []
    for k in range(pairs):
        for role, rid in (("prefill", f"p{k}"), ("decode", f"d{k}")):
            dev = f"m{k}:{0 if role == 'prefill' else 1}"
            replicas.append({"id": rid, "role": role, "stages": [{"devices": [dev], "layers": [0, 8]}]})
            cap = (100.0 if k % 2 else 300.0) if role == "prefill" else 500.0
            per[rid] = {"role": role, "capacity_requests_per_period": cap,
                        "flow_requests_per_period": cap if role == "prefill" else 100.0}
        routes.append({"from": f"p{k}", "to": f"d{k}", "weight": 1.0})
    return Plan.from_dict({"model": "tiny", "cluster": "fleet", "algorithm": "hexgen2", "replicas": replicas,
                           "kv_routes": routes, "estimate": {"replicas": per, "period_s": 600}})


def _printed(fn, *args) -> str:
    out = io.StringIO()
    fn(Console(file=out, width=200), *args)
    return out.getvalue()


def test_a_fleet_plan_prints_a_row_per_kind_of_replica_with_its_count_and_flow():
    out = _printed(print_plan, _plan(60))  # 120 replicas
    assert "30: p0, p2, p4, …" in out and "30: p1, p3, p5, …" in out and "60: d0, d1, d2, …" in out
    assert "9,000" in out and "3,000" in out and "6,000" in out  # each kind's flow in all
    assert "p59" not in out and "120 replicas, a row per kind" in out
    assert "KV routes: 60 from 60 prefill to 60 decode replicas" in out  # not 60 rows of routes
    assert len(out.splitlines()) < 30


def test_a_small_plan_still_lists_every_replica_and_route():
    out = _printed(print_plan, _plan(MAX_ROWS // 2))
    assert all(f"p{k} " in out and f"d{k} " in out for k in range(MAX_ROWS // 2))
    assert "a row per kind" not in out and "KV routes (weights" in out


def test_a_fleet_simulation_prints_a_row_per_kind_of_replica():
    reps = {f"r{i}": {"role": "colocated", "devices": 4, "requests": 10 + i, "utilisation": 0.1 + 0.01 * i,
                      "kv_mean_use": 0.05, "kv_peak_use": 0.01 * i} for i in range(60)}
    kinds = {f"r{i}": "4× H100-SXM-80G, TP4×80" if i < 20 else "4× A6000, TP4×80" for i in range(60)}
    figure = {"mean": 1.0, "p50": 1.0, "p90": 1.0, "p99": 1.0}
    s = {"completed": 60, "requests": 60, "duration_s": 1.0, "throughput_tokens_per_s": 1.0, "gpu_hours": 1.0,
         "run": {"wall_s": 1.0, "events": 1}, "replicas": reps,
         **{k: figure for k in ("ttft_s", "tpot_s", "atgt_s", "e2e_s", "queue_s", "kv_transfer_s")}}
    out = _printed(print_summary, s, "t", None, kinds)
    # H100s: r0..r19, requests 10..29 (390 in all), busy 0.10 to 0.29, KV peak at most 0.19
    assert "20: r0, r1, r2, …" in out and "390" in out and "0.10–0.29" in out and "0.19" in out
    assert "40: r20, r21, r22, …" in out and "4× A6000, TP4×80" in out
    assert "r59" not in out and "60 replicas, a row per kind" in out
