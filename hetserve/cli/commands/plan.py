"""``hetserve plan``: search a deployment plan and print it (or several, side by side)."""

from __future__ import annotations

import argparse
from pathlib import Path

from hetserve.errors import InfeasibleError, PlanError

BUSIEST_RESOURCES = 4  # shared NICs / pipes printed under a plan
# algorithms whose plans hold colocated replicas only, so --disaggregated cannot act on them
COLOCATED_ONLY = {"hexgen", "exact-colocated"}


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "plan", help="search a deployment plan for a model on a GPU pool",
        description="Search how to deploy MODEL on CLUSTER for WORKLOAD: replicas, roles, stages, KV routes.")
    p.add_argument("--cluster", required=True, help="cluster preset name or YAML file")
    p.add_argument("--model", required=True, help="model preset name, config.json or checkpoint folder")
    p.add_argument("--workload", default="azure-conv", help="workload preset or CSV trace (default: azure-conv)")
    p.add_argument("--workload-class", choices=("HPLD", "HPHD", "LPHD", "LPLD"),
                   help="plan for one HexGen-2 request class of the trace only")
    p.add_argument("--algorithm", help="one of: hexgen2 (default), random-swap, genetic, "
                   "uniform, hexgen, exact, exact-colocated")
    p.add_argument("--compare", metavar="A,B,...", help="run several algorithms and print them side by side")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--time-limit", type=float, default=None, metavar="S",
                   help="seconds for one plan search (default 110; each --compare algorithm has its own): the "
                        "search stops at three quarters of it, the final alternatives and the plan's upper bound "
                        "share the rest, the bound at least a quarter. On top of it: the bound's columns on a "
                        "pool's first plan (seconds); --budget-usd-per-hour: the subsets tried share the limit, "
                        "then the pool's bound has at least a quarter more; --objective cost: each budget tried "
                        "is such a search with the full limit (the minimum-cost bound before them is unlimited); "
                        "--explain: a quick re-plan per what-if, each up to the limit (--engine vllm/sglang: one "
                        "unrestricted search more)")
    p.add_argument("--max-iterations", type=int, default=None, metavar="N", help="cap on search iterations")
    p.add_argument("--stall-iterations", type=int, default=None, metavar="N",
                   help="hexgen2: stop after N iterations in a row without raising the best plan found by more "
                        "than 0.1%% (default: none up to 64 GPUs, 7 at 320, 5 from 480 on)")
    p.add_argument("--period", type=float, default=600.0, metavar="S",
                   help="period T of the flow network, seconds (default 600)")
    p.add_argument("--disaggregated", action="store_true",
                   help="hexgen2 / random-swap: always return prefill and decode replicas (as the paper), "
                        "even where colocated replicas would serve more")
    p.add_argument("--objective", choices=("throughput", "goodput", "cost"), default="throughput",
                   help="throughput (default): tokens/s at full load; goodput: requests/s meeting --slo-ttft/"
                        "--slo-tpot; cost: the cheapest subset of the pool serving --rate within the SLOs")
    p.add_argument("--slo-ttft", type=float, metavar="S", help="time-to-first-token target, seconds")
    p.add_argument("--slo-tpot", type=float, metavar="S", help="time-per-output-token target, seconds")
    p.add_argument("--rate", type=float, metavar="REQ/S", help="requests/s the cost objective must serve")
    p.add_argument("--budget-usd-per-hour", type=float, metavar="USD",
                   help="use only GPUs costing at most this much per hour in total (the planner chooses which)")
    p.add_argument("--engine", choices=("hetserve", "vllm", "sglang"), default="hetserve",
                   help="the engine the plan will run on (default hetserve): consider only the replica shapes it "
                        "can run (vllm, sglang: one TP degree per replica; docs/deploy.md); with --explain, the "
                        "unrestricted hexgen2 estimate beside it")
    p.add_argument("--efficiency", metavar="JSON", help="cost-model efficiency (from `hetserve calibrate -o`)")
    p.add_argument("-o", "--output", metavar="PLAN.json", help="write the plan (the best one with --compare)")
    p.add_argument("--explain", action="store_true",
                   help="say what bounds the plan (a replica's compute or memory, KV links, a named NIC or pipe) "
                        "and what one more GPU of each type or 2x the busiest shared link would give: the better "
                        "of this plan on that pool and a quick re-plan (each up to --time-limit, after the plan)")
    p.add_argument("--history", metavar="FILE.json",
                   help="write the search log (best value over time, gain of each kind of edit) of every "
                        "algorithm run; the plan file keeps only the search's summary")
    p.add_argument("--plot", metavar="PNG", help="draw best estimated throughput versus search time")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from hetserve.calibration.file import foreign_calibration
    from hetserve.cli.search_log import plot_convergence, write_history
    from hetserve.cost.efficiency import load_efficiency
    from hetserve.planner import ALGORITHMS, PlanOptions, validate_plan
    from hetserve.planner.traffic import network_warnings, nothing_served
    from hetserve.specs.cluster import load_cluster
    from hetserve.specs.model import load_model
    from hetserve.specs.workload import load_workload

    from dataclasses import replace

    from hetserve.cli.output_path import check_distinct, check_output_file, check_plot_file
    from hetserve.planner.objectives import plan_for
    from hetserve.planner.plan import ClusterFile

    _check_objective(args)
    for path, flag in ((args.output, "--output"), (args.history, "--history")):
        if path:
            check_output_file(path, flag)  # before the search, not after it
    check_distinct({"--output": args.output, "--history": args.history, "--plot": args.plot},
                   {"--cluster": args.cluster, "--workload": args.workload, "--efficiency": args.efficiency})
    if args.plot:
        check_plot_file(args.plot, "--plot")
    if args.compare and args.algorithm:  # one of them would be ignored
        raise PlanError(f"--algorithm {args.algorithm} and --compare {args.compare}: give one (--compare runs "
                        f"each algorithm it names)")
    names = [a.strip() for a in (args.compare or args.algorithm or "hexgen2").split(",") if a.strip()]
    if not names:
        raise PlanError(f"--compare: expected algorithm names separated by commas ({', '.join(ALGORITHMS)}), "
                        f"got {args.compare!r}")
    for a in names:
        if a not in ALGORITHMS:
            raise PlanError(f"unknown planning algorithm {a!r}; choose from {', '.join(ALGORITHMS)}")
    colocated = sorted(set(names) & COLOCATED_ONLY)
    if args.disaggregated and colocated:  # they build colocated replicas only: the flag could not act
        raise PlanError(f"--disaggregated: {', '.join(colocated)} builds colocated replicas only; choose an "
                        f"algorithm that splits prefill from decode (hexgen2, random-swap, genetic, uniform, exact) "
                        f"or drop --disaggregated")
    cluster = load_cluster(args.cluster)
    model = load_model(args.model)
    workload = load_workload(args.workload)
    if args.workload_class:
        workload = workload.of_class(args.workload_class)
    console = Console()
    if args.efficiency and (note := foreign_calibration(args.efficiency, {d.gpu.name for d in cluster.devices})):
        console.print(f"[yellow]warning[/]: {note}", soft_wrap=True)
    workload = _servable(workload, model, console, args.workload)
    plans = []
    for name in names:
        with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.fields[best]}"),
                      TimeElapsedColumn(), console=console, transient=True, disable=args.quiet) as bar:
            task = bar.add_task(f"{name}", total=1.0, best="")

            def report(ev, task=task, bar=bar):
                bar.update(task, completed=ev.fraction, best=f"best {ev.best_tokens_per_s:,.0f} tok/s  it {ev.iteration}")

            options = PlanOptions(seed=args.seed, time_limit_s=args.time_limit, max_iterations=args.max_iterations,
                                  stall_iterations=args.stall_iterations,
                                  period_s=args.period, progress=report, allow_colocated=not args.disaggregated,
                                  efficiency=load_efficiency(args.efficiency) if args.efficiency else None,
                                  objective=args.objective, slo_ttft_s=args.slo_ttft, slo_tpot_s=args.slo_tpot,
                                  rate=args.rate, budget_usd_per_hour=args.budget_usd_per_hour,
                                  engine=args.engine)
            plan = plan_for(ALGORITHMS[name], cluster, model, workload, options)
        validate_plan(plan, cluster, model)
        if args.engine != "hetserve":
            from hetserve.export.rules import refuse_unless_runnable
            refuse_unless_runnable(plan, args.engine)  # the search's filter missed a rule: say so, write nothing
            plan = replace(plan, estimate={**plan.estimate, "engine": args.engine})
        for w in network_warnings(plan, cluster, model):
            console.print(f"[yellow]warning[/]: {name}: {w}")
        plans.append(plan)
    if len(plans) == 1:
        print_plan(console, plans[0])
    else:
        print_comparison(console, plans)
    best = max(plans, key=lambda p: p.estimate.get("throughput_tokens_per_s", 0.0))
    if best.estimate.get("throughput_tokens_per_s", 0.0) <= 0:  # nothing worth writing: say why instead
        raise InfeasibleError(nothing_served(best, cluster, model))
    if args.output:
        if Path(args.cluster).is_file():  # made on a file, not a preset: the plan says which, and its digest
            best = replace(best, cluster_file=ClusterFile.of(args.cluster))
        best.save(args.output)
        console.print(f"wrote {args.output} ({best.algorithm})")
    if args.explain:
        if args.engine != "hetserve":
            print_engine_cost(console, best, cluster, model, workload, options, ALGORITHMS["hexgen2"])
        print_explanation(console, best, args, cluster, model, workload, options, ALGORITHMS[best.algorithm])
    if args.history:
        write_history(plans, args.history)
        console.print(f"wrote {args.history}")
    if args.plot:
        plot_convergence(plans, args.plot)
        console.print(f"wrote {args.plot}")
    return 0


