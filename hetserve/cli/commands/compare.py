"""``hetserve compare``: replay a trace against the live server and the simulator; served vs simulated."""

from __future__ import annotations

import argparse

from hetserve.cli.policy_options import add_policy_options, route_of
from hetserve.calibration.speed_probe import SPEED_WEIGHT

from hetserve.cli.commands.serve import add_prefill_mode_options, check_chunk_tokens, chunk_tokens_of


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="served vs simulated for the same plan and requests",
                       description="Serve the plan, replay a slice of a trace through the openai client, simulate "
                                   "the same requests with the same policies and batching, and print served vs "
                                   "simulated TTFT/TPOT/E2E (mean, p50, p90, p99) and throughput.")
    p.add_argument("--plan", required=True, help="plan file (JSON or YAML)")
    p.add_argument("--model", required=True, help="checkpoint folder (see `hetserve make-model`)")
    p.add_argument("--cluster", help="cluster preset or file (default: the cluster file the plan was made on, "
                   "else the plan's cluster name as a preset)")
    p.add_argument("--workload", default="azure-conv", help="workload preset or CSV (default azure-conv)")
    p.add_argument("--workload-class", choices=["HPLD", "HPHD", "LPHD", "LPLD"], help="only one HexGen-2 class")
    p.add_argument("--rate", type=float, help="request rate, requests/s (default: the trace's)")
    p.add_argument("-n", "--num-requests", "--limit", dest="num_requests", type=int, default=24, metavar="N",
                   help="requests to replay (default 24; --limit: simulate's older spelling)")
    p.add_argument("--max-input", type=int, default=256, help="cap on prompt tokens (default 256)")
    p.add_argument("--max-output", type=int, default=32, help="cap on output tokens (default 32)")
    p.add_argument("--efficiency", help="calibration file (hetserve calibrate -o) for the simulator's cost model")
    add_policy_options(p, transmission=False, both_sides=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-speed-correction", dest="speed_correction", action="store_false",
                   help="price the simulation at the calibration's machine speed (default: read the machine's speed "
                        "probe before and after serving and scale the calibrated times by its ratio to the "
                        "calibration's reading; a shared VM's speed drifts by tens of percent within minutes; a calibration "
                        "whose engine ran on a GPU is always taken as calibrated: the probe times the CPU)")
    p.add_argument("--speed-weight", type=float, default=SPEED_WEIGHT, metavar="W",
                   help="how much of the speed probe's ratio the simulated times take, as a power: 1 all of it, "
                        "0 none (default %(default)s: the part of it that follows the served workers' speed, "
                        "docs/cost-model.md)")
    p.add_argument("--serve-twice", action="store_true",
                   help="replay the same requests a second time on the same server and print the second run "
                        "against the first beside the simulation: how far two served runs lie apart")
    add_prefill_mode_options(p)
    p.add_argument("-o", "--output", help="folder for compare.json and compare_cdf.png")
    p.add_argument("--quiet", action="store_true", help="no progress bar (none off a terminal either)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from hetserve.calibration.compare import CompareOptions, compare
    from hetserve.calibration.compare_report import print_table
    from hetserve.errors import RuntimeFailure
    from hetserve.planner.plan import Plan

    from hetserve.cli.model_dir import check_model_dir, plan_cluster
    from hetserve.cli.progress import phase_progress, stop_on_sigterm
    from hetserve.output_path import check_output_folder

    if args.output:
        check_output_folder(args.output, "--output")  # before serving, not after it
    from hetserve.errors import SpecError

    check_chunk_tokens(args, args.prefill_mode)
    if args.speed_weight != SPEED_WEIGHT and not args.speed_correction:
        raise SpecError("--speed-weight", SpecError.OPTION, "the speed correction it weighs; drop --speed-weight or "
                        "--no-speed-correction", args.speed_weight)
    plan = Plan.load(args.plan)  # input errors first, in one line
    check_model_dir(args.model)  # a folder, never a hub name looked up online
    cluster = plan_cluster(args.plan, plan, args.cluster)  # the cluster file the plan was made on, as serve
    if args.efficiency:
        import sys

        from hetserve.calibration.file import calibration_warnings
        from hetserve.cost.efficiency import load_efficiency
        from hetserve.specs.model import load_model

        load_efficiency(args.efficiency)
        # as plan and simulate warn, before the minutes of serving (compare.json keeps them too)
        for warning in calibration_warnings(args.efficiency, map(cluster.device, plan.devices), load_model(args.model)):
            print(f"warning: {warning}", file=sys.stderr)
    console = Console()
    try:
        with stop_on_sigterm(), phase_progress(console, args.quiet) as progress:
            c = compare(CompareOptions(plan=args.plan, model_dir=args.model, cluster=cluster, workload=args.workload,
                                       workload_class=args.workload_class, rate=args.rate,
                                       num_requests=args.num_requests, max_input=args.max_input,
                                       max_output=args.max_output, efficiency=args.efficiency, placement=args.placement,
                                       route=route_of(args), seed=args.seed, prefill_mode=args.prefill_mode,
                                       chunk_tokens=chunk_tokens_of(args), kv_admission=args.kv_admission,
                                       speed_correction=args.speed_correction, speed_weight=args.speed_weight,
                                       serve_twice=args.serve_twice, progress=progress))
    except RuntimeError as exc:
        raise RuntimeFailure(str(exc)) from exc
    print_table(c, console)
    if args.output:
        for path in c.save(args.output):
            console.print(f"wrote {path}")
    return 0
