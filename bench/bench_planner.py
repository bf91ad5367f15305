"""Planner benchmarks: printed tables, not timed tests.

    python -m bench.bench_planner scaling [--quick]   # wall time and throughput vs pool size
    python -m bench.bench_planner scaling --sizes fleet --ten-x-up-to 0 --time-limit 600  # 1,024–4,096 GPUs
    python -m bench.bench_planner quality [--quick]   # hexgen2 vs baselines on hexgen2-het1, 4 classes
    python -m bench.bench_planner exact               # gap to the exact search on pools of ≤ 8 GPUs
    python -m bench.bench_planner seeds [--seeds 5]    # 5 seeds on het1–het5 + 48 GPUs; baselines; gains; bound gap
    python -m bench.bench_planner bound --sizes 20,64,320  # hexgen2 against the bounds: het1–5, 48, sizes
    python -m bench.bench_planner bound-time --sizes 320,1024,4096  # the bounds alone: CPU s, peak memory
    python -m bench.bench_planner cost                # HexGen-2 §5.2 cost efficiency; Mélange-style rent table
    python -m bench.bench_planner all [--quick]

Scaling: HexGen-2 on synthetic pools (``bench.pools``) of 20…320 GPUs (``--sizes fleet``: 1,024,
2,048, 4,096) serving Llama-2-70B on the Azure conversation trace, with a second run of the same
search given ten times the time, the restarts and the stall rule's iterations ("10×" column; ``--ten-x-up-to`` bounds
the pool sizes it is run for). Every run is a process of its own: CPU time, peak memory and the
bound (with its CPU time solved alone) are that run's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from rich.console import Console
from rich.table import Table

from bench.lib.exact_pools import exact_cases
from bench.lib.pools import synthetic_pool
from hetserve.planner import ALGORITHMS, PlanOptions
from hetserve.planner.options import default_restarts, default_stall_iterations
from hetserve.specs.cluster import load_cluster
from hetserve.specs.model import load_model
from hetserve.specs.workload import load_workload

CLASSES = ("HPLD", "HPHD", "LPHD", "LPLD")
SIZES = (20, 64, 128, 192, 256, 320)
FLEET_SIZES = (1024, 2048, 4096)  # --sizes fleet
console = Console(width=140)


_CPU: list[float] = [0.0]  # CPU seconds of the last ``_run`` (wall time is noisy on a shared machine)


def _run(algo: str, cluster, model, workload, **opts):
    t, c = time.perf_counter(), time.process_time()
    plan = ALGORITHMS[algo](cluster, model, workload, PlanOptions(**opts))
    _CPU[0] = time.process_time() - c
    return plan, time.perf_counter() - t


def scaling(quick: bool, ten_x_up_to: int, time_limit: float, sizes=None, max_iterations=None) -> None:
    """Each run in a fresh process (its peak memory is its own; caches start empty). ``max_iterations``:
    the same search path on any machine load (a run cut by the clock depends on the load)."""
    sizes = sizes or (SIZES[:2] if quick else SIZES)
    t = Table(title=f"hexgen2 planner time vs pool size (llama-2-70b, azure-conv, time limit {time_limit:.0f} s)")
    for col in ("GPUs", "sites", "replicas", "wall s", "CPU s", "iterations", "stopped by",
                "tokens/s", "bound", "ours / bound", "bound CPU s", "peak MB", "10× run s", "10× tokens/s",
                "ours / 10×"):
        t.add_column(col, justify="right")
    for n in sizes:
        r = _in_child(_scaling_run, n, time_limit, None, max_iterations)
        ub = r["bound"]
        row = [str(n), str(r["sites"]), str(r["replicas"]), f"{r['wall']:.1f}", f"{r['cpu']:.1f}",
               str(r["iterations"]), r["stopped_by"], f"{r['value']:,.0f}", f"{ub:,.0f}" if ub else "–",
               f"{r['value'] / ub:.3f}" if ub else "–", f"{r['bound_cpu']:.1f}", f"{r['peak_mb']:,.0f}"]
        if n <= ten_x_up_to:
            long = _in_child(_scaling_run, n, 10 * time_limit, 10 * default_restarts(n), None,
                             10 * (default_stall_iterations(n) or 0) or None)
            row += [f"{long['wall']:.1f}", f"{long['value']:,.0f}", f"{r['value'] / long['value']:.3f}"]
        else:
            row += ["–", "–", "–"]
        t.add_row(*row)
        console.print(f"  {n} GPUs done in {r['wall']:.1f} s ({r['cpu']:.1f} s CPU; {_load()})", style="dim")
    console.print(t)
    console.print("CPU s: the run's CPU time (on a shared machine wall time is mostly waiting); bound: the "
                  "plan's proven upper bound (planner/bound), computed inside the run (bound CPU s: a fresh "
                  "solve of it alone, after the run); peak MB: the run's peak resident memory (one process "
                  "per run). " + _load())


def _in_child(fn, *args):
    """``fn(*args)`` in a fresh Python process (spawned: nothing inherited)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as ex:
        return ex.submit(fn, *args).result()