def _check_objective(args) -> None:
    """One clear line for option combinations that make no sense (exit code 2 via PlanError)."""
    for opt in ("slo_ttft", "slo_tpot", "rate", "budget_usd_per_hour", "time_limit", "period"):
        v = getattr(args, opt, None)
        if v is not None and not v > 0:
            raise PlanError(f"--{opt.replace('_', '-')}: expected a positive number, got {v}")
    if args.objective == "cost" and args.rate is None:
        raise PlanError("--objective cost: give --rate REQ/S, the requests per second the plan must serve")
    if args.objective == "goodput" and args.slo_ttft is None and args.slo_tpot is None:
        raise PlanError("--objective goodput: give --slo-ttft and/or --slo-tpot (seconds)")
    if args.rate is not None and args.objective != "cost":
        raise PlanError("--rate: only read by --objective cost")
    if args.objective == "throughput" and (args.slo_ttft is not None or args.slo_tpot is not None):
        raise PlanError("--slo-ttft / --slo-tpot: only read by --objective goodput or cost "
                        "(throughput plans for full load, without SLOs)")


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _stages(replica) -> str:
    return " → ".join(f"TP{s.tp}×{s.layers[1] - s.layers[0]}" for s in replica.stages)


def _devices(replica) -> str:
    """Devices grouped by machine: ``a0:0-3, b0:1``."""
    by_machine: dict[str, list[int]] = {}
    for d in replica.devices:
        m, _, i = d.rpartition(":")
        by_machine.setdefault(m, []).append(int(i))
    parts = []
    for m, idx in by_machine.items():
        idx.sort()
        runs, start = [], idx[0]
        for a, b in zip(idx, idx[1:] + [None]):
            if b != a + 1:
                runs.append(f"{start}" if start == a else f"{start}-{a}")
                start = b
        parts.append(f"{m}:{','.join(runs)}")
    return " ".join(parts)


