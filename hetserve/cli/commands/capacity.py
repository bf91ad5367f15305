"""``hetserve capacity``: GPUs per worker (Aladdin Eq. 6) and workers per arrival rate (Eq. 7).

    hetserve capacity --gpu A100-SXM-80G --model llama-2-13b --workload sharegpt \\
        --rates 5,10,20 --slo-ttft 0.6 --slo-tpot 0.03 [--placement aladdin|jsq|po2|rr|lot|eft]

Prints the per-GPU throughput of every TP degree, the fewest workers meeting the SLOs at each
rate (by simulation with the chosen placement, or the fluid lower bound with ``--method fluid``), the
fitted law N_w = ⌈k5·r + c5⌉, and with ``--heartbeat`` the worker count scaled over the trace.
A simulated count below the fluid lower bound (a trace that ended before its queue showed) is shown
raised to the bound, marked ``*``, with a warning naming the ``--requests`` a trustworthy run needs.
"""

from __future__ import annotations

import argparse
import math
import sys

from rich.console import Console
from rich.table import Table

from hetserve.errors import InfeasibleError, SpecError
from hetserve.policies.placement import placement_names

DEFAULT_PLACEMENT, DEFAULT_TARGET, DEFAULT_REQUESTS = "aladdin", 0.99, 1500
# what only the simulation reads: named under --method fluid, they would change nothing
SIM_ONLY = {"placement": DEFAULT_PLACEMENT, "target": DEFAULT_TARGET, "requests": DEFAULT_REQUESTS}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("capacity", help="GPUs per worker and workers per arrival rate (Aladdin)",
                       description="Choose the GPUs per worker that maximise per-GPU throughput under the "
                                   "SLOs, then the fewest workers meeting the SLOs at each arrival rate.")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--cluster", help="cluster preset or file; its first GPU type and in-box link are used")
    where.add_argument("--gpu", help="GPU type from gpus.csv (workers sized on a box of 8 of these)")
    p.add_argument("--model", required=True, help="model preset or config.json")
    p.add_argument("--workload", required=True, help="workload preset or CSV")
    rates = p.add_mutually_exclusive_group(required=True)
    rates.add_argument("--rate", type=float, help="arrival rate, req/s")
    rates.add_argument("--rates", help="comma-separated arrival rates, req/s (fits N_w = ceil(k5*r + c5))")
    p.add_argument("--slo-ttft", type=float, required=True, help="TTFT target, seconds")
    p.add_argument("--slo-tpot", type=float, required=True, help="ATGT / TPOT target, seconds per token")
    p.add_argument("--placement", "--router", dest="placement", choices=placement_names(),
                   help="placement policy: %(choices)s (default aladdin)")
    p.add_argument("--mode", choices=["colocated", "decode"], default="colocated",
                   help="colocated workers, or decode workers behind a prefill pool (only decode counted)")
    p.add_argument("--gpus-per-worker", type=int, help="override the Eq. 6 choice")
    p.add_argument("--method", choices=["sim", "fluid"], default="sim",
                   help="simulate (default), or the fluid lower bound from the cost model: the rate over the "
                        "most requests/s a worker completes, no queueing")
    p.add_argument("--target", type=float, help=f"share of requests that must meet the SLOs (default {DEFAULT_TARGET})")
    p.add_argument("--requests", type=int, help=f"requests simulated per rate (default {DEFAULT_REQUESTS})")
    p.add_argument("--heartbeat", type=float, help="also scale workers over the trace every this many seconds")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


def _rates(args) -> list[float]:
    if args.rate is not None:
        vals = [args.rate]
    else:
        parts = args.rates.split(",")
        if any(not x.strip() for x in parts):  # "5,,10", "5,": refused, not skipped (a rate lost in typing?)
            raise SpecError("--rates", "rates", "comma-separated numbers with no empty entry", args.rates)
        try:
            vals = [float(x) for x in parts]
        except ValueError as exc:
            raise SpecError("--rates", "rates", "comma-separated numbers", args.rates) from exc
    if not vals or not all(math.isfinite(v) and v > 0 for v in vals):
        raise SpecError("--rates", "rates", "positive numbers of requests/s", args.rate or args.rates)
    return sorted(set(vals))  # a rate given twice is one row (the worker law needs two distinct rates)


