"""``hetserve plan``: search a deployment plan and print it (or several, side by side)."""

from __future__ import annotations

import argparse
from pathlib import Path

from hetserve.cli.plan_report import print_comparison, print_engine_cost, print_explanation, print_plan
from hetserve.errors import InfeasibleError, PlanError
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
    from hetserve.cost.analytic import CostModel
    from hetserve.planner import ALGORITHMS, PlanOptions, validate_plan
    from hetserve.planner.context import check_weights_fit
    from hetserve.planner.traffic import network_warnings, nothing_served
    from hetserve.specs.cluster import load_cluster
    from hetserve.specs.model import load_model
    from hetserve.specs.workload import load_workload

    from dataclasses import replace

    from hetserve.output_path import check_distinct, check_output_file, check_plot_file
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
    _check_exact_size(names, cluster, "--compare" if args.compare else "--algorithm")
    model = load_model(args.model)
    efficiency = load_efficiency(args.efficiency) if args.efficiency else None
    # before the trace is read: a pool too small for the weights needs none
    check_weights_fit(cluster, model, CostModel(cluster, model, efficiency))
    workload = load_workload(args.workload)
    if args.workload_class:
        workload = workload.of_class(args.workload_class)
    console = Console()
    if args.efficiency and (note := foreign_calibration(args.efficiency, cluster.devices)):
        console.print(f"[yellow]warning[/]: {note}", soft_wrap=True)
    workload = _servable(workload, model, console, args.workload)
    # off a terminal a transient bar cannot erase itself: each would leave a blank line above the plan
    no_bar = args.quiet or not console.is_terminal
    plans = []
    for name in names:
        with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.fields[best]}"),
                      TimeElapsedColumn(), console=console, transient=True, disable=no_bar) as bar:
            task = bar.add_task(f"{name}", total=1.0, best="")

            def report(ev, task=task, bar=bar):
                bar.update(task, completed=ev.fraction, best=f"best {ev.best_tokens_per_s:,.0f} tok/s  it {ev.iteration}")

            options = PlanOptions(seed=args.seed, time_limit_s=args.time_limit, max_iterations=args.max_iterations,
                                  stall_iterations=args.stall_iterations,
                                  period_s=args.period, progress=report, allow_colocated=not args.disaggregated,
                                  efficiency=efficiency,
                                  objective=args.objective, slo_ttft_s=args.slo_ttft, slo_tpot_s=args.slo_tpot,
                                  rate=args.rate, budget_usd_per_hour=args.budget_usd_per_hour,
                                  engine=args.engine)
            plan = plan_for(ALGORITHMS[name], cluster, model, workload, options)
        validate_plan(plan, cluster, model)
        if args.engine != "hetserve":
            from hetserve.export.rules import refuse_unless_runnable
            refuse_unless_runnable(plan, args.engine)  # the search's filter missed a rule: say so, write nothing
            plan = replace(plan, estimate={**plan.estimate, "engine": args.engine})
        if args.efficiency:  # the roofline's efficiencies are a calibration's: the plan says whose, where and when
            from hetserve.calibration.file import timings_source

            plan = replace(plan, estimate={**plan.estimate, "calibration": timings_source(args.efficiency)})
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


def _check_exact_size(names, cluster, flag: str) -> None:
    """The exact searches refuse pools above ``PlanOptions.max_exact_devices``, which no option of
    this command sets: say so before any search starts, in the words a CLI user can act on."""
    from hetserve.planner.search.exact import EXACT, too_large

    exact = [n for n in names if n in EXACT]
    why = too_large(cluster) if exact else None
    if why:
        raise PlanError(f"{flag} {', '.join(exact)}: {why}: plan it with --algorithm hexgen2 (the default), "
                        f"genetic or random-swap")


def _servable(workload, model, console, source: str):
    """The requests the plan is made for (``planner.servable``: those within the model's context)."""
    from hetserve.errors import SpecError
    from hetserve.planner.servable import servable

    if not len(workload):  # --workload-class kept none
        raise SpecError(source, "(requests)", f"at least one request of class {workload.name.rpartition(':')[2]}",
                        "none")
    fit = servable(workload, model, source, "planned")
    if fit.note:
        console.print(f"note: {fit.note}", highlight=False)
    return fit.workload