def print_plan(console, plan) -> None:
    from rich.table import Table

    e = plan.estimate
    per = e.get("replicas", {})
    t = Table(title=f"{plan.algorithm}: {plan.model} on {plan.cluster}",
              caption=f"req/T: requests per period T = {e.get('period_s', 600):g} s (cost model estimate)"
              if e else None)
    for col in ("replica", "role", "devices", "stages (TP×layers)", "capacity req/T", "flow req/T"):
        t.add_column(col, justify="right" if "req" in col else "left")
    for r in plan.replicas:
        info = per.get(r.id, {})
        t.add_row(r.id, r.role, _devices(r), _stages(r),
                  f"{info['capacity_requests_per_period']:,.0f}" if "capacity_requests_per_period" in info else "–",
                  f"{info['flow_requests_per_period']:,.0f}" if "flow_requests_per_period" in info else "–")
    console.print(t)
    if plan.kv_routes:
        routes = Table(title="KV routes (weights ∝ max flow)")
        routes.add_column("from")
        routes.add_column("to")
        routes.add_column("weight", justify="right")
        for k in plan.kv_routes:
            routes.add_row(k.src, k.dst, f"{k.weight:.3f}")
        console.print(routes)
    if not e:  # a hand-written plan (the bundled examples): say so rather than print zeros
        console.print("this plan file holds no estimate (written by hand, not by `hetserve plan`): "
                      "`hetserve simulate --plan FILE` predicts how it serves")
        return
    usd = e.get("cost_usd_per_hour")
    search = e.get("search", {})
    # under SLO objectives the capacities, the plan's value and its bound all count what meets the SLOs
    within_slo = " within the SLOs" if "slo" in e else ""
    console.print(
        f"estimated throughput{within_slo} [bold]{e.get('throughput_tokens_per_s', 0):,.1f} tokens/s[/bold] "
        f"({e.get('requests_per_period', 0):,.0f} requests per {e.get('period_s', 600):.0f} s); "
        f"{e.get('devices_used')}/{e.get('devices_total')} devices; "
        + (f"${usd:,.2f}/hour ({e.get('tokens_per_usd', 0):,.0f} tokens/$)" if usd is not None else "price unknown")
        + (f"; planned in {search.get('wall_s', 0):.1f} s ({_count(search.get('iterations', 0), 'search iteration')}, "
           f"{search.get('stopped_by')}; the alternatives and the bound included)" if search else ""))
    ub = e.get("upper_bound_tokens_per_s")
    if ub:
        console.print(f"{100 * e.get('throughput_tokens_per_s', 0) / ub:.1f} % of the bound: "
                      f"no placement of this pool exceeds {ub:,.1f} tokens/s{within_slo} under the cost model "
                      f"(group-column and per-device relaxations, planner/bound/throughput.py; its solver ran "
                      f"{e.get('upper_bound_wall_s', 0):.2g} s)")
        if e.get("upper_bound_cut_short"):
            console.print("the bound's solver stopped at the time limit, unfinished: still a bound, a looser one "
                          "than it would prove with more time (a longer --time-limit tightens it)")
    if "goodput_requests_per_s" in e:
        slo = e.get("slo", {})
        console.print(f"goodput {e['goodput_requests_per_s']:,.3f} requests/s within TTFT ≤ {slo.get('ttft_s')} s, "
                      f"TPOT ≤ {slo.get('tpot_s')} s (estimate: M/D/1 prefill queue, decode batch within the TPOT)")
    if "budget_usd_per_hour" in e:
        console.print(f"budget ${e['budget_usd_per_hour']:,.2f}/h: plan uses ${usd or 0:,.2f}/h")
    if "rate_requests_per_s" in e:
        console.print(f"cheapest found for {e['rate_requests_per_s']:g} requests/s: ${usd or 0:,.2f}/h "
                      f"(no subset can cost less than ${e['min_cost_bound_usd_per_hour']:,.2f}/h: planner/bound/min_cost.py)")
    network = e.get("network") or {}
    if network:
        # busiest first whatever order the file kept (a YAML plan's keys come back sorted)
        busiest = sorted(network.items(), key=lambda kv: -kv[1].get("utilisation", 0.0))[:BUSIEST_RESOURCES]
        console.print("busiest shared links (planned / capacity): " + "; ".join(
            f"{name} {v['planned_gbps']:.3g}/{v['capacity_gbps']:.3g} Gbit/s ({v['utilisation']:.0%})"
            for name, v in busiest))
    if e.get("notes"):
        console.print(f"note: {e['notes']}")
    if e.get("pricing"):
        console.print(_priced_by(e["pricing"]))