def run(args: argparse.Namespace) -> int:
    from hetserve.capacity import config, workers
    from hetserve.capacity.scaling import plan_scaling
    from hetserve.planner.servable import servable
    from hetserve.specs.cluster import load_cluster
    from hetserve.specs.model import load_model
    from hetserve.specs.workload import SLO, load_workload

    if args.heartbeat and len(_rates(args)) < 2:  # the scaling follows the worker law, fitted on two rates
        raise SpecError("--heartbeat", "rates", "--rates with at least two rates to fit the worker law on",
                        args.rate if args.rate is not None else args.rates)
    named = [f"--{k}" for k in SIM_ONLY if getattr(args, k) is not None]
    if args.method == "fluid" and named:
        raise SpecError(named[0], "method", "--method sim (the fluid lower bound simulates nothing, so no placement, "
                        "target share or request count enters it); drop " + ", ".join(named), "--method fluid")
    for k, default in SIM_ONLY.items():
        if getattr(args, k) is None:
            setattr(args, k, default)
    console = Console()
    model = load_model(args.model)
    slo = SLO(args.slo_ttft, args.slo_tpot)
    rates = _rates(args)
    # warnings and notes wait until every option is checked: a refusal comes before any other word
    warnings: list[str] = []
    intra = None
    if args.cluster:
        cluster = load_cluster(args.cluster)
        gpu = cluster.devices[0].gpu.name
        others = sorted({d.gpu.name for d in cluster.devices} - {gpu})
        if others:
            warnings.append(f"warning: capacity sizes workers of one GPU type: {gpu}, {args.cluster}'s first; its "
                            f"{', '.join(others)} are left out (pass --gpu to choose)")
        devs = next((d for d in cluster.machines.values() if len(d) > 1), None)
        if devs:
            lat, bw = cluster.link(devs[0].index, devs[1].index)
            intra = {"bandwidth_gbps": bw * 8 / 1e9, "latency_ms": lat * 1e3}
    else:
        from hetserve.specs.gpus import gpu as gpu_spec

        gpu = gpu_spec(args.gpu, "--gpu").name  # named as the option, not as the pool built from it
        cluster = config.homogeneous_cluster(gpu, 8, 8)
    # the names above, and whether one box holds the weights at all, before the trace is read
    config.check_weights_fit(cluster, model, gpu)
    whole = load_workload(args.workload, seed=args.seed)
    fit = servable(whole, model, args.workload, "sized")
    base = fit.workload
    mi, mo = base.mean_input, base.mean_output

    opts = config.worker_options(cluster, model, slo, mi, mo, gpu_name=gpu)
    if args.gpus_per_worker and all(o.gpus != args.gpus_per_worker for o in opts):
        raise SpecError("--gpus-per-worker", "gpus_per_worker", "a degree the pool can host in one box: "
                        + ", ".join(str(o.gpus) for o in opts), args.gpus_per_worker)
    picked = next((o for o in opts if o.gpus == args.gpus_per_worker), None)
    if picked is not None and picked.batch == 0:  # a worker running no request has no rate to size by
        why = ("its memory does not hold the weights and one request of the mean length" if picked.limit == "memory" else
               "not one sequence's decode step meets the ATGT target")
        raise SpecError("--gpus-per-worker", SpecError.OPTION, "a degree whose worker runs at least one request: "
                        + (", ".join(str(o.gpus) for o in opts if o.batch > 0) or "none here")
                        + f" ({args.gpus_per_worker} GPU(s): {why})", args.gpus_per_worker)
    colocated = args.mode == "colocated"
    try:
        chosen = picked or config.best_worker_config(cluster, model, slo, mi, mo, gpu_name=gpu)
    except InfeasibleError as exc:
        chosen, infeasible = None, exc  # raised after the table, which shows why no degree serves
    fluids = {r: workers.fluid_workers(r, chosen, mi, mo, colocated=colocated) for r in rates} if chosen else {}
    if args.method == "sim":
        _check_resolvable(args, fluids)  # every rate, before the first table and the first simulation
    for line in warnings:
        print(line, file=sys.stderr)
    if fit.note:  # the means below are of these: say why they differ from the trace's
        console.print(f"note: {fit.note}", highlight=False)
    source = _source(cluster, model, gpu)
    t = Table(title=f"worker configuration: {model.name} on {gpu} (Eq. 6; mean in {mi:.0f}, out {mo:.0f})",
              caption=f"estimates of the {source}")
    for col in ("GPUs/worker", "feasible", "limit", "KV tokens", "batch", "iteration ms", "tok/s/GPU", "TTFT ms"):
        t.add_column(col, justify="right")
    for o in opts:
        t.add_row(str(o.gpus), "yes" if o.feasible else "no", o.limit, f"{o.kv_capacity_tokens:,.0f}", str(o.batch),
                  f"{o.iteration_s * 1e3:.1f}", f"{o.tokens_per_s_per_gpu:,.0f}", f"{o.ttft_s * 1e3:.0f}")
    console.print(t)
    if chosen is None:
        raise infeasible
    g = chosen.gpus
    console.print(f"[bold]{g} GPU(s) per worker[/] ({chosen.tokens_per_s_per_gpu:,.0f} output tokens/s per GPU)")

    rows, shorts = [], []
    rate_one = workers.worker_request_rate(chosen, mi, mo, colocated=colocated)  # one worker's most
    for r in rates:
        fluid = fluids[r]
        if args.method == "sim":
            from hetserve.capacity.simulated import short_trace, workers_needed

            wl = servable(load_workload(args.workload, rate=r, seed=args.seed), model, args.workload,
                          "sized").workload.head(args.requests)
            pre = max(1, fluid // 2) if args.mode == "decode" else 0
            n = workers_needed(model, gpu, wl, slo, args.placement, g, args.mode, args.target, prefill_workers=pre,
                               intra=intra, hint=fluid, per_machine=max(4, g))
            short = short_trace(r, n, fluid, rate_one, slo.ttft_s, len(wl))
            if short:
                # Fewer workers than the fluid bound cannot keep up with the rate: the simulation said so
                # only because its trace ended before the queue showed. Its count is known to be too low,
                # and the bound is the least that could serve, so the answer given (and fitted) is the
                # bound, marked, with a warning that the bound is a floor and how long a trace would tell.
                shorts.append((r, short))
                n = fluid
        else:
            n = fluid
        rows.append((r, n, fluid))
    slos = f"TTFT {slo.ttft_s}s, ATGT {slo.tpot_s}s"
    t = Table(title=f"workers meeting {args.target:.0%} of the SLOs ({slos}), placement {args.placement}"
              if args.method == "sim" else f"fewest workers the rates could need ({slos}): fluid lower bound",
              caption=("simulated" if args.method == "sim" else "the fluid lower bound") + f", times from the {source}")
    for col in ("rate req/s", "workers", "GPUs", "fluid lower bound"):
        t.add_column(col, justify="right")
    raised = dict(shorts)
    for r, n, fluid in rows:
        mark = "*" if r in raised else ""
        t.add_row(f"{r:g}", f"{n}{mark}", f"{n * g}{mark}", str(fluid))
    console.print(t)
    for r, short in shorts:
        print(f"warning: * at {r:g} req/s the simulation found {short.simulated} worker(s), below the fluid lower "
              f"bound of {short.bound}: its {short.requests} requests ({short.span_s:.3g}s of arrivals) end before "
              f"the queue of {short.simulated} worker(s) grows past the {slo.ttft_s:g}s TTFT target (about "
              f"{short.show_s:.3g}s); shown raised to the bound, which is a floor, not a sizing: rerun with "
              f"--requests {short.requests_needed} or more", file=sys.stderr)
    if len(rows) >= 2:
        try:
            law = workers.fit_worker_law([r for r, _, _ in rows], [n for _, n, _ in rows])
        except workers.DegenerateLaw as exc:
            console.print(f"no worker law N_w = ceil(k5 * r + c5): {exc}", highlight=False)
            if args.heartbeat:  # the scaling follows the law: without one there is nothing to scale by
                raise SpecError("--heartbeat", "rates", "rates whose worker counts differ, to fit the worker law "
                                "the scaling follows", args.rates) from exc
            return 0
        console.print(f"N_w = ceil({_tidy(law.k5):.4g} * r {_tidy(law.c5):+.3f})  (R² {law.r2:.3f}, "
                      f"max error {law.max_abs_error} worker(s))")
        if args.heartbeat:
            plan = plan_scaling(base.with_rate(max(rates), source=args.workload, option="--rates"), law, args.heartbeat,
                                g)
            console.print(f"scaling every {args.heartbeat:g}s over the trace at mean {max(rates):g} req/s: "
                          f"{plan.gpu_hours:.2f} GPU-hours vs {plan.static_gpu_hours:.2f} for the peak "
                          f"({plan.peak_workers} workers) all along")
    return 0


def _check_resolvable(args, fluids: dict[float, int]) -> None:
    """Refuses the first rate whose fluid lower bound exceeds the requests simulated: a simulation
    of N requests cannot tell apart more than N workers, so its answer there would be noise."""
    for r, fluid in fluids.items():
        if fluid > args.requests:
            top = r * args.requests / fluid
            raise SpecError("--rate" if args.rate is not None else "--rates", SpecError.OPTION,
                            f"rates the {args.requests} simulated requests can resolve (about {top:.3g} req/s or "
                            f"less here: at {r:g} req/s the fluid lower bound is {fluid:,} workers; raise --requests "
                            f"or use --method fluid)", r)


def _source(cluster, model, gpu: str) -> str:
    """Where the worker sizes' times come from: the cost model, and how it prices the GPU type
    sized (``gpu``; a cluster's other types price nothing here)."""
    from hetserve.cost.analytic import CostModel
    from hetserve.cost.kernel_pricing import describe_pricing

    sized = [d.index for d in cluster.devices if d.gpu.name == gpu]
    return "cost model, " + describe_pricing(CostModel(cluster, model).pricing(sized))


def _tidy(x: float) -> float:
    """A fitted coefficient with least-squares round-off (|x| < 1e-9, and -0.0) printed as 0."""
    return 0.0 if abs(x) < 1e-9 else x
