"""Planner benchmarks: printed tables, not timed tests.

    python -m bench.bench_planner scaling [--quick]   # wall time and throughput vs pool size
    python -m bench.bench_planner quality [--quick]   # hexgen2 vs baselines on hexgen2-het1, 4 classes
    python -m bench.bench_planner exact               # gap to the exact search on pools of ≤ 8 GPUs
    python -m bench.bench_planner all [--quick]

Scaling: HexGen-2 on synthetic pools (``bench.pools``) of 20…320 GPUs serving Llama-2-70B on the
Azure conversation trace, with a second run of the same search given ten times the time and
ten times the restarts ("10×" column; ``--ten-x-up-to`` bounds the pool sizes it is run for).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from rich.console import Console
from rich.table import Table

if __package__ in (None, ""):  # run as `python bench/bench_planner.py`: make `bench` importable
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.pools import synthetic_pool  # noqa: E402
from hetserve.planner import ALGORITHMS, PlanOptions
from hetserve.planner.options import default_restarts
from hetserve.specs.cluster import cluster_from_dict, load_cluster
from hetserve.specs.model import load_model
from hetserve.specs.workload import load_workload

CLASSES = ("HPLD", "HPHD", "LPHD", "LPLD")
SIZES = (20, 64, 128, 192, 256, 320)
console = Console(width=140)


def _run(algo: str, cluster, model, workload, **opts):
    t = time.perf_counter()
    plan = ALGORITHMS[algo](cluster, model, workload, PlanOptions(**opts))
    return plan, time.perf_counter() - t


def scaling(quick: bool, ten_x_up_to: int, time_limit: float, sizes=None) -> None:
    model, wl = load_model("llama-2-70b"), load_workload("azure-conv")
    sizes = sizes or (SIZES[:2] if quick else SIZES)
    t = Table(title=f"hexgen2 planner time vs pool size (llama-2-70b, azure-conv, time limit {time_limit:.0f} s)")
    for col in ("GPUs", "sites", "replicas", "wall s", "iterations", "stopped by",
                "tokens/s", "10× run s", "10× tokens/s", "ours / 10×"):
        t.add_column(col, justify="right")
    for n in sizes:
        c = synthetic_pool(n)
        plan, wall = _run("hexgen2", c, model, wl, time_limit_s=time_limit)
        e, s = plan.estimate, plan.estimate["search"]
        row = [str(n), str(len(c.sites)), str(len(plan.replicas)), f"{wall:.1f}", str(s["iterations"]),
               s["stopped_by"], f"{e['throughput_tokens_per_s']:,.0f}"]
        if n <= ten_x_up_to:
            long, wall10 = _run("hexgen2", c, model, wl, time_limit_s=10 * time_limit,
                                restarts=10 * default_restarts(len(c)))
            v10 = long.estimate["throughput_tokens_per_s"]
            row += [f"{wall10:.1f}", f"{v10:,.0f}", f"{e['throughput_tokens_per_s'] / v10:.3f}"]
        else:
            row += ["–", "–", "–"]
        t.add_row(*row)
        console.print(f"  {n} GPUs done in {wall:.1f} s", style="dim")
    console.print(t)


def quality(quick: bool, time_limit: float) -> None:
    model, wl = load_model("llama-2-70b"), load_workload("azure-conv")
    c = load_cluster("hexgen2-het1")
    algos = ("hexgen2", "genetic", "random-swap", "uniform", "hexgen")
    classes = CLASSES[:2] if quick else CLASSES
    t = Table(title=f"estimated throughput (tokens/s), llama-2-70b on hexgen2-het1 (time limit {time_limit:.0f} s)")
    t.add_column("class")
    for a in algos:
        t.add_column(a, justify="right")
    t.add_column("hexgen2 / genetic", justify="right")
    t.add_column("hexgen2 / random-swap", justify="right")
    ratios = {"genetic": [], "random-swap": [], "uniform": [], "hexgen": []}
    for k in classes:
        vals, times = {}, {}
        for a in algos:
            plan, wall = _run(a, c, model, wl.of_class(k), time_limit_s=time_limit)
            vals[a], times[a] = plan.estimate["throughput_tokens_per_s"], wall
        for a in ratios:
            ratios[a].append(vals["hexgen2"] / vals[a])
        t.add_row(k, *(f"{vals[a]:,.0f} ({times[a]:.1f} s)" for a in algos),
                  f"{vals['hexgen2'] / vals['genetic']:.2f}×", f"{vals['hexgen2'] / vals['random-swap']:.2f}×")
    console.print(t)
    console.print("mean hexgen2 ratio: " + ", ".join(f"vs {a} {statistics.mean(r):.2f}×" for a, r in ratios.items()))


def _case_study():
    return cluster_from_dict({
        "name": "case-study-e (4×H100 + 4×A100)",
        "machines": [{"name": "h0", "gpu": "H100-SXM-80G", "count": 4, "site": "a"},
                     {"name": "a0", "gpu": "A100-SXM-80G", "count": 4, "site": "b"}],
        "network": {"intra_site": {"bandwidth_gbps": 10, "latency_ms": 0.5},
                    "inter_site": {"bandwidth_gbps": 3, "latency_ms": 15}}})


def exact_gap() -> None:
    wl = load_workload("azure-conv")
    pools = [(_case_study(), "llama-2-70b"), (load_cluster("hexgen2-homo"), "llama-2-70b"),
             (load_cluster("aladdin-a100"), "llama-2-70b"), (load_cluster("demo-cpu"), "llama-2-7b"),
             (load_cluster("aladdin-v100"), "llama-2-7b"), (load_cluster("molink-3x4090"), "llama-2-7b")]
    others = ("uniform", "random-swap", "genetic")
    t = Table(title="gap to the exact search (partitions × roles × layout alternatives, and colocated), tokens/s")
    for col in ("pool", "model", "class", "exact", "exact s", "kind", "hexgen2", "hexgen2 s", "hexgen2 / exact",
                *(f"{a} / exact" for a in others), "hexgen / exact-col."):
        t.add_column(col, justify="left" if col in ("pool", "model", "class", "kind") else "right")
    ratios = []
    for cluster, mname in pools:
        m = load_model(mname)
        for k in ("all",) + CLASSES:
            w = wl if k == "all" else wl.of_class(k)
            x, tx = _run("exact", cluster, m, w)
            h, th = _run("hexgen2", cluster, m, w)
            xv, hv = x.estimate["throughput_tokens_per_s"], h.estimate["throughput_tokens_per_s"]
            rest = [_run(a, cluster, m, w)[0].estimate["throughput_tokens_per_s"] / xv for a in others]
            xc = _run("exact-colocated", cluster, m, w)[0].estimate["throughput_tokens_per_s"]
            hc = _run("hexgen", cluster, m, w)[0].estimate["throughput_tokens_per_s"]
            ratios.append(hv / xv)
            t.add_row(cluster.name, mname, k, f"{xv:,.0f}", f"{tx:.2f}",
                      "disagg." if x.is_disaggregated else "coloc.", f"{hv:,.0f}", f"{th:.2f}", f"{hv / xv:.3f}",
                      *(f"{r:.3f}" for r in rest), f"{hc / xc:.3f}")
    console.print(t)
    console.print(f"hexgen2 / exact: min {min(ratios):.3f}, mean {statistics.mean(ratios):.3f} over {len(ratios)} cases")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("scaling", "quality", "exact", "all"))
    p.add_argument("--quick", action="store_true", help="fewer sizes / classes (a minute or two)")
    p.add_argument("--time-limit", type=float, default=110.0, help="search time limit per run (s)")
    p.add_argument("--ten-x-up-to", type=int, default=64, help="largest pool given the 10× run")
    p.add_argument("--sizes", help="comma-separated pool sizes for scaling (default 20,64,…,320)")
    args = p.parse_args(argv)
    console.print(f"python {sys.version.split()[0]}; planner benchmarks ({'quick' if args.quick else 'full'})")
    if args.what in ("scaling", "all"):
        sizes = [int(x) for x in args.sizes.split(",")] if args.sizes else None
        scaling(args.quick, args.ten_x_up_to, args.time_limit, sizes)
    if args.what in ("quality", "all"):
        quality(args.quick, args.time_limit)
    if args.what in ("exact", "all"):
        exact_gap()
    return 0


if __name__ == "__main__":
    sys.exit(main())
