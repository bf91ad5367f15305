"""Simulator speed: the whole Azure conversation trace against a hexgen2 plan for hexgen2-het1.

    .venv/bin/python -m bench.bench_sim [--repeats 1,2,4] [--plan plan.json] [--transmission fair]
    .venv/bin/python -m bench.bench_sim --fleet 43 --repeats 1,2,4   # 258 replicas, 0.83 M requests per 1x
    .venv/bin/python -m bench.bench_sim --fleet 43 --requests 10000 --repeats 1,2,4  # its first 10k, 20k, 40k
    .venv/bin/python -m bench.bench_sim --pool 1024 --plan p1024.json --rate-scale 43 --requests 20000
        # the planner's plan for 1,024 GPUs (256 colocated replicas), the trace 43x faster

Fleet: the preset's hexgen2 plan (default hexgen2-het3: prefill, decode and colocated replicas)
tiled ``--fleet`` times, each copy on its own machines and sites, under the Azure trace replayed
``--fleet`` times faster (the same load per copy): one million requests at 52 copies.

``--compiled`` adds this checkout's compiled copy (``make fast-sim``: the hot modules built with
mypyc in ``.fast-sim/``) to every row, alternating with the plain modules.

Each row runs in a fresh process (its peak memory is its own). ``--against TREE`` runs every row
a second time with another checkout's ``hetserve`` (the same rows, alternating, so both see the
same machine load) and says whether the two simulated the same thing (a digest of the results).

    git worktree add --detach /tmp/base HEAD~1
    .venv/bin/python -m bench.bench_sim --fleet 43 --requests 10000 --plan plan.json --against /tmp/base

Target: the 1x trace (19,366 requests, ~58 min) in under 10 s wall (350x faster than
real time), and wall time growing linearly with the number of requests (1x, 2x, 4x via
``Workload.repeat``). Prints a table; not a timed test.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import resource
import subprocess
import tempfile
import sys
import time
from pathlib import Path

import numpy as np

import yaml
from rich.console import Console
from rich.table import Table

import hetserve
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


def digest(res) -> str:
    """Hash of a run's per-request timings, placements and summary (its wall time and event count left out): two
    revisions that simulate the same thing give the same digest."""
    h = hashlib.sha256()
    for a in (res.t_start, res.t_first, res.t_kv_start, res.t_kv_done, res.t_join, res.t_finish):
        h.update(np.ascontiguousarray(a).tobytes())
    # left out: the pricing's description (older trees lack it) and the loop's event count (the
    # simulator's own work: handling several link finishes in one event changes it, not a result)
    skip = ("wall_s", "pricing", "events")
    summary = res.summary()
    for k in skip:
        summary.get("run", {}).pop(k, None)
    info = {k: v for k, v in res.info.items() if k not in skip}
    h.update(json.dumps([res.prefill_replica, res.decode_replica, res.rejected, summary, info],
                        sort_keys=True, default=str).encode())
    return h.hexdigest()[:12]


def preset_of(args: argparse.Namespace) -> str:
    return args.cluster or ("hexgen2-het3" if args.fleet else "hexgen2-het1")


def pool_of(args: argparse.Namespace):
    """The cluster a row plans on: the synthetic pool (``--pool``) or the preset."""
    if args.pool:
        from bench.lib.pools import synthetic_pool  # the checkout's (a row may run another tree's hetserve)

        return synthetic_pool(args.pool)
    return load_cluster(preset_of(args))


def one_row(args: argparse.Namespace, k: int) -> dict:
    """Simulate row ``k`` (k x the trace, or k x ``--requests``) and measure it."""
    preset = preset_of(args)
    model, trace = load_model("llama-2-70b"), load_workload("azure-conv")
    cluster = pool_of(args)
    plan = Plan.load(args.plan) if args.plan else hexgen2_plan(cluster, model, trace)[0]
    if args.fleet:
        cluster, plan = tiled(preset, plan, args.fleet)
    wl = trace.repeat(k) if k > 1 else trace
    faster = args.fleet or args.rate_scale
    if faster > 1:  # the trace replayed ``faster`` times faster (a fleet: the same load on every copy)
        wl = trace.repeat(k * faster).scale_rate(faster)
    if args.requests:  # the first k × requests of it (per-request cost at a bounded run time)
        wl = wl.head(k * args.requests)
    t0, c0 = time.perf_counter(), time.process_time()
    res = simulate(plan, cluster, model, wl, SimOptions(placement=args.placement, transmission=args.transmission))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    s = res.summary()
    return {"requests": len(wl), "replicas": len(plan.replicas), "cluster": cluster.name,
            "simulated_s": s["duration_s"], "wall_s": wall, "cpu_s": cpu, "events": s["run"]["events"],
            "completed": s["completed"], "tokens_per_s": s["throughput_tokens_per_s"],
            "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "digest": digest(res),
            "code": str(Path(hetserve.__file__).resolve().parents[1])}


def row_in(tree: str, argv: list[str], k: int) -> dict:
    """``one_row`` in a fresh process whose ``hetserve`` is the one in ``tree`` (this file measures)."""
    code = ("import importlib.util, json, sys; sys.path[:0] = [sys.argv[1]]; sys.path.append(sys.argv[4]); "
            "spec = importlib.util.spec_from_file_location('bench_sim_here', sys.argv[2]); "
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
            "print(json.dumps(m.one_row(m.parser().parse_args(sys.argv[5:]), int(sys.argv[3]))))")
    here = str(Path(__file__).resolve().parents[1])  # bench.lib, whichever tree's hetserve runs
    out = subprocess.run([sys.executable, "-c", code, tree, __file__, str(k), here, *argv], check=True,
                         capture_output=True, text=True, cwd=tree).stdout
    return json.loads(out.strip().splitlines()[-1])


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", default="1,2,4")
    ap.add_argument("--plan", help="plan file (default: the hexgen2 planner's, planned once for every row)")
    ap.add_argument("--transmission", default="fair")
    ap.add_argument("--placement", default="jsq")
    ap.add_argument("--cluster", help="preset (default hexgen2-het1; with --fleet hexgen2-het3)")
    ap.add_argument("--fleet", type=int, default=0, help="tile the plan this many times (0: no tiling)")
    ap.add_argument("--pool", type=int, default=0,
                    help="simulate on bench.lib.pools.synthetic_pool(N) instead of a preset (the planner "
                         "benchmark's pools: at 1,024 GPUs hexgen2 plans 256 colocated replicas)")
    ap.add_argument("--rate-scale", type=int, default=1,
                    help="replay the trace this many times faster (with --fleet: the fleet's size)")
    ap.add_argument("--requests", type=int, default=0, help="k x this many requests per row (0: the whole trace)")
    ap.add_argument("--against", metavar="TREE",
                    help="also run every row with the hetserve of TREE (another revision's checkout, e.g. "
                         "`git worktree add /tmp/base HEAD~1`), each row in a fresh process, alternating")
    ap.add_argument("--compiled", action="store_true",
                    help="also run every row with this checkout's compiled copy (`make fast-sim`, .fast-sim/), "
                         "alternating; refused if the copy was built from other sources")
    return ap


def main() -> None:
    args = parser().parse_args()
    argv = [a for i, a in enumerate(sys.argv[1:]) if a != "--against" and sys.argv[i] != "--against"
            and not a.startswith("--against=")]
    here = str(Path(__file__).resolve().parents[1])
    # every row simulates one plan, planned here once without --plan: the planner stopping by its
    # clock plans differently in processes of different speed (a compiled row's, a loaded one's)
    workdir = None if args.plan else tempfile.TemporaryDirectory(prefix="bench_sim-")  # kept to the end
    plan_file = os.path.abspath(args.plan) if workdir is None else str(Path(workdir.name) / "plan.json")
    if workdir is not None:
        hexgen2_plan(pool_of(args), load_model("llama-2-70b"), load_workload("azure-conv"))[0].save(plan_file)
    argv += ["--plan", plan_file]
    trees = [("this tree", here)]
    if args.compiled:
        from bench.lib.fast_sim import problem  # here only: a row's process may run in another tree

        copy = Path(here) / ".fast-sim"
        why = problem(copy, Path(here))
        if why:
            sys.exit(f"bench_sim --compiled: {why}")
        trees.append(("compiled", str(copy)))
    trees += [("against", os.path.abspath(args.against))] if args.against else []
    console = Console(width=180)
    rows = []
    for k in (int(x) for x in args.repeats.split(",")):
        for name, tree in trees:
            row = row_in(tree, argv, k)
            rows.append((name, k, row))
            console.print(f"  {k}x {name} ({row['code']}): {row['wall_s']:.1f} s wall, {row['cpu_s']:.1f} s CPU",
                          style="dim")
    first = rows[0][2]
    table = Table(title=f"simulator speed: azure-conv on {first['cluster']}, llama-2-70b, {args.plan or 'hexgen2'} "
                        f"plan{f' x{args.fleet}' if args.fleet else ''} ({first['replicas']} replicas), "
                        f"{f'the trace {args.rate_scale}x faster, ' if args.rate_scale > 1 and not args.fleet else ''}"
                        f"{args.placement} + {args.transmission}", title_justify="left")
    for col in ("code", "trace", "requests", "simulated (s)", "wall (s)", "CPU (s)", "x real time",
                "us CPU / request", "events", "completed", "tokens/s", "peak MB", "results"):
        table.add_column(col, justify="right")
    base: dict[str, float] = {}
    for name, k, r in rows:
        per = r["cpu_s"] / r["requests"] * 1e6
        base.setdefault(name, per)
        same = {x["digest"] for n, kk, x in rows if kk == k}
        table.add_row(name, f"{k}x", f"{r['requests']:,}", f"{r['simulated_s']:,.0f}", f"{r['wall_s']:.2f}",
                      f"{r['cpu_s']:.2f}", f"{r['simulated_s'] / r['wall_s']:,.0f}",
                      f"{per:.0f} ({per / base[name]:.2f})", f"{r['events']:,}", f"{r['completed']:,}",
                      f"{r['tokens_per_s']:.0f}", f"{r['peak_mb']:,.0f}",
                      r["digest"] + ("" if len(trees) == 1 else " same" if len(same) == 1 else " DIFFERENT"))
    console.print(table)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    console.print(f"python {platform.python_version()} on {platform.machine()}, {os.cpu_count()} CPUs, "
                  f"load average {load:.1f}; us CPU / request in brackets relative to the code's first row; "
                  f"results: a digest of each run's per-request timings and summary")


if __name__ == "__main__":
    main()
