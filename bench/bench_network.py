"""Shared network capacity: do plans fit the NICs and pipes, and does the simulator deliver them?

    python -m bench.bench_network routes   [--time-limit S] [--pools a,b] [--algorithms x,y]
    python -m bench.bench_network agree    [--time-limit S] [--pools a,b] [--requests N]
    python -m bench.bench_network ratio    [--time-limit S] [--pools a,b]

``routes``: every algorithm plans Llama-2-70B (Azure conversation trace) on the held-out pools
(``bench.pools.held_out_pools``); each plan is written to a file, read back, and its traffic per
NIC / site pipe recomputed from the file alone (``hetserve.planner.traffic``). Target: at most
110 % of any capacity. ``exact`` is left out (it refuses pools over 8 GPUs).

``agree``: hexgen2's plan on het1-het5 and the held-out pools, simulated saturated (3x the
plan's request rate, the first N Azure requests within the model's context, default 6,000) with
every simulator option at its default; simulated tokens/s against the planner's estimate. Target:
within +-15 %. The plan is made for the trace it is simulated on (the first 6,000 requests average
252 output tokens, the whole trace 211: planning on the whole trace and simulating its head
compares two workloads). Beside it, at the plan's own rate: TTFT p90 under the default placement
and under ``lot`` (target: the default no worse). Two measures of the simulated rate: the whole run
(output tokens / first arrival to last completion) and the saturated window, which is what the
planner's steady-state estimate describes: from the 10th-percentile completion (the replicas have
filled) to the moment the first entry replica has started its last request (after that it runs
out of queued work: the drain, where the last long requests run alone, 25-45 % of the run on the
48- and 64-GPU pools), counting each request's output tokens as made evenly between its first and
last token.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from bench.lib.pools import held_out_pools
from hetserve.planner import ALGORITHMS, Plan, PlanOptions
from hetserve.planner.traffic import plan_traffic
from hetserve.policies.placement import DEFAULT_PLACEMENT
from hetserve.sim.simulator import SimOptions, simulate
from hetserve.specs.cluster import load_cluster
from hetserve.specs.model import load_model
from hetserve.specs.workload import load_workload

console = Console(width=150)
HET = ("hexgen2-het1", "hexgen2-het2", "hexgen2-het3", "hexgen2-het4", "hexgen2-het5")
ALGOS = ("hexgen2", "random-swap", "genetic", "uniform", "hexgen")


def _pools(names: str | None) -> dict:
    pools = {n: load_cluster(n) for n in HET}
    pools.update(held_out_pools())
    if names:
        pools = {n: c for n, c in pools.items() if n in names.split(",")}
    return pools


def _plan(algo, cluster, model, wl, time_limit):
    t = time.perf_counter()
    p = ALGORITHMS[algo](cluster, model, wl, PlanOptions(seed=0, time_limit_s=time_limit))
    return p, time.perf_counter() - t


def routes(args) -> None:
    model, wl = load_model("llama-2-70b"), load_workload("azure-conv")
    pools = _pools(args.pools or ",".join(held_out_pools()))
    t = Table(title=f"routed traffic recomputed from the plan file (llama-2-70b, azure-conv; time limit "
                    f"{args.time_limit:.0f} s; load {os.getloadavg()[0]:.1f})")
    for col in ("pool", "algorithm", "tokens/s", "busiest resource", "planned Gbit/s", "capacity", "util",
                "≤ 110 %", "plan s"):
        t.add_column(col, justify="left" if col in ("pool", "algorithm", "busiest resource") else "right")
    worst = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for name, cluster in pools.items():
            for algo in (args.algorithms.split(",") if args.algorithms else ALGOS):
                plan, wall = _plan(algo, cluster, model, wl, args.time_limit)
                path = Path(tmp) / f"{name}-{algo}.json"
                plan.save(path)
                back = Plan.load(path)  # the check reads the file, not the search's objects
                traffic = plan_traffic(back, cluster, model)
                top = traffic[0] if traffic else None
                util = top.utilisation if top else 0.0
                worst = max(worst, util)
                t.add_row(name, algo, f"{back.estimate['throughput_tokens_per_s']:,.0f}",
                          top.name if top else "(no traffic between boxes)",
                          f"{top.gbps:.3g}" if top else "–", f"{top.capacity * 8 / 1e9:.3g}" if top else "–",
                          f"{util:.1%}", "yes" if util <= 1.10 else "NO", f"{wall:.1f}")
                console.print(f"{name} {algo} util {util:.3f} ({wall:.0f} s)")
    console.print(t)
    console.print(f"worst utilisation over every plan: {worst:.1%} (target ≤ 110 %)")


def agree(args) -> None:
    model, wl = load_model("llama-2-70b"), load_workload("azure-conv")
    trace = wl.head(args.requests).within_context(model.max_context)  # what a server takes
    t = Table(title=f"planner estimate vs simulator, saturated at 3× the plan's rate ({len(trace):,} Azure "
                    f"requests, placement {args.placement}; load {os.getloadavg()[0]:.1f})")
    for col in ("pool", "plan", "estimate tok/s", "whole run tok/s", "whole / est", "saturated tok/s",
                "saturated / est", "within ±15 %", f"TTFT p90 1× {args.placement}", "TTFT p90 1× lot", "sim s"):
        t.add_column(col, justify="left" if col in ("pool", "plan") else "right")
    for name, cluster in _pools(args.pools).items():
        cached = Path(args.plans_dir) / f"{name}-{args.algorithm}.json" if args.plans_dir else None
        if cached is not None and cached.exists():
            plan = Plan.load(cached)
        else:
            plan, _ = _plan(args.algorithm, cluster, model, trace, args.time_limit)
            if cached is not None:
                cached.parent.mkdir(parents=True, exist_ok=True)
                plan.save(cached)
        e = plan.estimate
        rate = 3 * e["requests_per_period"] / e["period_s"]
        t0 = time.perf_counter()
        res = simulate(plan, cluster, model, trace.with_rate(rate), SimOptions(placement=args.placement))
        wall = time.perf_counter() - t0
        sim = res.summary()["throughput_tokens_per_s"]
        steady = saturated_tokens_per_s(res)
        est = e["throughput_tokens_per_s"]
        at_rate = trace.with_rate(rate / 3)
        p90 = {p: simulate(plan, cluster, model, at_rate, SimOptions(placement=p)).summary()["ttft_s"]["p90"]
               for p in dict.fromkeys((args.placement, "lot"))}
        kind = "disagg" if plan.is_disaggregated else "colocated"
        t.add_row(name, f"{args.algorithm} ({kind}, {len(plan.replicas)} replicas)", f"{est:,.0f}", f"{sim:,.0f}",
                  f"{sim / est:.2f}", f"{steady:,.0f}", f"{steady / est:.2f}",
                  "yes" if abs(steady / est - 1) <= 0.15 else "NO", f"{p90[args.placement]:.2f}", f"{p90['lot']:.2f}",
                  f"{wall:.1f}")
        console.print(f"{name}: estimate {est:,.0f} whole run {sim:,.0f} ({sim / est:.2f}) "
                      f"saturated {steady:,.0f} ({steady / est:.2f})")
    console.print(t)


def saturated_tokens_per_s(res) -> float:
    """Output tokens/s while every entry replica still has queued work (see the module docstring)."""
    start = float(np.sort(res.t_finish)[len(res.t_finish) // 10])
    last_start: dict[str, float] = {}
    for rid, t in zip(res.prefill_replica, res.t_start):
        last_start[rid] = max(last_start.get(rid, 0.0), float(t))
    end = min(last_start.values())
    if end <= start:  # never saturated long enough to measure
        return float("nan")
    made = np.clip((np.minimum(res.t_finish, end) - np.maximum(res.t_first, start))
                   / np.maximum(res.t_finish - res.t_first, 1e-9), 0.0, 1.0)
    return float((res.output_tokens * made).sum() / (end - start))


def ratio(args) -> None:
    model, wl = load_model("llama-2-70b"), load_workload("azure-conv")
    t = Table(title=f"hexgen2 / uniform estimate (llama-2-70b, azure-conv; load {os.getloadavg()[0]:.1f})")
    for col in ("pool", "hexgen2 tok/s", "uniform tok/s", "ratio"):
        t.add_column(col, justify="right")
    pools = _pools(args.pools or ",".join(HET + ("heldout-narrow-pipe-32",)))
    for name, c in pools.items():
        h, _ = _plan("hexgen2", c, model, wl, args.time_limit)
        u, _ = _plan("uniform", c, model, wl, args.time_limit)
        a, b = h.estimate["throughput_tokens_per_s"], u.estimate["throughput_tokens_per_s"]
        t.add_row(name, f"{a:,.0f}", f"{b:,.0f}", f"{a / b:.2f}")
        console.print(f"{name}: {a:,.0f} / {b:,.0f} = {a / b:.2f}")
    console.print(t)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("routes", "agree", "ratio"))
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--pools", help="comma-separated pool names (default: all of the sub-command's)")
    ap.add_argument("--algorithms", help="routes: comma-separated algorithms")
    ap.add_argument("--algorithm", default="hexgen2", help="agree: the planner")
    ap.add_argument("--requests", type=int, default=6000)
    ap.add_argument("--placement", default=DEFAULT_PLACEMENT,
                    help=f"agree: the simulator's request placement (default {DEFAULT_PLACEMENT}, the simulator's)")
    ap.add_argument("--plans-dir", help="agree: reuse / keep the plans here")
    args = ap.parse_args(argv)
    {"routes": routes, "agree": agree, "ratio": ratio}[args.what](args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
