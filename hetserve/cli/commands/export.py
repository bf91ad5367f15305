"""``hetserve export``: a plan as a launch bundle for hetserve, vLLM or SGLang (docs/deploy.md)."""

from __future__ import annotations

import argparse
from pathlib import Path

from hetserve.cli.commands.serve import port_range_arg
from hetserve.export.common import RAY_PORT
from hetserve.listing import some


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "export", help="write a plan as a launch bundle (scripts per machine, router, deploy.json)",
        description="Write PLAN as a launch bundle for an engine: one script per machine, a router "
                    "configuration, README.md and deploy.json. A plan the engine cannot run is refused, "
                    "naming the replica and the rule (re-plan with `hetserve plan --engine`).")
    p.add_argument("--plan", required=True, help="plan file (JSON or YAML)")
    p.add_argument("--cluster", help="cluster preset or file (default: the one the plan was made on); "
                                     "its machines' `address` is where each process binds")
    p.add_argument("--to", required=True, choices=("hetserve", "vllm", "sglang"), help="the engine to launch")
    p.add_argument("--model", help="the checkpoint's path (or hub name) on every machine "
                                   "(default: the model the plan names)")
    p.add_argument("--ray-port", type=int, default=RAY_PORT, metavar="PORT",
                   help="the Ray head's port (default 6379; multi-machine vLLM replicas' own Ray heads take the next ones)")
    p.add_argument("--port-range", type=port_range_arg, metavar="LO-HI",
                   help="--to hetserve only: the ports hetserve serve's own listeners take theirs from on every "
                        "machine (its --port-range, docs/multinode.md; default: ports the OS picks), refused where a machine "
                        "needs more (one per worker there; the serving machine one or two more); vLLM's and "
                        "SGLang's bundles have fixed ports (docs/deploy.md) and refuse it")
    p.add_argument("-o", "--output", required=True, metavar="DIR",
                   help="folder to write the bundle into: new or empty (an earlier bundle's scripts left beside "
                        "the new ones would start another plan's processes)")
    p.add_argument("--force", action="store_true",
                   help="DIR holds an earlier bundle: replace it (only the files its bundle.json lists are removed; "
                        "a folder holding any other file is refused)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hetserve.cli.model_dir import check_plan, plan_checkpoint, plan_cluster, plan_model
    from hetserve.export import export_bundle
    from hetserve.export.common import address_note, checkpoint_note
    from hetserve.export.folder import check_bundle_folder
    from hetserve.planner.plan import Plan
    from hetserve.specs.model import load_model, model_presets

    from hetserve.errors import SpecError

    if not 1 <= args.ray_port <= 65000:
        raise SpecError("--ray-port", SpecError.OPTION, "a port in [1, 65000]", str(args.ray_port))
    if args.ray_port != RAY_PORT and args.to == "sglang":  # only the hetserve and vLLM bundles start Ray
        raise SpecError("--ray-port", SpecError.OPTION, "--to hetserve or vllm (an SGLang bundle starts no Ray head); "
                        "drop --ray-port", str(args.ray_port))
    if args.port_range is not None and args.to != "hetserve":  # only hetserve serve takes a range
        raise SpecError("--port-range", SpecError.OPTION, f"--to hetserve (a {args.to} bundle's ports are fixed: "
                        "docs/deploy.md); drop --port-range", str(args.port_range))
    # the folder before the plan is read; an earlier bundle there is removed only once the new one is built
    earlier = check_bundle_folder(args.output, args.force)
    plan = Plan.load(args.plan)
    cluster = plan_cluster(args.plan, plan, args.cluster)
    # the model's shape: from --model where it is a checkpoint folder here, else the model the plan names
    local = bool(args.model) and Path(args.model).exists()
    try:
        model = load_model(args.model) if local else plan_model(args.plan, plan.model)
    except SpecError as exc:
        if not args.model or exc.field != "model":
            raise
        # --model names the checkpoint as the machines will see it; its shape is read from here
        raise SpecError(args.plan, "model", f"the model's shape here: --model {args.model} is no folder on this "
                        f"machine, and the plan's model {plan.model!r} is no preset or checkpoint folder here; "
                        "export where a copy of the checkpoint (its config.json) is", plan.model) from exc
    check_plan(args.plan, plan, cluster, model)
    cluster_path = _cluster_file(args.cluster, plan, args.plan)
    # a checkpoint folder here, given or the one the plan names, by its absolute path: the scripts run
    # from their own folder, and a relative path would name another place there (a hub name, a preset's
    # name or another machine's path stays as given)
    named = None if args.model or plan.model in model_presets() else plan_checkpoint(args.plan, plan.model)
    checkpoint = (str(Path(args.model).resolve()) if local else str(named.resolve()) if named is not None
                  else args.model or plan.model)
    written = export_bundle(plan, cluster, args.to, args.output, checkpoint, model.num_layers,
                            cluster_path=cluster_path, ray_port=args.ray_port, replace=args.force, earlier=earlier,
                            port_range=args.port_range)
    if earlier:
        print(f"removed the earlier bundle's {len(earlier)} files from {args.output} (its bundle.json lists them)")
    print(f"wrote {len(written)} files to {args.output}: " + _written(written, args.output))
    print(f"start it as {Path(args.output) / 'README.md'} says")
    for note in (address_note(plan, cluster), checkpoint_note(plan, checkpoint)):  # as the bundle's README says
        if note:
            print(f"note: {note}")
    if not args.model and plan.model in model_presets():  # a preset's name is no checkpoint an engine loads
        print(f"note: the scripts load the model as '{plan.model}', the name of hetserve's preset; an engine needs "
              f"the checkpoint's path or hub name there: export again with --model PATH")
    return 0


def _cluster_file(given: str | None, plan, plan_path: str) -> str | None:
    """The pool's file a hetserve bundle carries (its serve reads it there): ``--cluster`` where it
    is a file, else the file the plan records, else, with no ``--cluster``, the one the plan's
    ``cluster`` names (a plan written by hand), found as ``plan_cluster`` found it; None for a preset."""
    from hetserve.planner.plan import named_cluster_file

    if given and Path(given).is_file():
        return given
    if plan.cluster_file is not None:
        return str(plan.cluster_file.path)
    named = named_cluster_file(plan, plan_path) if given is None else None
    return None if named is None else str(named)


def _written(paths, out: str) -> str:
    """The files written, by name; a fleet's machine scripts (one per machine) as their count and a
    few names, so 171 machines do not make a paragraph of ``machines/m42.sh``."""
    names = [Path(p).relative_to(out).as_posix() for p in paths]
    scripts = [n for n in names if n.startswith("machines/")]
    if len(scripts) <= SCRIPTS_NAMED:
        return ", ".join(names)
    rest = [n for n in names if not n.startswith("machines/")]
    return ", ".join(rest) + f", machine scripts {some(scripts)}"


SCRIPTS_NAMED = 8  # machine scripts the export's line names one by one
