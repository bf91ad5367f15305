"""Elastic re-plan (HexGen's "GPUs leave and join"): plan the freed devices around a running plan.

``replan(cluster, model, workload, running, lost)`` is warm-started from ``running``: every replica
whose devices are all still in ``cluster`` and none ``lost`` is kept on its devices and stages (its
workers keep serving; one whose prefill or decode partners all died is kept as a colocated replica),
and the planner's public function plans only the devices no kept replica holds —
those of a dead replica's surviving ranks, devices that came back, devices an updated cluster file
added. New replicas get ids the running plan does not use, so a kept replica's id never changes.
When the freed devices cannot hold a replica the kept ones make the whole plan.
"""

from __future__ import annotations

from dataclasses import replace

from hetserve.errors import InfeasibleError, PlanError
from hetserve.planner.options import PlanOptions
from hetserve.planner.plan import KVRoute, Plan, unused_id


def replan(cluster, model, workload, running: Plan, lost: set[str] | frozenset[str] = frozenset(), *,
           algorithm: str = "hexgen2", options: PlanOptions | None = None,
           dead_replicas: set[str] | frozenset[str] = frozenset()) -> Plan:
    """The running plan's surviving replicas plus a plan of the free devices of ``cluster``."""
    names = {d.name for d in cluster.devices}
    kept = [r for r in running.replicas
            if r.id not in dead_replicas and all(d in names and d not in lost for d in r.devices)]
    replicas, routes, free = _around(cluster, model, workload, running, kept, lost, algorithm, options)
    # A kept replica left without its partners serves both phases on its own devices and stages:
    # prefill replicas with no decode replica to hand off to, and decode replicas no prefill replica
    # feeds (theirs died; the freed devices made none or only colocated ones) become colocated, as
    # the engine already runs them once their partners die. Re-planning their devices instead would
    # retire them and start new workers: no serving meanwhile where they were all that was left.
    no_decode = not any(r.role == "decode" for r in replicas)
    fed = {k.dst for k in routes}
    alone = {r.id for r in kept if (r.role == "prefill" and no_decode) or (r.role == "decode" and r.id not in fed)}
    replicas = [replace(r, role="colocated") if r.id in alone else r for r in replicas]
    routes = [k for k in routes if k.src not in alone and k.dst not in alone]
    if not replicas:
        raise PlanError(f"re-plan: no replica fits the {len(free)} free device(s) of {cluster.name!r}")
    return Plan(running.model, running.cluster, f"replan({algorithm})", tuple(replicas), tuple(routes),
                {"kept": sorted(r.id for r in kept), "planned_devices": [cluster.devices[i].name for i in free]})


def _around(cluster, model, workload, running: Plan, kept: list, lost, algorithm: str, options):
    """``kept`` plus a plan of the devices they leave free; (replicas, KV routes, free device indices)."""
    from hetserve.planner import plan as run_planner

    held = {d for r in kept for d in r.devices}
    free = [d.index for d in cluster.devices if d.name not in held and d.name not in lost]
    fresh: Plan | None = None
    if free:
        try:
            fresh = run_planner(cluster.subset(free), model, workload, algorithm, options or PlanOptions())
        except (PlanError, InfeasibleError):
            fresh = None  # the freed devices cannot hold a replica on their own
    kept_ids = {r.id for r in kept}
    routes = [k for k in running.kv_routes if k.src in kept_ids and k.dst in kept_ids]
    replicas = list(kept)
    if fresh is not None:
        used = {r.id for r in running.replicas}
        rename = {r.id: unused_id(r.id, used) for r in fresh.replicas}
        replicas += [replace(r, id=rename[r.id]) for r in fresh.replicas]
        routes += [KVRoute(rename[k.src], rename[k.dst], k.weight) for k in fresh.kv_routes]
    decode = [r.id for r in replicas if r.role == "decode"]
    for r in replicas:  # a kept prefill replica whose decode replicas are gone spreads over the new ones
        if r.role == "prefill" and decode and not any(k.src == r.id for k in routes):
            routes += [KVRoute(r.id, d, 1.0 / len(decode)) for d in decode]
    return replicas, routes, free