def _priced_by(pricing: dict) -> str:
    """How the cost model priced each GPU type (fitted kernel model, transferred, roofline)."""
    from hetserve.cost.kernel_pricing import describe_pricing

    return f"priced by: {describe_pricing(pricing)} (docs/cost-model.md)"


def print_comparison(console, plans) -> None:
    from rich import box
    from rich.table import Table

    # no rules between columns, P/D/C in one: ten bordered columns cut headers to "sear…" and "$/…" at 80
    # characters; where even this is too wide, the algorithm's name folds, never a number
    t = Table(title=f"{plans[0].model} on {plans[0].cluster}", box=box.SIMPLE_HEAD, show_edge=False,
              collapse_padding=True, pad_edge=False)
    for col in ("algorithm", "tokens/s", "req/T", "P/D/C", "GPUs", "$/h", "search s", "iters"):
        t.add_column(col, justify="left" if col == "algorithm" else "right", no_wrap=col != "algorithm",
                     overflow="fold")
    base = max(p.estimate.get("throughput_tokens_per_s", 0.0) for p in plans) or 1.0
    for p in plans:
        e = p.estimate
        s = e.get("search", {})
        usd = e.get("cost_usd_per_hour")
        tps = e.get("throughput_tokens_per_s", 0.0)
        t.add_row(p.algorithm, f"{tps:,.1f} ({tps / base:.0%})", f"{e.get('requests_per_period', 0):,.0f}",
                  "/".join(str(len(p.by_role(r))) for r in ("prefill", "decode", "colocated")),
                  f"{e.get('devices_used')}/{e.get('devices_total')}", "–" if usd is None else f"{usd:,.2f}",
                  f"{s.get('wall_s', 0):.2f}", str(s.get("iterations", 0)))
    console.print(t)
    periods = sorted({p.estimate.get("period_s", 600) for p in plans})
    console.print("P/D/C: prefill, decode and colocated replicas; GPUs: used / in the pool; "
                  f"req/T: requests per period T = {', '.join(f'{x:g}' for x in periods)} s")
    # the algorithms share one cost model: its pricing is said once (each distinct one, were they to differ)
    pricings = list(dict.fromkeys(_priced_by(p.estimate["pricing"]) for p in plans if p.estimate.get("pricing")))
    within = " within the SLOs" if any("slo" in p.estimate for p in plans) else ""
    console.print(f"tokens/s and req/T: the planner's estimates{within} under the cost model"
                  + ("; " + "; ".join(pricings) if pricings else ""))