def _scaling_run(n: int, time_limit: float, restarts: int | None, max_iterations: int | None = None,
                 stall_iterations: int | None = None) -> dict:
    """One hexgen2 run on ``synthetic_pool(n)``; then the bound solved again alone, for its CPU time."""
    from hetserve.planner.bound import throughput as B
    from hetserve.planner.context import PlanContext

    model, wl = load_model("llama-2-70b"), load_workload("azure-conv")
    c = synthetic_pool(n)
    plan, wall = _run("hexgen2", c, model, wl, time_limit_s=time_limit, restarts=restarts,
                      max_iterations=max_iterations, stall_iterations=stall_iterations)
    cpu, peak = _CPU[0], _peak_mb()
    e, s = plan.estimate, plan.estimate["search"]
    B._CACHE.clear()
    B._COLUMNS.clear()
    b = time.process_time()
    B.upper_bound(PlanContext(c, model, wl))
    return {"sites": len(c.sites), "replicas": len(plan.replicas), "wall": wall, "cpu": cpu,
            "iterations": s["iterations"], "stopped_by": s["stopped_by"], "value": e["throughput_tokens_per_s"],
            "bound": e.get("upper_bound_tokens_per_s"), "bound_cpu": time.process_time() - b, "peak_mb": peak}


def _peak_mb() -> float:
    """This process's peak resident memory so far (MB)."""
    import resource

    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb / 1024 if sys.platform != "darwin" else kb / 2**20


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


def exact_gap(only_mixed: bool = False) -> None:
    wl = load_workload("azure-conv")
    pools = exact_cases(only_mixed)
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
                      ("mixed" if x.is_disaggregated and x.by_role("colocated") else
                       "disagg." if x.is_disaggregated else "coloc."), f"{hv:,.0f}", f"{th:.2f}", f"{hv / xv:.3f}",
                      *(f"{r:.3f}" for r in rest), f"{hc / xc:.3f}")
    console.print(t)
    console.print(f"hexgen2 / exact: min {min(ratios):.3f}, mean {statistics.mean(ratios):.3f} over {len(ratios)} cases")


HET = ("hexgen2-het1", "hexgen2-het2", "hexgen2-het3", "hexgen2-het4", "hexgen2-het5")
BASELINES = ("genetic", "random-swap", "uniform", "hexgen")


def _load() -> str:
    import os

    return "load avg " + " / ".join(f"{x:.1f}" for x in os.getloadavg())


