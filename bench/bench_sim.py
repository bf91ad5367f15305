"""Simulator speed: the whole Azure conversation trace against a hexgen2 plan for hexgen2-het1.

    .venv/bin/python -m bench.bench_sim [--repeats 1,2,4] [--plan plan.json] [--transmission fair]
    .venv/bin/python -m bench.bench_sim --fleet 43 --repeats 1,2,4   # 258 replicas, 0.83 M requests per 1x
    .venv/bin/python -m bench.bench_sim --fleet 43 --requests 10000 --repeats 1,2,4  # its first 10k, 20k, 40k

Fleet: the preset's hexgen2 plan (default hexgen2-het3: prefill, decode and colocated replicas)
tiled ``--fleet`` times, each copy on its own machines and sites, under the Azure trace replayed
``--fleet`` times faster (the same load per copy): one million requests at 52 copies.

Target: the 1x trace (19,366 requests, ~58 min) in under 10 s wall (350x faster than
real time), and wall time growing linearly with the number of requests (1x, 2x, 4x via
``Workload.repeat``). Prints a table; not a timed test.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import time

import yaml

from rich.console import Console
from rich.table import Table

from hetserve.planner import ALGORITHMS, PlanOptions
from hetserve.planner.plan import Plan
from hetserve.sim import SimOptions, simulate
from hetserve.specs.cluster import cluster_from_dict, load_cluster, preset_path
from hetserve.specs.model import load_model
from hetserve.specs.workload import load_workload


def hexgen2_plan(cluster, model, workload) -> tuple[Plan, str]:
    return ALGORITHMS["hexgen2"](cluster, model, workload, PlanOptions(seed=0)), "hexgen2 (seed 0)"


def tiled(preset: str, plan: Plan, copies: int):
    """``copies`` copies of a preset pool, each on its own machines and sites (``<name>-k``), and
    the plan repeated on every copy (replica ids ``<id>-k``, KV routes inside a copy)."""
    data = yaml.safe_load(preset_path(preset).read_text())
    machines = [{**m, "name": f"{m['name']}-{k}", "site": f"{m.get('site', 'default')}-{k}"}
                for k in range(copies) for m in data["machines"]]
    cluster = cluster_from_dict({"name": f"{preset}x{copies}", "machines": machines, "network": data["network"]},
                                f"<{preset}x{copies}>")
    d = plan.to_dict()

    def dev(name: str, k: int) -> str:
        machine, idx = name.rsplit(":", 1)
        return f"{machine}-{k}:{idx}"

    reps = [{**r, "id": f"{r['id']}-{k}", "stages": [{**st, "devices": [dev(x, k) for x in st["devices"]]}
                                                      for st in r["stages"]]}
            for k in range(copies) for r in d["replicas"]]
    routes = [{**e, "from": f"{e['from']}-{k}", "to": f"{e['to']}-{k}"} for k in range(copies) for e in d["kv_routes"]]
    return cluster, Plan.from_dict({**d, "cluster": cluster.name, "replicas": reps, "kv_routes": routes})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", default="1,2,4")
    ap.add_argument("--plan", help="plan file (default: run the hexgen2 planner)")
    ap.add_argument("--transmission", default="fair")
    ap.add_argument("--placement", default="jsq")
    ap.add_argument("--cluster", help="preset (default hexgen2-het1; with --fleet hexgen2-het3)")
    ap.add_argument("--fleet", type=int, default=0, help="tile the plan this many times (0: no tiling)")
    ap.add_argument("--requests", type=int, default=0, help="k x this many requests per row (0: the whole trace)")
    args = ap.parse_args()
    preset = args.cluster or ("hexgen2-het3" if args.fleet else "hexgen2-het1")
    cluster, model = load_cluster(preset), load_model("llama-2-70b")
    trace = load_workload("azure-conv")
    if args.plan:
        plan, how = Plan.load(args.plan), args.plan
    else:
        plan, how = hexgen2_plan(cluster, model, trace)
    if args.fleet:
        cluster, plan = tiled(preset, plan, args.fleet)
        how = f"{how} x{args.fleet}"
    console = Console(width=150)
    table = Table(title=f"simulator speed: azure-conv on {cluster.name}, llama-2-70b, {how} plan "
                        f"({len(plan.replicas)} replicas), {args.placement} + {args.transmission}",
                  title_justify="left")
    for col in ("trace", "requests", "simulated (s)", "wall (s)", "CPU (s)", "x real time", "us / request",
                "events", "completed", "tokens/s", "peak MB"):
        table.add_column(col, justify="right")
    base = None
    for k in (int(x) for x in args.repeats.split(",")):
        wl = trace.repeat(k) if k > 1 else trace
        if args.fleet:  # the trace replayed ``fleet`` times faster: the same load on every copy
            wl = trace.repeat(k * args.fleet).scale_rate(args.fleet)
        if args.requests:  # the first k × requests of it (per-request cost at a bounded run time)
            wl = wl.head(k * args.requests)
        t0, c0 = time.perf_counter(), time.process_time()
        res = simulate(plan, cluster, model, wl, SimOptions(placement=args.placement, transmission=args.transmission))
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        s = res.summary()
        per = wall / len(wl) * 1e6
        base = base or per
        table.add_row(f"{k}x", f"{len(wl):,}", f"{s['duration_s']:,.0f}", f"{wall:.2f}", f"{cpu:.2f}",
                      f"{s['duration_s'] / wall:,.0f}", f"{per:.0f} ({per / base:.2f})", f"{s['run']['events']:,}",
                      f"{s['completed']:,}", f"{s['throughput_tokens_per_s']:.0f}",
                      f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:,.0f}")
        console.print(f"  {k}x done: {wall:.1f} s wall, {cpu:.1f} s CPU", style="dim")
    console.print(table)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    console.print(f"python {platform.python_version()} on {platform.machine()}, {os.cpu_count()} CPUs, "
                  f"load average {load:.1f}; us / request (wall) in brackets relative to 1x")


if __name__ == "__main__":
    main()
