"""Simulator speed: the whole Azure conversation trace against a hexgen2 plan for hexgen2-het1.

    .venv/bin/python -m bench.bench_sim [--repeats 1,2,4] [--plan plan.json] [--transmission fair]

Target: the 1x trace (19,366 requests, ~58 min) in under 10 s wall (350x faster than
real time), and wall time growing linearly with the number of requests (1x, 2x, 4x via
``Workload.repeat``). Prints a table; not a timed test.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

from rich.console import Console
from rich.table import Table

from hetserve.planner import ALGORITHMS, PlanOptions
from hetserve.planner.plan import Plan
from hetserve.sim import SimOptions, simulate
from hetserve.specs.cluster import load_cluster
from hetserve.specs.model import load_model
from hetserve.specs.workload import load_workload


def hexgen2_plan(cluster, model, workload) -> tuple[Plan, str]:
    return ALGORITHMS["hexgen2"](cluster, model, workload, PlanOptions(seed=0)), "hexgen2 (seed 0)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", default="1,2,4")
    ap.add_argument("--plan", help="plan file (default: run the hexgen2 planner)")
    ap.add_argument("--transmission", default="fair")
    ap.add_argument("--placement", default="jsq")
    args = ap.parse_args()
    cluster, model = load_cluster("hexgen2-het1"), load_model("llama-2-70b")
    trace = load_workload("azure-conv")
    if args.plan:
        plan, how = Plan.load(args.plan), args.plan
    else:
        plan, how = hexgen2_plan(cluster, model, trace)
    console = Console(width=150)
    table = Table(title=f"simulator speed: azure-conv on hexgen2-het1, llama-2-70b, {how} plan "
                        f"({len(plan.replicas)} replicas), {args.placement} + {args.transmission}",
                  title_justify="left")
    for col in ("trace", "requests", "simulated (s)", "wall (s)", "CPU (s)", "x real time", "us / request",
                "events", "completed", "tokens/s"):
        table.add_column(col, justify="right")
    base = None
    for k in (int(x) for x in args.repeats.split(",")):
        wl = trace.repeat(k) if k > 1 else trace
        t0, c0 = time.perf_counter(), time.process_time()
        res = simulate(plan, cluster, model, wl, SimOptions(placement=args.placement, transmission=args.transmission))
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        s = res.summary()
        per = wall / len(wl) * 1e6
        base = base or per
        table.add_row(f"{k}x", f"{len(wl):,}", f"{s['duration_s']:,.0f}", f"{wall:.2f}", f"{cpu:.2f}",
                      f"{s['duration_s'] / wall:,.0f}", f"{per:.0f} ({per / base:.2f})", f"{s['run']['events']:,}",
                      f"{s['completed']:,}", f"{s['throughput_tokens_per_s']:.0f}")
    console.print(table)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    console.print(f"python {platform.python_version()} on {platform.machine()}, {os.cpu_count()} CPUs, "
                  f"load average {load:.1f}; us / request (wall) in brackets relative to 1x")


if __name__ == "__main__":
    main()