def seeds(n_seeds: int, pools=None) -> None:
    """hexgen2 on every seed: spread, every baseline on the same seed, the share of the gain each
    kind of move earned (search log), and the gap to the upper bound."""
    model, wl = load_model("llama-2-70b"), load_workload("azure-conv")
    pools = pools or [*HET, "synthetic-48"]
    t = Table(title=f"hexgen2 over {n_seeds} seeds (llama-2-70b, azure-conv); baselines on the same seeds")
    for col in ("pool", "hexgen2 tokens/s per seed", "spread", "wall s (mean)", "min hexgen2 / best baseline",
                "upper bound", "hexgen2 / bound"):
        t.add_column(col, justify="left" if col == "pool" else "right")
    gains: dict[str, float] = {}
    for name in pools:
        c = synthetic_pool(48) if name == "synthetic-48" else load_cluster(name)
        vals, walls, worst = [], [], float("inf")
        for s in range(n_seeds):
            h, wall = _run("hexgen2", c, model, wl, seed=s)
            v = h.estimate["throughput_tokens_per_s"]
            vals.append(v)
            walls.append(wall)
            for g in (h.search_log or {}).get("gains", []):
                key = "restart kicks" if g["phase"] == "restart" else (
                    "final step" if g["phase"] == "final" else g["kind"].split(":")[0] if g["kind"].startswith("cut")
                    else "other guided edits")
                gains[key] = gains.get(key, 0.0) + g["tokens_per_s"]
            best_base = max(_run(a, c, model, wl, seed=s)[0].estimate["throughput_tokens_per_s"] for a in BASELINES)
            worst = min(worst, v / best_base)
            ub = h.estimate["upper_bound_tokens_per_s"]
        t.add_row(name, " / ".join(f"{v:,.0f}" for v in vals), f"{(max(vals) - min(vals)) / max(vals):.1%}",
                  f"{statistics.mean(walls):.1f}", f"{worst:.3f}", f"{ub:,.0f}", f"{max(vals) / ub:.3f}")
        console.print(f"  {name}: {' / '.join(f'{v:,.0f}' for v in vals)}; spread "
                      f"{(max(vals) - min(vals)) / max(vals):.1%}; min hexgen2/best baseline {worst:.3f}; "
                      f"bound {ub:,.0f} ({max(vals) / ub:.3f}); gains so far "
                      + ", ".join(f"{k} {v:,.0f}" for k, v in sorted(gains.items(), key=lambda x: -x[1]))
                      + f" ({_load()})", style="dim")
    console.print(t)
    total = sum(gains.values()) or 1.0
    g = Table(title="share of hexgen2's improvement over its phase-1 start, by kind of move (all pools and seeds)")
    g.add_column("kind")
    g.add_column("share", justify="right")
    for k, v in sorted(gains.items(), key=lambda x: -x[1]):
        g.add_row(k, f"{v / total:.1%}")
    console.print(g)
    console.print("cut …: min-cut-guided edits in the first descent or after a guided escape; other guided "
                  "edits: the flow-utilisation moves (idle devices, splits, merges); restart kicks: climbs "
                  "after a random kick; final step: colocated / mixed alternative. " + _load())


def bound_gap(sizes, pools=None) -> None:
    """hexgen2 against the upper bound on the HexGen-2 settings and synthetic pools: the per-device
    LP (the old bound), the group-column programme and the tighter of the two (what plans report),
    the bound's own CPU time, and — where the programme's columns are machines — its best integer
    point scored by the planner's evaluator (a plan; when it beats hexgen2 the gap is the search's)."""
    from hetserve.planner.bound import throughput as B
    from hetserve.planner.context import PlanContext

    model, wl = load_model("llama-2-70b"), load_workload("azure-conv")
    names = pools or [*HET, "synthetic-48"] + [f"synthetic-{n}" for n in sizes]
    t = Table(title="hexgen2 against the upper bound (planner/bound/throughput.py), llama-2-70b, azure-conv")
    for col in ("pool", "GPUs", "hexgen2 tokens/s", "per-device LP", "group bound", "bound CPU s",
                "hexgen2 / LP", "hexgen2 / bound", "bound's own plan, scored"):
        t.add_column(col, justify="left" if col == "pool" else "right")
    for name in names:
        c = synthetic_pool(int(name.split("-")[1])) if name.startswith("synthetic") else load_cluster(name)
        h, wall = _run("hexgen2", c, model, wl)
        ctx = PlanContext(c, model, wl)
        lp = B.per_device_bound(ctx).tokens_per_s
        B._CACHE.clear()  # the plan's estimate already solved it: time a fresh solve
        B._COLUMNS.clear()
        cpu = time.process_time()
        g = B.group_bound(ctx)
        cpu = time.process_time() - cpu
        ub = min(lp, g.tokens_per_s) if g else lp
        v = h.estimate["throughput_tokens_per_s"]
        scored = _score_incumbent(ctx) if g and g.incumbent else None
        binding = [b for b in (g.binding if g else ()) if not b.startswith(("devices", "machine devices"))]
        t.add_row(name, str(len(c)), f"{v:,.0f}", f"{lp:,.0f}", f"{g.tokens_per_s:,.0f}" if g else "–", f"{cpu:.1f}",
                  f"{v / lp:.3f}", f"{v / ub:.3f}", f"{scored:,.0f}" if scored else "–")
        console.print(f"  {name}: hexgen2 {v:,.0f} ({wall:.0f} s), LP {lp:,.0f}, group bound "
                      f"{g.tokens_per_s if g else float('nan'):,.0f} in {cpu:.1f} s CPU; binding in its relaxation: "
                      f"{', '.join(binding)}; its plan: {g.incumbent if g else ()}; {_load()}", style="dim")
    console.print(t)
    console.print("bound CPU s: group_bound alone (columns + MILP). " + _load())


