"""The ``--model`` check that every command serving or measuring a real checkpoint makes first, and
the model and cluster a plan file names, loaded with an error that says where the name came from."""

from __future__ import annotations

import sys
from pathlib import Path

from hetserve.errors import PlanError, SpecError
from hetserve.planner.plan import Plan, load_plan_cluster, plan_places
from hetserve.specs.cluster import Cluster
from hetserve.specs.model import ModelSpec, load_model, model_presets


def check_model_dir(path: str) -> None:
    """The checkpoint folder exists and its config.json reads as a supported model: one line, exit
    code 2, before any process starts (a preset name would otherwise go to the Hugging Face hub)."""
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise SpecError(path, "--model", "a checkpoint folder holding config.json (see `hetserve make-model`)",
                        "no such folder" if not folder.exists() else "no config.json in it")
    ModelSpec.from_hf_config(folder)


def plan_checkpoint(plan_path: str, name: str) -> Path | None:
    """The checkpoint folder the plan's ``model`` field names, where one is here (``plan_places``:
    from here, else beside the plan file, where `make demo` writes both); None for a preset's name
    or a folder that is not here."""
    return next((folder for folder in plan_places(name, plan_path) if (folder / "config.json").is_file()), None)


def plan_model(plan_path: str, name: str) -> ModelSpec:
    """The model the plan names (its ``model`` field): a preset, a path from here, or a checkpoint
    folder of that name beside the plan file (``plan_checkpoint``); else a clear error that says
    where the name came from."""
    try:
        return load_model(name)
    except SpecError as exc:
        if exc.field != "(model)":  # found, but malformed: that error says more
            raise
        beside = plan_checkpoint(plan_path, name)
        if beside is not None:
            return load_model(str(beside))
        raise SpecError(plan_path, "model", f"a model preset ({', '.join(model_presets())}), a config.json or a "
                        f"checkpoint folder; pass --model, or build the checkpoint it names with "
                        f"`hetserve make-model ... -o {name}`", name) from exc


def plan_cluster(plan_path: str, plan: Plan, cluster: str | None = None) -> Cluster:
    """The cluster to run the plan on: ``--cluster`` when given, else the cluster file the plan was
    made on (a warning on stderr naming it when it changed since), else the preset the plan names;
    a missing one is one line naming the plan file and the file to pass (``load_plan_cluster``)."""
    return load_plan_cluster(plan, plan_path, cluster, warn=lambda msg: print(f"warning: {msg}", file=sys.stderr))


def check_plan(plan_path: str, plan: Plan, cluster: Cluster, model: ModelSpec) -> None:
    """``validate_plan``, its one line prefixed with the plan file it is about: the user may have
    several at hand, and the line names the plan's devices and replicas but not where they came from."""
    from hetserve.planner.validate import validate_plan

    try:
        validate_plan(plan, cluster, model)
    except PlanError as exc:
        raise PlanError(f"{plan_path}: {exc}") from exc


class _LayersOfThePlan:
    """Stands in for a model that is not here, for the checks that need only the cluster: no TP
    rule, and as many layers as the plan's deepest replica reaches (so each replica must reach as
    far as the others: a short one is caught, a layer count the model lacks is not)."""

    def __init__(self, plan: Plan) -> None:
        self.num_layers = max((s.layers[1] for r in plan.replicas for s in r.stages), default=0)
        self.name = "the plan's deepest replica"

    def tp_problem(self, tp: int) -> None:
        return None


MODEL_FREE_CHECKS = "devices, device reuse, layer ranges, roles, KV routes"
MODEL_CHECKS = "the layer count, TP degrees, memory"


def check_plan_without_model(plan_path: str, plan: Plan, cluster: Cluster) -> None:
    """The checks of ``validate_plan`` that need only the cluster (``MODEL_FREE_CHECKS``), for a
    plan whose model is not at hand: a plan's own mistakes (a device used twice, one the pool lacks,
    overlapping layers) are refused without it. ``PlanError`` prefixed by the plan file, as
    ``check_plan``."""
    from hetserve.planner.validate import plan_problems

    problems = plan_problems(plan, cluster, _LayersOfThePlan(plan), None, strict_routes=True)
    if problems:
        raise PlanError(f"{plan_path}: plan ({plan.algorithm}, {plan.model} on {plan.cluster}) is invalid: "
                        + "; ".join(problems))