def print_explanation(console, plan, args, cluster, model, workload, options, fn) -> None:
    from rich.table import Table

    from hetserve.planner.explain import bottlenecks, plan_tokens_per_s, what_if_options, what_ifs
    from hetserve.planner.options import DEFAULT_TIME_LIMIT_S

    console.print("[bold]what bounds this plan[/bold] (min cut of its flow):")
    for line in bottlenecks(plan, cluster, model, workload, options):
        console.print(f"  • {line}")
    plain = what_if_options(options)
    # the rows' base is this plan priced as they are (the evaluator, their options), so an unchanged
    # plan reads +0.0 %, never the rounding of its estimate
    base = plan_tokens_per_s(plan, cluster, model, workload, plain)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("[bold]what-ifs[/bold] {task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=True, disable=args.quiet) as bar:
        task = bar.add_task("", total=None)

        def on_variant(i, n, label):
            if i == 0:  # each re-plan is a search of its own: say what that costs before the first
                console.print(f"what-ifs: {n} quick re-plans, each up to the time limit "
                              f"({options.time_limit_s or DEFAULT_TIME_LIMIT_S:g} s) plus its pool's bound "
                              f"columns (seconds on a large pool)")
            bar.update(task, total=n, completed=i, description=label)

        rows = what_ifs(plan, args.cluster, model, workload, plain, fn, on_variant=on_variant)
    if not rows:
        console.print("  (what-ifs need a cluster file with machines, not a device matrix)")
        return
    within = " within the SLOs" if "slo" in plan.estimate else ""
    t = Table(title=f"what-ifs: the better of this plan on the edited pool and a quick re-plan "
                    f"({plan.algorithm}, fewer restarts)",
              caption=f"vs plan: against this plan's {base:,.1f} tokens/s{within}"
                      f"; upper bound: the edited pool's (planner/bound/throughput.py); all estimates under the "
                      f"cost model, priced as above")
    for col in ("change", "tokens/s", "vs plan", "from", "upper bound"):
        t.add_column(col, justify="right" if col in ("tokens/s", "vs plan", "upper bound") else "left")
    for r in rows:
        v = r.tokens_per_s
        t.add_row(r.change, "–" if v is None else f"{v:,.1f}",
                  "–" if v is None or not base else f"{v / base - 1:+.1%}", r.source,
                  (f"{r.upper_bound:,.0f}" + (" *" if r.cut_short else "")) if r.upper_bound else "–")
    console.print(t)
    for r in rows:
        if r.note:
            console.print(f"  {r.change}: {r.note}")
    if any(r.cut_short for r in rows):
        console.print("  * the bound's solver stopped at the time limit, unfinished: still a bound, but looser by "
                      "however far it had got, so starred bounds do not compare with each other or with the "
                      "plan's (a longer --time-limit tightens them)")


def print_engine_cost(console, plan, cluster, model, workload, options, hexgen2) -> None:
    """What the engine's rules cost: this plan's estimate beside an unrestricted hexgen2 plan's and the
    bound (a second search with the same options and time limit)."""
    from hetserve.planner.explain import engine_cost

    row = engine_cost(plan, cluster, model, workload, options, hexgen2)
    ub = row["upper_bound_tokens_per_s"]
    console.print(f"[bold]what {options.engine}'s rules cost[/bold]: {row['engine_tokens_per_s']:,.1f} tokens/s under "
                  f"them, {row['unrestricted_tokens_per_s']:,.1f} unrestricted (hexgen2, same options) "
                  f"({row['engine_tokens_per_s'] / max(row['unrestricted_tokens_per_s'], 1e-9) - 1:+.1%}); "
                  + (f"bound {ub:,.1f} tokens/s" if ub else "no bound"))


def _servable(workload, model, console, source: str):
    """The requests a server of ``model`` takes: one longer than its context is refused (by the
    engine, and by the simulator), so a plan counting it would promise tokens nobody serves."""
    from hetserve.errors import SpecError

    fits = workload.within_context(model.max_context)
    if not len(workload):  # --workload-class kept none
        raise SpecError(source, "(requests)", f"at least one request of class {workload.name.rpartition(':')[2]}",
                        "none")
    if not len(fits):
        raise SpecError(source, "(requests)", f"requests within {model.name}'s context of "
                        f"{model.max_context} tokens", f"all {len(workload)} longer")
    if len(fits) < len(workload):
        console.print(f"note: {len(workload) - len(fits)} of {len(workload)} requests exceed {model.name}'s context "
                      f"of {model.max_context} tokens; planned for the {len(fits)} that fit", highlight=False)
    return fits