def bound_time(sizes) -> None:
    """The bounds alone on ``synthetic_pool(n)``: CPU time of the per-device LP and of the group
    programme (columns and MILP), their values and the process's peak memory (a process per size)."""
    t = Table(title="the upper bounds alone on synthetic pools (llama-2-70b, azure-conv)")
    for col in ("GPUs", "machines", "sites", "per-device LP", "LP CPU s", "group bound", "group CPU s", "peak MB"):
        t.add_column(col, justify="right")
    for n in sizes:
        r = _in_child(_bound_run, n)
        t.add_row(str(n), str(r["machines"]), str(r["sites"]), f"{r['lp']:,.0f}", f"{r['lp_cpu']:.1f}",
                  f"{r['group']:,.0f}", f"{r['group_cpu']:.1f}", f"{r['peak_mb']:,.0f}")
        console.print(f"  {n} GPUs done ({_load()})", style="dim")
    console.print(t)
    console.print(_load())


def _bound_run(n: int) -> dict:
    from hetserve.planner.bound import throughput as B
    from hetserve.planner.context import PlanContext

    c = synthetic_pool(n)
    ctx = PlanContext(c, load_model("llama-2-70b"), load_workload("azure-conv"))
    a = time.process_time()
    lp = B.per_device_bound(ctx).tokens_per_s
    b = time.process_time()
    g = B.group_bound(ctx)
    return {"machines": len({d.machine for d in c.devices}), "sites": len(c.sites), "lp": lp, "lp_cpu": b - a,
            "group": g.tokens_per_s if g else float("nan"), "group_cpu": time.process_time() - b,
            "peak_mb": _peak_mb()}


def _score_incumbent(ctx) -> float | None:
    """The planner's evaluator (every layout) on the bound's own best integer point
    (``hexgen2.bound_start``), or None where the bound's columns are not machines."""
    from hetserve.planner.pool.evaluator import Evaluator
    from hetserve.planner.search.hexgen2 import bound_start

    start = bound_start(ctx)
    return Evaluator(ctx, exhaustive_layouts=True).evaluate(start).tokens_per_s if start else None


