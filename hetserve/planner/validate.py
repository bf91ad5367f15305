"""The plan checks, in one place: is a ``Plan`` well-formed and deployable on its cluster and model?

Checks, each reported with the replica, stage or route it concerns and the numbers involved:

* replicas: at least one; unique ids; a known role;
* devices: every device exists in the cluster; none is used twice in the plan;
* layers: each replica's stages cover ``[0, num_layers)`` in order, without gap or overlap;
* TP: a stage's device count divides the model's heads, KV heads and FFN width;
* memory: each stage's weights and activation buffers (cost model, ``CostModel.stage_memory``)
  fit in the usable memory of every device of the stage;
* roles: some replica serves prefill and some serves decode (``serves_prefill`` /
  ``serves_decode``); prefill replicas have a decode replica to hand their KV caches to;
* KV routes: from a prefill replica to a decode replica, both present; weights finite and
  non-negative; the weights out of each prefill replica sum to 1; every prefill replica has a route.

Two entry points share that one list:

* ``validate_plan``: every check: a plan file, the planner's output, ``hetserve plan/simulate``.
* ``check_runnable``: what the simulator and the runtime need to run a plan at all. It leaves out
  the memory check (each sizes memory itself: the runtime against its memory fraction and the
  checkpoint's dtype, the simulator through its KV capacity), the model's name (a checkpoint
  stands for the plan's model) and the route weights (a prefill replica without routes sends to
  every decode replica, ``policies.routing.route_candidates``).

All problems are collected and raised together as one ``PlanError``. Traffic beyond a shared NIC's
or site pipe's capacity is a warning, not an error (the plan still runs, slower):
``network_warnings`` (from ``hetserve.planner.traffic``) lists those resources.
"""

from __future__ import annotations

import math

from hetserve.cost.analytic import CostModel
from hetserve.cost.efficiency import Efficiency
from hetserve.cost.layout import StageLayout
from hetserve.errors import PlanError, SpecError
from hetserve.planner.plan import ROLES, Plan, PlanReplica, serves_decode, serves_prefill
from hetserve.planner.traffic import network_warnings  # noqa: F401 - the validator's warnings
from hetserve.specs.cluster import Cluster
from hetserve.specs.model import ModelSpec, load_model

WEIGHT_TOLERANCE = 1e-6
GB = 1e9


def validate_plan(plan: Plan, cluster: Cluster, model: ModelSpec | None = None,
                  efficiency: Efficiency | None = None) -> None:
    """Raise ``PlanError`` listing every problem of ``plan`` on ``cluster`` / ``model``; None if valid.

    ``model`` defaults to the preset named by ``plan.model``. Running time O(stages × TP + routes).
    """
    if model is None:
        try:
            model = load_model(plan.model)
        except SpecError as exc:
            raise PlanError(f"plan names model {plan.model!r}, which is not a preset: pass the model") from exc
    problems: list[str] = []
    if plan.model != model.name:
        problems.append(f"the plan is for model {plan.model}, but {model.name} was given")
    problems += plan_problems(plan, cluster, model, CostModel(cluster, model, efficiency), strict_routes=True)
    if problems:
        raise PlanError(f"plan ({plan.algorithm}, {plan.model} on {plan.cluster}) is invalid: " + "; ".join(problems))


def check_runnable(plan: Plan, cluster: Cluster, model: ModelSpec, source: str = "plan") -> None:
    """Raise ``PlanError`` (prefixed by ``source``) if the simulator or the runtime cannot run
    ``plan`` at all: the structural checks of ``validate_plan`` without memory, model name or route
    weights (see the module docstring)."""
    problems = plan_problems(plan, cluster, model, None, strict_routes=False)
    if problems:
        raise PlanError(f"{source}: " + "; ".join(problems))


def plan_problems(plan: Plan, cluster: Cluster, model: ModelSpec, cost: CostModel | None,
                  strict_routes: bool) -> list[str]:
    """Every problem of ``plan`` as one line each; memory is checked only when ``cost`` is given,
    route weights and missing routes only when ``strict_routes``."""
    if not plan.replicas:
        return ["plan has no replicas"]
    devices = [d for r in plan.replicas for s in r.stages for d in s.devices]
    if len(set(devices)) > 1 and not any(cluster.has_device(d) for d in devices):
        # another pool altogether: one line for it, not one clause per device
        return [f"none of its {len(devices)} devices ({devices[0]} … {devices[-1]}) is in cluster {cluster.name} "
                f"(its devices are {cluster.devices[0].name} … {cluster.devices[-1].name}): run it on the pool it "
                f"was made on, or plan again for this one"]
    problems: list[str] = []
    seen_ids: set[str] = set()
    used: dict[str, str] = {}
    for r in plan.replicas:
        if r.id in seen_ids:
            problems.append(f"replica id {r.id!r} is used twice")
        seen_ids.add(r.id)
        if r.role not in ROLES:
            problems.append(f"replica {r.id}: role {r.role!r} is not one of {', '.join(ROLES)}")
        problems += _replica_problems(r, cluster, model, cost, used)
    problems += _role_problems(plan)
    problems += _route_problems(plan, strict_routes)
    return problems


