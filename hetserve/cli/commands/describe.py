"""``hetserve describe cluster|model|workload NAME`` and ``describe plan FILE``: a readable summary of
one input, or of a plan file someone handed you (the table ``hetserve plan`` printed, and whether the
plan still fits its cluster and model)."""

from __future__ import annotations

import argparse
from collections import Counter

import numpy as np
from rich.console import Console
from rich.table import Table

from hetserve.errors import HetserveError, PlanError, SpecError
from hetserve.cli.cluster_report import describe_cluster
from hetserve.specs.cluster import Cluster, cluster_presets, load_cluster
from hetserve.specs.gpus import fmt_gb
from hetserve.specs.model import ModelSpec, load_model, model_presets
from hetserve.specs.workload import CLASSES, Workload, load_workload, workload_presets


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("describe", help="summarise a cluster, model, workload or plan file",
                       description="Print a summary of a cluster, model or workload (preset name or file), "
                                   "or of a plan file (from `hetserve plan -o`).")
    p.add_argument("kind", choices=["cluster", "model", "workload", "plan"])
    p.add_argument("name", nargs="?", help="preset name or file; omit to list the presets (plan: a plan file)")
    p.add_argument("--rate", type=float, help="workload: rescale arrivals to this mean rate (req/s)")
    p.add_argument("--cluster", help="plan: check it against this cluster (default: the cluster file the plan was "
                   "made on, else the preset it names)")
    p.add_argument("--model", help="plan: check it against this model (default: the one the plan names)")
    p.set_defaults(func=run)


# the options each kind acts on: another kind's option is refused, never dropped unseen
_OPTIONS = {"--rate": ("rate", ("workload",), "a workload's arrival rate"),
            "--cluster": ("cluster", ("plan",), "the cluster a plan file is checked against"),
            "--model": ("model", ("plan",), "the model a plan file is checked against")}


def _refuse_idle_options(args: argparse.Namespace) -> None:
    for option, (attr, kinds, what) in _OPTIONS.items():
        value = getattr(args, attr)
        if value is None:
            continue
        if args.kind not in kinds:
            raise SpecError(option, SpecError.OPTION, f"describe {' / '.join(kinds)} beside it (it sets {what}); "
                            f"drop {option}", f"{value} with describe {args.kind}")
        if args.name is None:  # listing the presets: nothing for it to act on either
            raise SpecError(option, SpecError.OPTION, f"a {args.kind} to describe beside it (without one, describe "
                            f"lists the presets); drop {option} or name the {args.kind}", value)


def run(args: argparse.Namespace) -> int:
    console = Console()
    _refuse_idle_options(args)
    if args.kind == "plan":
        return describe_plan(args, console)
    if args.name is None:
        presets = {"cluster": cluster_presets, "model": model_presets, "workload": workload_presets}[args.kind]()
        console.print(f"{args.kind} presets: " + ", ".join(presets))
        return 0
    if args.kind == "cluster":
        describe_cluster(load_cluster(args.name), console)
    elif args.kind == "model":
        describe_model(load_model(args.name), console)
    else:
        w = load_workload(args.name, rate=args.rate)
        if args.rate is not None:
            w.with_rate(args.rate, source=args.name)  # arrivals at one instant take no rate: say so, not ignore it
        describe_workload(w, console, rate_given=args.rate is not None)
    return 0


def describe_model(m: ModelSpec, console: Console) -> None:
    t = Table(title=f"model {m.name} ({m.arch})", show_header=False)
    rows = [
        ("parameters", (f"{m.num_params / 1e9:,.2f} B" if m.num_params >= 1e8 else f"{m.num_params / 1e6:,.3g} M")
         + f" ({m.num_params:,})"),
        ("dtype", f"{m.dtype} ({m.dtype_from})" if m.dtype else
         f"float16 / bfloat16 (the preset's: {m.dtype_bytes} bytes per parameter)"),
        ("weights", fmt_gb(m.weight_bytes)),
        ("layers", str(m.num_layers)),
        ("hidden / FFN", f"{m.hidden} / {m.ffn_hidden} ({'gated, 3 matrices' if m.gated_ffn else '2 matrices'})"),
        ("heads / KV heads / head dim", f"{m.num_heads} / {m.num_kv_heads} / {m.dim_head}"
         + (" (GQA)" if m.num_kv_heads < m.num_heads else "")),
        ("vocab / max context", f"{m.vocab} / {m.max_context}"),
        ("bytes per layer", f"{m.bytes_per_layer:,}"),
        ("KV cache per token", f"{m.kv_bytes_per_token:,} bytes"),
    ]
    for k, v in rows:
        t.add_row(k, v)
    console.print(t)