def cost(quick: bool) -> None:
    """HexGen-2 §5.2: setting 5 (70 % of the budget) against 8×H100 with DistServe-style plans;
    the budget objective choosing GPUs from the union of settings 1–5; a Mélange-style table."""
    from hetserve.planner import plan as plan_fn

    model, wl = load_model("llama-2-70b"), load_workload("azure-conv")
    homo, het5 = load_cluster("hexgen2-homo"), load_cluster("hexgen2-het5")
    t = Table(title=f"cost efficiency (HexGen-2 §5.2): het5 ${het5.usd_per_hour():.2f}/h vs homogeneous "
                    f"${homo.usd_per_hour():.2f}/h")
    for col in ("class", "homo uniform (DistServe)", "homo hexgen2", "het5 hexgen2", "het5 / homo uniform",
                "het5 tokens/$ / homo tokens/$"):
        t.add_column(col, justify="left" if col == "class" else "right")
    for k in (("all",) + CLASSES[:2] if quick else ("all",) + CLASSES):
        w = wl if k == "all" else wl.of_class(k)
        u = _run("uniform", homo, model, w)[0].estimate
        hh = _run("hexgen2", homo, model, w)[0].estimate
        h5 = _run("hexgen2", het5, model, w)[0].estimate
        t.add_row(k, f"{u['throughput_tokens_per_s']:,.0f}", f"{hh['throughput_tokens_per_s']:,.0f}",
                  f"{h5['throughput_tokens_per_s']:,.0f}",
                  f"{h5['throughput_tokens_per_s'] / u['throughput_tokens_per_s']:.2f}",
                  f"{h5['tokens_per_usd'] / u['tokens_per_usd']:.2f}")
    console.print(t)
    # Mélange-style: which GPUs to rent for a rate, within TTFT ≤ 2 s and TPOT ≤ 0.1 s
    pool = synthetic_pool(48)
    m = Table(title=f"cheapest GPUs for a rate ({pool.name}: H100 / A100 / L40 / A6000 machines; "
                    f"TTFT ≤ 2 s, TPOT ≤ 0.1 s; sized at 70 % load)")
    for col in ("requests/s", "GPUs chosen", "$/h", "lower bound $/h (min_cost)", "estimated goodput req/s",
                "simulated SLO attainment", "simulated completed"):
        m.add_column(col, justify="right")
    from hetserve.sim.simulator import SimOptions, simulate
    from hetserve.specs.workload import SLO
    for rate in ((0.5, 2.0) if quick else (0.5, 1.0, 2.0, 4.0)):
        opts = PlanOptions(seed=0, objective="cost", rate=rate, slo_ttft_s=2.0, slo_tpot_s=0.1)
        p = plan_fn(pool, model, wl, "hexgen2", opts)
        e = p.estimate
        counts: dict[str, int] = {}
        for d in p.devices:
            g = pool.device(d).gpu.name
            counts[g] = counts.get(g, 0) + 1
        sim = simulate(p, pool, model, wl.with_rate(rate).head(400),
                       SimOptions(slo=SLO(ttft_s=2.0, tpot_s=0.1), chunked_prefill=True)).summary()
        m.add_row(f"{rate:g}", ", ".join(f"{n}×{g}" for g, n in sorted(counts.items())),
                  f"{e['cost_usd_per_hour']:.2f}", f"{e['min_cost_bound_usd_per_hour']:.2f}",
                  f"{e['goodput_requests_per_s']:.2f}", f"{sim['slo_attainment']:.2f}", f"{sim['completed']}/400")
        console.print(f"  rate {rate} done ({_load()})", style="dim")
    console.print(m)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("scaling", "quality", "exact", "seeds", "bound", "bound-time", "cost", "all"))
    p.add_argument("--mixed-only", action="store_true", help="exact: only the island and two-box pools (mixed plans)")
    p.add_argument("--seeds", type=int, default=5, help="seeds for the seeds benchmark")
    p.add_argument("--pools", help="comma-separated pools for the seeds / bound benchmarks (presets or synthetic-N)")
    p.add_argument("--quick", action="store_true", help="fewer sizes / classes (a minute or two)")
    p.add_argument("--time-limit", type=float, default=110.0, help="search time limit per run (s)")
    p.add_argument("--max-iterations", type=int, help="scaling: stop each run after this many iterations")
    p.add_argument("--ten-x-up-to", type=int, default=64, help="largest pool given the 10× run")
    p.add_argument("--sizes", help="comma-separated pool sizes for scaling (default 20,64,…,320; "
                   "'fleet': 1024,2048,4096)")
    args = p.parse_args(argv)
    console.print(f"python {sys.version.split()[0]}; planner benchmarks ({'quick' if args.quick else 'full'})")
    if args.what in ("scaling", "all"):
        sizes = (list(FLEET_SIZES) if args.sizes == "fleet"
                 else [int(x) for x in args.sizes.split(",")] if args.sizes else None)
        scaling(args.quick, args.ten_x_up_to, args.time_limit, sizes, args.max_iterations)
    if args.what in ("quality", "all"):
        quality(args.quick, args.time_limit)
    if args.what in ("exact", "all"):
        exact_gap(args.mixed_only)
    if args.what in ("seeds", "all"):
        seeds(args.seeds, args.pools.split(",") if args.pools else None)
    if args.what in ("bound", "all"):
        bound_gap([int(x) for x in args.sizes.split(",")] if args.sizes else [20, 64, 320],
                  args.pools.split(",") if args.pools else None)
    if args.what == "bound-time":
        bound_time([int(x) for x in args.sizes.split(",")] if args.sizes else [320, 1024])
    if args.what in ("cost", "all"):
        cost(args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