def _replica_problems(r: PlanReplica, cluster: Cluster, model: ModelSpec, cost: CostModel | None,
                      used: dict[str, str]) -> list[str]:
    """Layers, devices, TP degree and (with ``cost``) memory of one replica's stages; ``used``
    maps each device already taken to where, across replicas."""
    where = f"replica {r.id}"
    if not r.stages:
        return [f"{where}: has no stages"]
    problems: list[str] = []
    expected = 0
    for si, s in enumerate(r.stages):
        at = f"{where} stage {si}"
        a, b = s.layers
        if not s.devices:
            problems.append(f"{at}: has no devices")
        if a != expected:
            if a > expected:
                problems.append(f"{at}: starts at layer {a} but the layers before end at {expected} "
                                f"(layers {expected}–{a} are served by no stage)")
            else:
                problems.append(f"{at}: starts at layer {a}, overlapping the previous stage, which ends at {expected}")
        if b <= a:
            problems.append(f"{at}: layer range [{a}, {b}) is empty")
        expected = max(expected, b)
        known = True
        for d in s.devices:
            if not cluster.has_device(d):
                known = False
                problems.append(f"{at}: device {d!r} is not in cluster {cluster.name} "
                                f"(its devices are {cluster.devices[0].name} … {cluster.devices[-1].name})")
            elif d in used:
                problems.append(f"device {d} is used twice: by {used[d]} and by {at}")
            else:
                used[d] = at
        if len(set(s.devices)) != len(s.devices):
            problems.append(f"{at}: lists a device more than once")
        tp = len(s.devices)
        if tp and (why := model.tp_problem(tp)):
            problems.append(f"{at}: {why}")
        if cost is not None and known and tp and b > a and len(set(s.devices)) == tp:
            problems += _memory_problems(at, s.devices, (a, b), si == 0, si == len(r.stages) - 1, cluster, cost)
    if expected < model.num_layers:
        problems.append(f"{where}: stages end at layer {expected}, but {model.name} has "
                        f"{model.num_layers} layers (layers {expected}–{model.num_layers} are served by no stage)")
    elif expected > model.num_layers:
        problems.append(f"{where}: stages reach layer {expected}, beyond {model.name}'s {model.num_layers} layers")
    return problems


def _memory_problems(at: str, devices, layers: tuple[int, int], is_first: bool, is_last: bool,
                     cluster: Cluster, cost: CostModel) -> list[str]:
    usable = cost.eff.usable_memory
    stage = StageLayout(tuple(cluster.device(d).index for d in devices), layers)
    need = cost.stage_memory(stage, 0, is_first=is_first, is_last=is_last)
    for d in devices:
        dev = cluster.device(d)
        have = dev.memory_bytes * usable
        if need > have:
            return [f"{at} (layers {layers[0]}–{layers[1]}, TP {len(devices)}): needs {need / GB:.3g} GB per device "
                    f"for weights and activations, but {d} ({dev.gpu.name}) has {have / GB:.3g} GB usable "
                    f"({dev.memory_bytes / GB:.3g} GB × {usable:.0%})"]
    return []


def _role_problems(plan: Plan) -> list[str]:
    """Someone must run prompts and someone generate tokens; prefill replicas need a decode replica."""
    problems: list[str] = []
    prefill = [r.id for r in plan.replicas if r.role == "prefill"]
    decode = [r.id for r in plan.replicas if r.role == "decode"]
    roles = sorted({r.role for r in plan.replicas})
    if prefill and not decode:
        problems.append(f"prefill replicas ({', '.join(prefill)}) but no decode replica to send KV caches to")
    elif not any(serves_decode(r.role) for r in plan.replicas):
        problems.append(f"no replica runs decode (roles: {', '.join(roles)})")
    if decode and not prefill:
        problems.append(f"decode replicas ({', '.join(decode)}) but no prefill replica to feed them")
    elif not any(serves_prefill(r.role) for r in plan.replicas):
        problems.append(f"no replica runs prefill (roles: {', '.join(roles)})")
    return problems


def _route_problems(plan: Plan, strict: bool) -> list[str]:
    problems: list[str] = []
    roles = {r.id: r.role for r in plan.replicas}
    prefill = [r.id for r in plan.replicas if r.role == "prefill"]
    decode = [r.id for r in plan.replicas if r.role == "decode"]
    totals = {p: 0.0 for p in prefill}
    pairs: set[tuple[str, str]] = set()
    for k in plan.kv_routes:
        at = f"KV route {k.src} → {k.dst}"
        if k.src not in roles:
            problems.append(f"{at}: no replica {k.src!r}")
        elif roles[k.src] != "prefill":
            problems.append(f"{at}: routes start at a prefill replica, but {k.src} is {roles[k.src]}")
        if k.dst not in roles:
            problems.append(f"{at}: no replica {k.dst!r}")
        elif roles[k.dst] != "decode":
            problems.append(f"{at}: routes end at a decode replica, but {k.dst} is {roles[k.dst]}")
        if not math.isfinite(k.weight) or k.weight < 0:
            problems.append(f"{at}: weight {k.weight} must be a finite non-negative number")
        elif k.src in totals:
            totals[k.src] += k.weight
        if (k.src, k.dst) in pairs:
            problems.append(f"{at}: listed twice")
        pairs.add((k.src, k.dst))
    if decode and strict:
        for p, total in totals.items():
            if total == 0 and not any(k.src == p for k in plan.kv_routes):
                problems.append(f"prefill replica {p} has no KV route")
            elif abs(total - 1.0) > WEIGHT_TOLERANCE:
                problems.append(f"KV route weights out of prefill replica {p} sum to {total:.6g}, expected 1")
    return problems