def fmt_rate(rate: float) -> str:
    """A rate or a span for a line of text: two decimals where they read well, else three
    significant digits (a --rate of 1e308 is not 309 digits)."""
    return f"{rate:,.2f}" if rate == 0 or 0.01 <= abs(rate) < 1e6 else f"{rate:.3g}"


def describe_workload(w: Workload, console: Console, rate_given: bool = False) -> None:
    # one request, or all at one instant, has no span and so no rate (Workload.rate's 0 is no figure)
    console.print(f"[bold]workload {w.name}[/]: {len(w):,} request{'' if len(w) == 1 else 's'}" +
                  (f" over {fmt_rate(w.duration_s)} s, mean rate {fmt_rate(w.rate)} req/s" if w.unspaced() is None
                   else ", all arriving at one instant: no arrival rate" if len(w) > 1 else ": no arrival rate"))
    if w.poisson_rate is not None:  # a length-only trace: the arrivals are drawn, not read
        console.print(f"arrivals: Poisson at {fmt_rate(w.poisson_rate)} req/s, "
                      + ("as --rate set" if rate_given else
                         "the default for a length-only trace; --rate sets it"))
    t = Table(title="token lengths")
    for col in ("", "mean", "p50", "p90", "p99", "min", "max"):
        t.add_column(col)
    for label, arr in (("input", w.input_tokens), ("output", w.output_tokens)):
        p = np.percentile(arr, [50, 90, 99])
        t.add_row(label, f"{arr.mean():.1f}", f"{p[0]:.0f}", f"{p[1]:.0f}", f"{p[2]:.0f}",
                  str(arr.min()), str(arr.max()))
    console.print(t)
    many, scored = int((w.choices > 1).sum()), int(w.prompt_logprobs.sum())
    if many or scored:  # the trace's optional columns: output above is per choice
        console.print(f"choices (column n): {many:,} request{'' if many == 1 else 's'} with n > 1 (max "
                      f"{int(w.choices.max())}, {int(w.choices.sum()):,} choices in all; output is per choice); "
                      f"{scored:,} scoring their prompt (prompt_logprobs)")
    counts = Counter(w.classes().tolist())
    console.print("classes (HexGen-2 §5.1): " + ", ".join(f"{c} {counts.get(c, 0):,}" for c in CLASSES))


def describe_plan(args: argparse.Namespace, console: Console) -> int:
    """The plan file's table (as ``hetserve plan`` printed it), then whether it still holds on its
    cluster and model: a plan travels as a file, and the presets or the pool may have changed since."""
    from hetserve.cli.plan_report import print_plan
    from hetserve.cli.model_dir import MODEL_CHECKS, MODEL_FREE_CHECKS, check_plan, check_plan_without_model, plan_model
    from hetserve.planner.plan import Plan, load_plan_cluster

    if args.name is None:
        raise PlanError("describe plan: give a plan file (written by `hetserve plan -o PLAN.json`)")
    plan = Plan.load(args.name)
    # what the user names must load (exit 2 otherwise); what only the plan names may be missing here
    cluster = load_cluster(args.cluster) if args.cluster else None
    model = load_model(args.model) if args.model else None
    print_plan(console, plan)
    if plan.estimate:
        console.print("the capacities, flows, throughput, cost and notes above are the estimate saved in the file "
                      "when it was planned, not recomputed here (`hetserve simulate --plan FILE` predicts the plan "
                      "as it is now)")
    for warning in _route_gaps(plan):
        console.print(f"[yellow]warning[/]: {warning}")
    cf = plan.cluster_file
    if cf is not None and args.cluster is None and cf.current_sha256() == cf.sha256:
        console.print(f"made on the cluster file {cf.shown} (unchanged since: SHA-256 {cf.sha256[:12]}…)")
    missing = []
    if cluster is None:
        try:
            cluster = load_plan_cluster(plan, args.name, warn=lambda msg: console.print(f"[yellow]warning[/]: {msg}"))
        except HetserveError as exc:
            missing.append(str(exc))
    if model is None:
        try:
            model = plan_model(args.name, plan.model)
        except HetserveError as exc:
            missing.append(str(exc))
    stale = _estimate_drift(plan, cluster)
    if stale:
        console.print("[yellow]warning[/]: the saved estimate no longer matches this plan (edited since it was "
                      "planned?), so its figures describe another plan: " + "; ".join(stale))
    if cluster is None:
        console.print("[yellow]not checked[/]: " + "; ".join(missing))
        return 0
    if model is None:  # what needs only the cluster is still checked: a plan's own mistakes need no model
        check_plan_without_model(args.name, plan, cluster)
        console.print(f"checked without the model: the plan fits {cluster.name} ({len(cluster)} devices): "
                      f"{MODEL_FREE_CHECKS}; [yellow]not checked[/] ({MODEL_CHECKS}): " + "; ".join(missing))
        return 0
    check_plan(args.name, plan, cluster, model)  # raises PlanError (exit 2) naming every problem
    console.print(f"checked: the plan fits {cluster.name} ({len(cluster)} devices) and {model.name} "
                  f"(devices, layers, memory, KV routes: planner/validate.py)"
                  + ("; its saved estimate does not describe it (above)" if stale else ""))
    return 0


