"""Network traffic a plan file implies, recomputed from the file alone (not from the search).

Inputs, all in the plan's ``estimate`` (the contract other tools read): per replica
``flow_requests_per_period`` (or, without it, ``capacity_requests_per_period``), ``period_s``,
``mean_input_tokens``, ``mean_output_tokens``, and the KV route weights. Per request:

* a KV route p → d carries the prompt's KV cache, layer-matched and TP-shard-matched
  (``CostModel.kv_transfer_pairs``), every part along its device pair's path;
* a replica's own PP hand-offs and cross-machine TP all-reduces (``CostModel.pp_resource_bytes``):
  prompt tokens through a prefill replica, generated tokens through a decode replica, both through
  a colocated one.

``plan_traffic`` sums bytes/s per shared resource (NICs, site pipes, dedicated links);
``network_warnings`` lists the resources a plan loads beyond their capacity. Running time
O(routes × TP² × stages).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hetserve.cost.analytic import CostModel
from hetserve.planner.plan import Plan, PlanReplica
from hetserve.specs.cluster import Cluster
from hetserve.specs.model import ModelSpec

OVERLOAD_WARN = 1.001  # utilisation above this is reported (plan files round flows to 3 decimals)


@dataclass(frozen=True)
class ResourceTraffic:
    name: str
    kind: str
    bytes_per_s: float
    capacity: float  # bytes/s

    @property
    def utilisation(self) -> float:
        return self.bytes_per_s / self.capacity if self.capacity > 0 else float("inf")

    @property
    def gbps(self) -> float:
        return self.bytes_per_s * 8 / 1e9


def _hand_offs(plan: Plan, cluster: Cluster, model: ModelSpec, input_tokens: float, output_tokens: float):
    """``(replica or KV route, shared resource -> bytes per request)`` for every replica's own PP
    hand-offs and cross-machine TP (prompt tokens through a prefill replica, generated through a
    decode one, both through a colocated one) and every KV route (the prompt's KV)."""
    cost = CostModel(cluster, model)
    layouts = {r.id: r.layout(cluster) for r in plan.replicas}
    tokens = {"prefill": input_tokens, "decode": output_tokens, "colocated": input_tokens + output_tokens}
    for r in plan.replicas:
        yield r, cost.pp_resource_bytes(layouts[r.id], tokens[r.role])
    for k in plan.kv_routes:
        yield k, cost.kv_resource_bytes(layouts[k.src], layouts[k.dst], input_tokens)


def plan_traffic(plan: Plan, cluster: Cluster, model: ModelSpec) -> list[ResourceTraffic]:
    """Bytes/s the plan puts on every shared resource it loads, busiest first (module doc)."""
    e = plan.estimate
    per = e.get("replicas", {})
    period = float(e.get("period_s", 0) or 0)
    if period <= 0 or not per:
        return []
    tin, tout = float(e.get("mean_input_tokens", 0)), float(e.get("mean_output_tokens", 0))
    load: dict = {}

    def served(rid: str) -> float:
        info = per.get(rid, {})
        return float(info.get("flow_requests_per_period", info.get("capacity_requests_per_period", 0.0)))

    for item, resources in _hand_offs(plan, cluster, model, tin, tout):
        requests = served(item.id) if isinstance(item, PlanReplica) else served(item.src) * item.weight
        for r, b in resources.items():
            load[r] = load.get(r, 0.0) + b * requests / period
    out = [ResourceTraffic(r.name, r.kind, b, r.bandwidth) for r, b in load.items()
           if b > 0 and math.isfinite(r.bandwidth)]  # an unlimited NIC cannot be overloaded
    return sorted(out, key=lambda t: (-t.utilisation, t.name))


def network_warnings(plan: Plan, cluster: Cluster, model: ModelSpec) -> list[str]:
    """One line per shared resource the plan loads beyond its capacity."""
    return [f"{t.name} ({t.kind.replace('_', ' ')}) carries {t.gbps:.3g} Gbit/s of planned traffic, "
            f"{t.utilisation:.0%} of its {t.capacity * 8 / 1e9:.3g} Gbit/s"
            for t in plan_traffic(plan, cluster, model) if t.utilisation > OVERLOAD_WARN]


def nothing_served(plan: Plan, cluster: Cluster, model: ModelSpec) -> str:
    """Why a plan whose estimate serves 0 tokens/s is of no use, with the numbers: the narrowest
    shared resource its hand-offs cross (a pipeline's activations, a KV route's cache), where that
    is what starves it, else that its replicas' own capacity rounds to nothing."""
    crossed = {r for _, resources in _hand_offs(plan, cluster, model, 1.0, 1.0) for r in resources}
    what = f"the best plan found on {cluster.name} serves 0 tokens/s"
    if "slo" in plan.estimate:
        what += " within the SLOs"
    narrow = min(crossed, key=lambda r: r.bandwidth, default=None)
    if narrow is not None:
        return (f"{what}: its hand-offs cross {narrow.name} ({narrow.kind.replace('_', ' ')}) at "
                f"{narrow.bandwidth * 8 / 1e9:.3g} Gbit/s, and every placement of {model.name} needs a link "
                f"like it (more bandwidth there, or devices that hold the model without it)")
    return f"{what}: its replicas' capacity rounds to nothing (a longer --period, or faster devices)"
