"""Baselines that share the Plan type and the evaluator with HexGen-2.

* ``genetic``: HexGen-2 with HexGen's genetic search in place of the graph partition and the
  refinement (§5.3): the GA evolves the grouping; each grouping is typed by HexGen-2's secondary
  partition and scored by the max flow.
* ``uniform``: DistServe-style. One (TP, PP) shape for every prefill replica and one for every
  decode replica, layers split evenly; every pair of shapes and every prefill-replica count is
  enumerated. Prefill replicas are carved from the fastest-compute GPUs first, decode replicas
  from what is left (largest memory first); a TP group stays inside one machine and GPU type.
"""

from __future__ import annotations

from typing import Sequence

from hetserve.cost.layout import ReplicaLayout, StageLayout
from hetserve.planner.context import PlanContext
from hetserve.planner.pool.estimate import to_plan
from hetserve.planner.search.hexgen import genetic_search, initial_population
from hetserve.planner.search.hexgen2 import colocated_fallback
from hetserve.planner.options import PlanOptions
from hetserve.planner.search.partition import assign_roles
from hetserve.planner.pool.groups import Group, canonical
from hetserve.planner.pool.evaluator import start_search
from hetserve.planner.plan import Plan
from hetserve.specs.cluster import Cluster
from hetserve.specs.model import ModelSpec
from hetserve.specs.workload import Workload

UNIFORM_PP = (1, 2, 4, 8)


def genetic(cluster: Cluster, model: ModelSpec, workload: Workload, options: PlanOptions | None = None) -> Plan:
    """HexGen-2 with the genetic algorithm generating and refining the groups."""
    options = options or PlanOptions()
    ctx, budget, evaluator = start_search("genetic", cluster, model, workload, options)

    def typer(part):
        return canonical(Group(g, r) for g, r in zip(part, assign_roles(evaluator, part)))

    best = genetic_search(ctx, evaluator, budget, options, typer, initial_population(ctx, options.seed))
    ev = evaluator.evaluate(best)
    if ev.flow.value <= 0:
        return colocated_fallback(ctx, "genetic", budget)
    return to_plan(ctx, ev, "genetic", budget)


# ----------------------------------------------------------------------------- uniform


def _carve(ctx: PlanContext, free: dict[int, list[int]], order: Sequence[int], tp: int, pp: int,
           num_layers: int) -> ReplicaLayout | None:
    """Take ``pp`` TP groups of ``tp`` devices (each from one class, in ``order``) off ``free``."""
    stages, taken = [], []
    bounds = [num_layers * i // pp for i in range(pp + 1)]
    for s in range(pp):
        k = next((k for k in order if len(free[k]) >= tp), None)
        if k is None:
            for k2, ds in taken:  # put back what this replica took
                free[k2][:0] = ds
            return None
        ds, free[k] = free[k][:tp], free[k][tp:]
        taken.append((k, ds))
        stages.append(StageLayout(tuple(ds), (bounds[s], bounds[s + 1])))
    return ReplicaLayout(tuple(stages))


def uniform(cluster: Cluster, model: ModelSpec, workload: Workload, options: PlanOptions | None = None) -> Plan:
    """DistServe-style planner: one shape per role, enumerated (see module docstring)."""
    options = options or PlanOptions()
    ctx, budget, evaluator = start_search("uniform", cluster, model, workload, options)
    L = model.num_layers
    devs = cluster.devices
    by_flops = sorted(range(len(ctx.classes)), key=lambda k: (-devs[ctx.classes[k][0]].gpu.fp16_flops, k))
    by_memory = sorted(range(len(ctx.classes)), key=lambda k: (-devs[ctx.classes[k][0]].memory_bytes,
                                                               -devs[ctx.classes[k][0]].gpu.mem_bandwidth, k))
    largest = max(ctx.class_counts)
    shapes = [(tp, pp) for tp in ctx.layouts.tp_ok if tp <= largest for pp in UNIFORM_PP
              if pp <= L and tp * pp <= ctx.num_devices
              and tp * pp * max(ctx.usable_memory) >= model.weight_bytes]
    best: tuple[float, list[Group], list[ReplicaLayout]] = (0.0, [], [])
    done = False
    for sp in shapes:
        for sd in shapes:
            n_p = 1
            while not done:
                if budget.exhausted():
                    done = True
                    break
                free = {k: list(ctx.classes[k]) for k in range(len(ctx.classes))}
                groups: list[Group] = []
                layouts: list[ReplicaLayout] = []
                for _ in range(n_p):
                    lay = _carve(ctx, free, by_flops, *sp, L)
                    if lay is None:
                        break
                    groups.append(Group.of(lay.devices, "prefill"))
                    layouts.append(lay)
                if len(groups) < n_p:
                    break
                while (lay := _carve(ctx, free, by_memory, *sd, L)) is not None:
                    groups.append(Group.of(lay.devices, "decode"))
                    layouts.append(lay)
                v = evaluator.score_layouts(groups, layouts)
                if v > best[0] * (1 + 1e-12):
                    best = (v, groups, layouts)
                budget.record(best[0])
                n_p += 1
            if done:
                break
        if done:
            break
    if best[0] <= 0:
        return colocated_fallback(ctx, "uniform", budget)
    ev = evaluator.evaluate_layouts(best[1], best[2])
    return to_plan(ctx, ev, "uniform", budget)