def _route_gaps(plan) -> list[str]:
    """Replicas of a disaggregated plan that no request reaches: a decode replica no KV route feeds,
    a prefill replica whose prompts have no route to a decode replica."""
    if not any(r.role == "decode" for r in plan.replicas):
        return []
    fed = {k.dst for k in plan.kv_routes if k.weight > 0}
    sends = {k.src for k in plan.kv_routes if k.weight > 0}
    out = [f"decode replica {r.id} has no KV route feeding it: no request will reach it (add a kv_routes entry "
           f"to it)" for r in plan.replicas if r.role == "decode" and r.id not in fed]
    out += [f"prefill replica {r.id} has no KV route out: its prefilled requests have no decode replica to go to"
            for r in plan.replicas if r.role == "prefill" and r.id not in sends]
    return out


def _saved_flow(entry) -> float | None:
    value = entry.get("flow_requests_per_period") if isinstance(entry, dict) else None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _estimate_drift(plan, cluster: Cluster | None) -> list[str]:
    """Where the plan differs from what its saved estimate covers: replicas and roles, each replica's
    stages (devices and layers, by the digest the estimate keeps), the number of devices
    used, the flow its KV routes carry into each decode replica (the planner sets the routes ∝ the
    flow, so a decode replica's saved flow is the prefill flows times their routes' weights), and,
    on the cluster at hand, the devices' price."""
    e = plan.estimate
    saved = e.get("replicas") if e else None
    if not isinstance(saved, dict):
        return []
    out = []
    roles = {r.id: r.role for r in plan.replicas}
    added = [rid for rid in roles if rid not in saved]
    gone = [rid for rid in saved if rid not in roles]
    if added:
        out.append(f"replica{'s' * (len(added) > 1)} {', '.join(added)} not in the estimate")
    if gone:
        out.append(f"the estimate covers replica{'s' * (len(gone) > 1)} {', '.join(gone)}, no longer in the plan")
    for r in plan.replicas:
        entry = saved.get(r.id) if isinstance(saved.get(r.id), dict) else {}
        was = entry.get("role")
        if was is not None and was != r.role:
            out.append(f"replica {r.id} is {r.role}, estimated as {was}")
        digest = entry.get("stages_sha256")  # plans saved before it was kept lack it
        if isinstance(digest, str) and digest != r.stages_digest():
            out.append(f"replica {r.id}'s stages (devices or layers) are not those estimated")
    used = e.get("devices_used")
    if isinstance(used, int) and used != len(plan.devices):
        out.append(f"{len(plan.devices)} devices used, estimated on {used}")
    for r in plan.replicas:
        flow = _saved_flow(saved.get(r.id))
        if r.role != "decode" or flow is None or added or gone:
            continue
        carried = sum((_saved_flow(saved.get(k.src)) or 0.0) * k.weight for k in plan.kv_routes if k.dst == r.id)
        if abs(carried - flow) > max(1.0, 1e-3 * flow):
            out.append(f"the KV routes carry {carried:,.0f} requests per period into decode replica {r.id}, the "
                       f"estimate {flow:,.0f}")
    usd = e.get("cost_usd_per_hour")
    if cluster is not None and isinstance(usd, (int, float)) and all(cluster.has_device(d) for d in plan.devices):
        now = cluster.usd_per_hour([cluster.device(d).index for d in plan.devices])
        if now is not None and abs(now - usd) > 0.005 + 1e-4 * usd:
            out.append(f"its devices cost ${now:,.2f}/h on {cluster.name}, the estimate ${usd:,.2f}/h (other devices "
                       "or prices)")
    return out
