"""``hetserve simulate``: play a workload against a plan and report latency, throughput and cost.

    hetserve simulate --plan plan.json --workload azure-conv [--cluster hexgen2-het1]
        [--workload-class HPLD] [--rate-scale 2 | --rate 5] [--placement eft] [--transmission fair]
        [--slo-ttft 1 --slo-tpot 0.1 --slo-e2e 60] [--gamma 0.5 --theta 1] [-n 2000] [-o out/]

The cluster defaults to the cluster file the plan records, else the preset named in the plan. Writes summary.json
(with ``timings``: where its times come from), requests.csv and latency_cdf.png under ``-o`` (and
rate_sweep.png and rate_sweep.json with ``--sweep-rates``; an earlier run's, without it, are removed); prints a
table either way.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from hetserve.cli.commands.serve import check_chunk_tokens, chunk_tokens_of
from hetserve.cli.policy_options import add_policy_options, route_of, transmission_of
from hetserve.policies.batching import DEFAULT_BATCHING, PREFILL_MODES, token_budget_rule


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("simulate", help="simulate a plan under a workload trace",
                       description="Discrete-event simulation of a deployment plan under a request trace.")
    p.add_argument("--plan", required=True, help="plan file (JSON or YAML)")
    p.add_argument("--cluster", help="cluster preset or file (default: the cluster file the plan was made on, "
                   "else the plan's cluster name as a preset)")
    p.add_argument("--model", help="model preset or config.json (default: the plan's model)")
    p.add_argument("--workload", required=True, help="workload preset (azure-conv, sharegpt) or CSV file")
    p.add_argument("--workload-class", choices=["HPLD", "HPHD", "LPHD", "LPLD"],
                   help="only requests of one HexGen-2 class")
    rate = p.add_mutually_exclusive_group()
    rate.add_argument("--rate-scale", type=float, help="multiply the arrival rate (compress time)")
    rate.add_argument("--rate", type=float, help="mean arrival rate, req/s")
    add_policy_options(p)  # under --pipeline aggregate only KV hand-offs cross the links (Workload.with_rate)
    p.add_argument("--gamma", type=float, help="aladdin: strictness knob γ in [0, 1] (default 0.5)")
    p.add_argument("--theta", type=float, help="aladdin: safety factor θ in (0, 1] (default 1)")
    p.add_argument("--slo-ttft", type=float, help="TTFT target, seconds")
    p.add_argument("--slo-tpot", type=float, help="TPOT / ATGT target, seconds per token")
    p.add_argument("--slo-e2e", type=float, help="end-to-end latency target, seconds")
    p.add_argument("-n", "--num-requests", "--limit", dest="limit", type=int, metavar="N",
                   help="only the first N requests (as compare's -n; --limit: the older spelling)")
    p.add_argument("--token-budget", type=int, default=DEFAULT_BATCHING.token_budget,
                   help=f"tokens per step, decode + prompt (default {DEFAULT_BATCHING.token_budget}, as the runtime)")
    p.add_argument("--chunked-prefill", action="store_true", help="the same as --prefill-mode chunked")
    p.add_argument("--prefill-mode", choices=PREFILL_MODES,
                   help="colocated replicas, as `serve --prefill-mode`: whole prompts ride in the decode step "
                        f"(mixed, default), prompts feed chunks of at most {DEFAULT_BATCHING.chunk_tokens} "
                        "tokens per step, decodes included (chunked), or, a what-if the engine does not run, "
                        "a prompts-only step pauses decoding (prefill_first, vLLM v0)")
    p.add_argument("--chunk-tokens", type=int,
                   help=f"prompt tokens per step with --prefill-mode chunked, as `serve --chunk-tokens` "
                        f"(default {DEFAULT_BATCHING.chunk_tokens})")
    p.add_argument("--max-batch", type=int, help="running requests per decode replica (default: the cost "
                   "model's, 256)")
    p.add_argument("--micro-batches", type=int, help="pipeline micro-batches (default: one per stage)")
    p.add_argument("--pipeline", choices=["aggregate", "detailed"], default="aggregate",
                   help="detailed: decode and colocated replicas of several stages simulated stage by stage, "
                        "activations on the links (slower; refused for a plan with no such replica)")
    p.add_argument("--kv-admission", choices=["reserve", "paged"], default="reserve",
                   help="decode KV: reserve prompt + whole output at admission (default), or paged "
                        "growth with recompute pre-emption (vLLM)")
    p.add_argument("--predictor", choices=["oracle", "bucket"], default="oracle",
                   help="output-length prediction for placement (default: the true length)")
    p.add_argument("--sweep-rates", metavar="R1,R2,...",
                   help="also simulate the trace at these mean rates (req/s); with -o, plot throughput and "
                        "SLO attainment (with no --slo-*: the share completed) against rate (rate_sweep.png; the "
                        "figures in rate_sweep.json)")
    p.add_argument("--efficiency", help="cost-model efficiency JSON (from `hetserve calibrate -o`; its measured "
                   "request overhead, HTTP + tokenisation + SSE, is added to every request too)")
    ctx = p.add_mutually_exclusive_group()
    ctx.add_argument("--within-context", action="store_true",
                     help="drop requests whose prompt + output exceed the model's context from the trace (default: "
                          "reject them at arrival, as a server does, and count them as rejected)")
    ctx.add_argument("--run-beyond-context", action="store_true",
                     help="simulate requests beyond the model's context as given, as a longer-context model would "
                          "serve them (a server rejects them; KV that fits no replica is rejected still)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-o", "--output", help="directory for summary.json, requests.csv and plots (an earlier run's "
                   "rate_sweep.png / .json that this run does not write are removed, and said so)")
    p.add_argument("--json", action="store_true", help="print the summary JSON instead of a table")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from hetserve.errors import PlanError, SpecError
    from hetserve.cost.analytic import CostModel
    from hetserve.planner.plan import Plan
    from hetserve.sim import SimOptions, simulate
    from hetserve.sim.option_checks import idle_plan_option, pipelined_replicas, transmission_note
    from hetserve.specs.model import load_model
    from hetserve.specs.workload import SLO, load_workload

    from hetserve.cli.model_dir import check_plan, plan_cluster, plan_model
    from hetserve.cli.replica_tables import gpus_text, stages_text
    from hetserve.output_path import check_output_folder

    rates = _parse_rates(args.sweep_rates) if args.sweep_rates is not None else []
    prefill_mode = _prefill_mode(args)
    if args.output:
        check_output_folder(args.output, "--output")  # before the simulation, not after it
    from hetserve.cli.bounds import check_micro_batches
    plan = Plan.load(args.plan)
    check_micro_batches(args.micro_batches, plan, args.plan)
    cluster = plan_cluster(args.plan, plan, args.cluster)
    model = load_model(args.model) if args.model else plan_model(args.plan, plan.model)
    # the plan against its pool and model, and the calibration file, before the trace is read
    check_plan(args.plan, plan, cluster, model)
    from hetserve.calibration.file import foreign_calibration, served_efficiency, served_sim_options

    try:
        efficiency = served_efficiency(args.efficiency) if args.efficiency else None
        served = served_sim_options(args.efficiency)
    except ValueError as exc:
        if isinstance(exc, SpecError):
            raise
        raise SpecError(args.efficiency, "(file)", "a calibration file (hetserve calibrate -o)", str(exc)) from exc
    cost = CostModel(cluster, model, efficiency)
    rule = token_budget_rule(args.token_budget, args.max_batch or cost.eff.max_batch,
                             "--max-batch" if args.max_batch else "the cost model's batch cap (--max-batch)",
                             "--prefill-mode chunked --chunk-tokens")
    if rule is not None:
        raise SpecError("--token-budget", SpecError.OPTION, rule, args.token_budget)
    wl = load_workload(args.workload, seed=args.seed)
    if args.workload_class:
        wl = wl.of_class(args.workload_class)
    if args.limit is not None:  # positive: cli/bounds.py
        wl = wl.head(args.limit)
    # a rate the trace's arrivals cannot take is refused here, not ignored (sim/option_checks.py)
    if args.rate_scale is not None:
        wl = wl.scale_rate(args.rate_scale, source=args.workload)
    elif args.rate is not None:
        wl = wl.with_rate(args.rate, source=args.workload)
    # warnings and notes wait until every option is checked: a refusal comes before any other word
    notices: list[str] = []
    # as plan warns: another GPU type's calibration times the plan's GPUs by factors measured elsewhere
    if args.efficiency and (foreign := foreign_calibration(args.efficiency, map(cluster.device, plan.devices))):
        notices.append(f"warning: {foreign}")
    over = int(((wl.input_tokens + wl.output_tokens) > model.max_context).sum()) if len(wl) else 0
    dropped = f"{over} of {len(wl)}"
    if over and args.within_context:
        wl = wl.within_context(model.max_context)
    elif over:
        worst = int((wl.input_tokens + wl.output_tokens).max())
        fate = ("simulated as given (a server rejects them)" if args.run_beyond_context else
                "rejected at arrival as a server rejects them, counted as rejected — --within-context drops them "
                "from the trace, --run-beyond-context simulates them as given")
        notices.append(f"warning: {over} of {len(wl)} requests of {args.workload} exceed {model.name}'s context "
                       f"of {model.max_context} tokens (prompt + output; the longest has {worst}): {fate}")
    if len(wl) == 0:
        kept_by = [f for f, on in (("--workload-class " + str(args.workload_class), args.workload_class),
                                   ("--within-context", args.within_context)) if on]
        raise SpecError(args.workload, "(requests)", "at least one request after " + " and ".join(kept_by or
                                                                                              ["filtering"]), "none")
    if over and args.within_context:
        notices.append(f"note: --within-context dropped {dropped} requests of {args.workload}, which exceed "
                       f"{model.name}'s context of {model.max_context} tokens (prompt + output)")
    if rates:
        wl.with_rate(rates[0], source=args.workload, option="--sweep-rates")  # before the first simulation, not after it
    try:
        slo = SLO(args.slo_ttft, args.slo_tpot, args.slo_e2e)
    except ValueError as exc:
        raise SpecError("--slo-*", SpecError.OPTION, "positive seconds", str(exc)) from exc
    policy_options = {k: getattr(args, k) for k in ("gamma", "theta") if getattr(args, k) is not None}
    if policy_options and "aladdin" not in (args.placement, route_of(args)):
        raise SpecError("--gamma/--theta", SpecError.OPTION, "--placement aladdin or --route aladdin", args.placement)
    colocated_only = (["--chunked-prefill"] if args.chunked_prefill else []) + (
        [f"--prefill-mode {args.prefill_mode}"] if args.prefill_mode not in (None, DEFAULT_BATCHING.prefill_mode)
        else []) + ([f"--chunk-tokens {args.chunk_tokens}"] if args.chunk_tokens is not None else [])
    idle = idle_plan_option(plan, args.plan, route=args.route, colocated_only=colocated_only)
    if idle is not None:
        raise PlanError(idle)
    if args.predictor != "oracle" and args.placement == "rr":  # round robin reads no prediction
        raise SpecError("--predictor", SpecError.OPTION, "a placement that reads predicted output lengths (every one "
                        "but rr); drop --predictor", f"--predictor {args.predictor} with --placement rr")
    if args.pipeline == "detailed":
        _refuse_detailed(args, plan, wl, pipelined_replicas(plan))
    if args.transmission is not None:
        note = transmission_note(plan, args.plan, args.transmission, args.pipeline)
        if note is not None and note[0] == "error":
            raise PlanError(note[1])  # one line naming both options and what to do instead
        if note is not None:
            notices.append(f"warning: {note[1]}")
    predictor = None
    if args.predictor == "bucket":
        from hetserve.policies.predictor import BucketMeanPredictor
        predictor = BucketMeanPredictor()
    try:
        opts = SimOptions(placement=args.placement, route=route_of(args), transmission=transmission_of(args), slo=slo,
                          **served, predictor=predictor,
                          token_budget=args.token_budget,
                          chunked_prefill=prefill_mode == "chunked", prefill_mode=prefill_mode,
                          chunk_tokens=chunk_tokens_of(args),
                          max_batch=args.max_batch, micro_batches=args.micro_batches, pipeline=args.pipeline,
                          kv_admission=args.kv_admission,
                          beyond_context="run" if args.run_beyond_context else "reject",
                          seed=args.seed, policy_options=policy_options,
                          progress=not args.no_progress and not args.json)
        for line in notices:
            print(line, file=sys.stderr)
        result = simulate(plan, cluster, model, wl, opts, cost=cost)
    except ValueError as exc:
        if isinstance(exc, (PlanError, SpecError)):
            raise
        raise SpecError("simulate", SpecError.OPTION, "options the simulator takes", str(exc)) from exc
    from hetserve.calibration.file import timings_source

    summary = result.summary()
    # where the figures' times come from, as the table's caption says it (and a plan's estimate.pricing)
    pricing = result.info["pricing"]  # the plan's GPU types only: a type it leaves unused times nothing
    summary["timings"] = {"source": timings_source(args.efficiency, pricing), "calibration": args.efficiency,
                          "pricing": pricing}
    if args.output:
        _remove_stale(Path(args.output), rates)
        result.save(args.output, summary=summary)
    if args.json and rates:  # one JSON document: the run and the sweep's runs
        print(json.dumps({"summary": summary, "rate_sweep": [{"rate": r["rate"], "summary": r["summary"]}
                                                             for r in _sweep(args, rates, plan, cluster, model, wl,
                                                                             opts, cost, summary["timings"],
                                                                             quiet=True)]}, indent=2))
        return 0
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print_summary(Console(), summary, f"{plan.algorithm} plan on {cluster.name}, {wl.name} ({len(wl)} requests)",
                      f"simulated; times from the {summary['timings']['source']}",
                      {r.id: f"{gpus_text(r, cluster)}, {stages_text(r)}" for r in plan.replicas})
        if args.output:
            Console().print(f"wrote {Path(args.output) / 'summary.json'}, requests.csv, latency_cdf.png")
    if rates:
        _sweep(args, rates, plan, cluster, model, wl, opts, cost, summary["timings"])
    return 0


# the files simulate writes under -o only with --sweep-rates (summary.json, requests.csv and
# latency_cdf.png every run writes): the sweep's plot, and its figures as --json prints them
SWEEP_PLOT, SWEEP_JSON = "rate_sweep.png", "rate_sweep.json"


def _remove_stale(out: Path, rates: list[float]) -> None:
    """Remove an earlier run's sweep files from ``out`` before this run writes there: beside this
    run's summary.json they would pass for this run's. Said where this run writes none (no --sweep-rates);
    with a sweep they go too, so a sweep that fails leaves no earlier run's files. An earlier run's
    summary.json (and its files) is replaced, and said so."""
    old = [out / name for name in (SWEEP_PLOT, SWEEP_JSON) if (out / name).is_file()]
    for path in old:
        path.unlink()
    if old and not rates:
        print(f"note: removed {' and '.join(map(str, old))}, an earlier run's: this run draws no rate sweep "
              "(no --sweep-rates)", file=sys.stderr)
    if (out / "summary.json").is_file():
        print(f"note: replacing an earlier run's summary.json, requests.csv and latency_cdf.png in {out}",
              file=sys.stderr)


def _prefill_mode(args) -> str:
    """The one prefill mode the options name (``--chunked-prefill`` is ``--prefill-mode chunked``),
    refused before any work starts where two disagree or ``--chunk-tokens`` has no chunks to size."""
    from hetserve.errors import SpecError

    if args.chunked_prefill and args.prefill_mode not in (None, "chunked"):  # one would be dropped
        raise SpecError("--chunked-prefill", SpecError.OPTION, "one prefill mode (--chunked-prefill is "
                        "--prefill-mode chunked)", f"--prefill-mode {args.prefill_mode} beside it")
    mode = "chunked" if args.chunked_prefill else args.prefill_mode or DEFAULT_BATCHING.prefill_mode
    check_chunk_tokens(args, mode)
    return mode


def _refuse_detailed(args, plan, wl, pipelined: list[str]) -> None:
    """``--pipeline detailed`` where it cannot act as asked, refused in one line naming the options
    (and the trace) before the simulation starts: a plan with no pipelined decode or colocated replica
    (it would run as aggregate), paged KV (modelled on aggregate pipelines only), or a trace with n > 1
    choices or prompt logprobs (the stage-by-stage pipeline prices neither)."""
    from hetserve.errors import PlanError, SpecError
    from hetserve.sim.option_checks import DETAILED_PRICES_NEITHER, PAGED_IS_AGGREGATE, detailed_unpriced

    if not pipelined:  # as --transmission: refused, not ignored
        raise PlanError(f"--pipeline detailed simulates decode and colocated replicas of several stages stage by "
                        f"stage: {args.plan} has none (prefill replicas stay aggregate in both modes), so it would "
                        f"run as --pipeline aggregate; drop --pipeline")
    if args.kv_admission == "paged":
        raise SpecError("--kv-admission", SpecError.OPTION, f"--pipeline aggregate beside paged KV "
                        f"({PAGED_IS_AGGREGATE}); drop one", "paged with --pipeline detailed")
    many, scored = detailed_unpriced(wl)
    if many or scored:
        raise SpecError(args.workload, "n/prompt_logprobs", f"plain completions under --pipeline detailed "
                        f"({DETAILED_PRICES_NEITHER}); drop --pipeline detailed",
                        f"{many} requests with n > 1, {scored} scoring their prompt")


def _parse_rates(text: str) -> list[float]:
    from hetserve.errors import SpecError

    try:
        rates = [float(r) for r in text.split(",")]  # an empty entry is a typo, not a rate to skip
    except ValueError as exc:
        raise SpecError("--sweep-rates", SpecError.OPTION, "comma-separated rates in req/s", text) from exc
    if not rates or not all(math.isfinite(r) and r > 0 for r in rates):
        raise SpecError("--sweep-rates", SpecError.OPTION, "positive rates in req/s", text)
    return rates


NO_SLO = "n/a (no --slo-*)"
NO_LATENCY = "no request completed (every one rejected): no latency"
# what each rejection reason (policies.request_checks) means, for the printed table
REJECTED_WHY = {"context": "beyond the model's context", "kv": "KV fits no replica", "empty": "empty prompt",
                "vocabulary": "outside the vocabulary"}


def _fig(v: float | None, fmt: str) -> str:
    """A summary figure, or "–" where no request has it (the summary's null)."""
    return "–" if v is None else format(v, fmt)


def _sweep(args, rates, plan, cluster, model, wl, opts, cost, timings: dict, quiet: bool = False) -> list[dict]:
    """The same trace at several mean rates: its rows, a table (unless ``quiet``), and with -o a plot
    and the rows as JSON; ``timings`` (the run's summary's): where their times come from."""
    from dataclasses import replace
    from pathlib import Path

    from rich.console import Console
    from rich.table import Table

    from hetserve.sim.plots import has_slo
    from hetserve.sim.sweep import rate_sweep

    plot = Path(args.output) / SWEEP_PLOT if args.output else None
    caption = f"simulated; times from the {timings['source']}"
    rows = rate_sweep(plan, cluster, model, wl, rates, replace(opts, progress=False), cost, plot=plot,
                      source=args.workload, plot_title=f"rate sweep, {caption}")
    if args.output:  # the figures the plot draws, as numbers (the table shows a few of them)
        (Path(args.output) / SWEEP_JSON).write_text(json.dumps(
            {"timings": timings, "rate_sweep": [{"rate": r["rate"], "summary": r["summary"]} for r in rows]},
            indent=2))
    if quiet:
        return rows
    t = Table("rate req/s", "output tokens/s", "SLO attainment", "goodput req/s", "TTFT p90 s", "TPOT p90 s",
              title="rate sweep", caption=caption, caption_justify="left")
    for r in rows:
        s = r["summary"]
        slo = has_slo(s)
        t.add_row(f"{r['rate']:g}", f"{s['throughput_tokens_per_s']:.1f}",
                  f"{s['slo_attainment']:.3f}" if slo else NO_SLO,
                  f"{s['goodput_requests_per_s']:.3f}" if slo else NO_SLO,
                  _fig(s["ttft_s"]["p90"], ".3g"), _fig(s["tpot_s"]["p90"], ".3g"))
    Console().print(t)
    if plot is not None:
        Console().print(f"wrote {plot}, {SWEEP_JSON}")
    return rows


def print_summary(console, s: dict, title: str, source: str | None = None, kinds: dict[str, str] | None = None) -> None:
    """The summary as two rich tables: latencies, then throughput / SLO / cost and replicas;
    ``source`` (under the latencies): where the times come from; ``kinds``: each replica's GPUs and
    stages, by which a fleet's replicas are grouped (cli/replica_tables.py)."""
    from rich.table import Table

    from hetserve.cli.replica_tables import sim_replica_table

    from hetserve.sim.plots import has_slo

    # with no request completed there is no latency to show (the summary's figures are null)
    done = s["completed"] > 0
    caption = source if done else f"{NO_LATENCY}" + (f"; {source}" if source else "")
    lat = Table(title=title, title_justify="left", caption=caption, caption_justify="left")
    lat.add_column("latency (s)")
    for k in ("mean", "p50", "p90", "p99"):
        lat.add_column(k, justify="right")
    for key, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("atgt_s", "ATGT"), ("e2e_s", "E2E"),
                       ("queue_s", "queue"), ("kv_transfer_s", "KV transfer")):
        # a figure no request has (none completed, no KV hand-off, one-token outputs only) is null
        lat.add_row(label, *(_fig(s[key][k], ".4g") for k in ("mean", "p50", "p90", "p99")))
    console.print(lat)
    tot = Table(show_header=False)
    tot.add_column()
    tot.add_column(justify="right")
    usd = s.get("usd_per_million_output_tokens")
    rejected = s.get("rejected", 0)
    why = ", ".join(f"{v} {REJECTED_WHY.get(k, k)}" for k, v in (s.get("rejected_by") or {}).items())
    for label, val in (("requests completed", f"{s['completed']} / {s['requests']}"),
                       ("requests rejected", f"{rejected}" + (f" ({why})" if why else "")),
                       ("duration", f"{s['duration_s']:.1f} s"),
                       ("output tokens/s", f"{s['throughput_tokens_per_s']:.1f}"),
                       ("SLO attainment", f"{s['slo_attainment']:.3f}" if has_slo(s) else NO_SLO),
                       ("goodput", f"{s['goodput_requests_per_s']:.3f} req/s" if has_slo(s) else NO_SLO),
                       ("GPU-hours", f"{s['gpu_hours']:.3f}"),
                       ("$ per million output tokens", f"{usd:.2f}" if usd is not None else "n/a"),
                       ("simulated in", f"{s['run']['wall_s']:.2f} s ({s['run']['events']} events)")):
        tot.add_row(label, val)
    console.print(tot)
    console.print(sim_replica_table(s["replicas"], kinds))
