"""A placement (device groups with roles), its value under the cost model, and the ``Plan`` it becomes.

Every algorithm searches over placements and is scored by the same ``Evaluator``, so their
numbers compare fairly:

* each group gets its best layout for its role (``LayoutSearch``) and that layout's capacity in
  requests per period T; a group whose devices cannot hold a replica has capacity 0 and its
  devices stay idle (it is left out of the plan);
* prefill and decode groups form the flow network of HexGen-2 §3.2; its max flow is the
  disaggregated part's requests per T;
* colocated groups add their capacities;
* throughput = requests per T × mean output tokens / T (``PlanContext.tokens_per_s``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from hetserve.cost.layout import ReplicaLayout
from hetserve.planner.context import PlanContext
from hetserve.planner.flow import FlowNetwork, FlowResult, max_flow_value, solve
from hetserve.planner.options import Budget
from hetserve.planner.plan import KVRoute, Plan, PlanReplica

_ROLE_ORDER = {"prefill": 0, "decode": 1, "colocated": 2}
_PREFIX = {"prefill": "p", "decode": "d", "colocated": "c"}


@dataclass(frozen=True, order=True)
class Group:
    """Devices (sorted indices) that together serve one replica in ``role``."""

    devices: tuple[int, ...]
    role: str

    @staticmethod
    def of(devices: Iterable[int], role: str) -> "Group":
        return Group(tuple(sorted(devices)), role)


def canonical(groups: Iterable[Group]) -> tuple[Group, ...]:
    """Placements compare equal whatever the order of their groups."""
    return tuple(sorted(g for g in groups if g.devices))


@dataclass
class Evaluation:
    """A placement priced in full: layouts, capacities, and (disaggregated) the solved flow."""

    groups: tuple[Group, ...]
    layouts: tuple[ReplicaLayout | None, ...]
    capacities: tuple[float, ...]  # requests per T in the group's role; 0 = cannot hold a replica
    network: FlowNetwork
    flow: FlowResult
    requests_per_period: float
    tokens_per_s: float

    def idle_devices(self, i: int) -> tuple[int, ...]:
        """Devices of group i its layout leaves unused (all of them if it holds no replica)."""
        lay = self.layouts[i]
        if lay is None or self.capacities[i] <= 0:
            return self.groups[i].devices
        used = set(lay.devices)
        return tuple(d for d in self.groups[i].devices if d not in used)

    def utilization(self, i: int) -> float:
        cap = self.capacities[i]
        if cap <= 0:
            return 0.0
        if self.groups[i].role == "colocated":
            return 1.0
        return self.flow.node_flow.get(i, 0.0) / cap


class Evaluator:
    """Scores placements for one ``PlanContext``; caches scores by canonical placement."""

    def __init__(self, ctx: PlanContext):
        self.ctx = ctx
        self._scores: dict[tuple[Group, ...], float] = {}
        self._fixed_caps: dict[tuple[ReplicaLayout, str], float] = {}
        self.evaluations = 0  # distinct placements scored

    def capacity(self, devices: Sequence[int], role: str) -> float:
        return self.ctx.layouts.capacity(devices, role)

    def _network(self, groups: Sequence[Group], floor: float = -1.0):
        """(layouts, capacities, flow network, colocated requests per T).

        With ``floor`` ≥ 0 and a capacity bound that cannot beat it, the KV edges are not built
        (the network's ``edge_cap`` stays empty and only its ``upper_bound`` is meaningful)."""
        ctx = self.ctx
        layouts: list[ReplicaLayout | None] = []
        caps: list[float] = []
        for g in groups:
            best = ctx.layouts.best(g.devices, g.role) if g.devices else None
            layouts.append(None if best is None else best[0])
            caps.append(0.0 if best is None else best[1])
        pre = [i for i, g in enumerate(groups) if g.role == "prefill" and caps[i] > 0]
        dec = [i for i, g in enumerate(groups) if g.role == "decode" and caps[i] > 0]
        net = FlowNetwork(pre, dec, {i: caps[i] for i in pre + dec}, {})
        colocated = sum(caps[i] for i, g in enumerate(groups) if g.role == "colocated")
        if floor >= 0 and ctx.tokens_per_s((net.upper_bound() if pre and dec else 0.0) + colocated) <= floor:
            return layouts, caps, net, colocated
        kv = ctx.kv_capacity
        net.edge_cap = {(p, d): kv(layouts[p], layouts[d], (groups[p].devices, groups[d].devices))  # type: ignore[arg-type]
                        for p in pre for d in dec}
        return layouts, caps, net, colocated

    def score(self, groups: Iterable[Group], floor: float = -1.0) -> float:
        """Estimated tokens/s of a placement (scipy max flow; cached).

        With ``floor`` ≥ 0, a placement whose capacity upper bound cannot beat ``floor`` is
        scored by that bound without solving the flow (callers only compare against ``floor``).
        """
        key = canonical(groups)
        hit = self._scores.get(key)
        if hit is not None:
            return hit
        layouts, caps, net, colocated = self._network(key, floor)
        bound = self.ctx.tokens_per_s((net.upper_bound() if net.prefill and net.decode else 0.0) + colocated)
        if floor >= 0 and bound <= floor:
            return bound
        self.evaluations += 1
        value = self.ctx.tokens_per_s(max_flow_value(net) + colocated)
        self._scores[key] = value
        return value

    def _fixed_network(self, groups: Sequence[Group], layouts: Sequence[ReplicaLayout]):
        ctx = self.ctx
        caps = []
        for g, lay in zip(groups, layouts):
            key = (lay, g.role)
            if key not in self._fixed_caps:
                self._fixed_caps[key] = ctx.layouts.layout_capacity(lay, g.role)
            caps.append(self._fixed_caps[key])
        pre = [i for i, g in enumerate(groups) if g.role == "prefill" and caps[i] > 0]
        dec = [i for i, g in enumerate(groups) if g.role == "decode" and caps[i] > 0]
        edges = {(p, d): ctx.kv_capacity(layouts[p], layouts[d]) for p in pre for d in dec}
        net = FlowNetwork(pre, dec, {i: caps[i] for i in pre + dec}, edges)
        colocated = sum(caps[i] for i, g in enumerate(groups) if g.role == "colocated")
        return caps, net, colocated

    def score_layouts(self, groups: Sequence[Group], layouts: Sequence[ReplicaLayout]) -> float:
        """Tokens/s of groups whose layouts the caller fixes (e.g. the uniform planner)."""
        _, net, colocated = self._fixed_network(groups, layouts)
        self.evaluations += 1
        return self.ctx.tokens_per_s(max_flow_value(net) + colocated)

    def evaluate_layouts(self, groups: Sequence[Group], layouts: Sequence[ReplicaLayout]) -> Evaluation:
        """Full evaluation of groups with caller-fixed layouts."""
        caps, net, colocated = self._fixed_network(groups, layouts)
        flow = solve(net)
        req = flow.value + colocated
        return Evaluation(tuple(groups), tuple(layouts), tuple(caps), net, flow, req, self.ctx.tokens_per_s(req))

    def evaluate(self, groups: Iterable[Group]) -> Evaluation:
        """Full evaluation with the flow on every edge (networkx preflow-push)."""
        key = canonical(groups)
        layouts, caps, net, colocated = self._network(key)
        flow = solve(net)
        req = flow.value + colocated
        return Evaluation(key, tuple(layouts), tuple(caps), net, flow, req, self.ctx.tokens_per_s(req))


def to_plan(ctx: PlanContext, ev: Evaluation, algorithm: str, budget: Budget | None = None,
            notes: str | None = None) -> Plan:
    """Turn an evaluated placement into a ``Plan`` with KV routes ∝ flow and its estimates."""
    order = sorted((i for i in range(len(ev.groups)) if ev.capacities[i] > 0),
                   key=lambda i: (_ROLE_ORDER[ev.groups[i].role], ev.groups[i].devices))
    if not order:
        raise ctx.no_replica_error()
    names: dict[int, str] = {}
    counters = {"prefill": 0, "decode": 0, "colocated": 0}
    replicas = []
    for i in order:
        role = ev.groups[i].role
        names[i] = f"{_PREFIX[role]}{counters[role]}"
        counters[role] += 1
        replicas.append(PlanReplica.from_layout(names[i], role, ev.layouts[i], ctx.cluster))  # type: ignore[arg-type]
    routes: list[KVRoute] = []
    net = ev.network
    for p in [i for i in order if ev.groups[i].role == "prefill"]:
        flows = {d: ev.flow.edge_flow.get((p, d), 0.0) for d in net.decode}
        if sum(flows.values()) <= 0:  # idle prefill replica: route by KV-link capacity instead
            flows = {d: min(net.edge_cap[(p, d)], 1e12) for d in net.decode}
        total = sum(flows.values())
        kept = {d: f / total for d, f in flows.items() if f / total > 1e-9} if total > 0 else {}
        norm = sum(kept.values())
        for d in sorted(kept, key=lambda d: names[d]):
            routes.append(KVRoute(names[p], names[d], kept[d] / norm))
    used = [d for i in order for d in ev.layouts[i].devices]  # type: ignore[union-attr]
    usd = ctx.cluster.usd_per_hour(used) if used else 0.0
    per_replica = {}
    for i in order:
        entry = {"role": ev.groups[i].role, "capacity_requests_per_period": round(ev.capacities[i], 3)}
        if ev.groups[i].role != "colocated":
            entry["flow_requests_per_period"] = round(ev.flow.node_flow.get(i, 0.0), 3)
        per_replica[names[i]] = entry
    estimate = {
        "throughput_tokens_per_s": round(ev.tokens_per_s, 3),
        "cost_usd_per_hour": None if usd is None else round(usd, 4),
        "tokens_per_usd": None if not usd else round(ev.tokens_per_s * 3600 / usd, 1),
        "requests_per_period": round(ev.requests_per_period, 3),
        "period_s": ctx.period_s,
        "mean_input_tokens": round(ctx.input_tokens, 2),
        "mean_output_tokens": round(ctx.output_tokens, 2),
        "devices_used": len(used),
        "devices_total": ctx.num_devices,
        "replicas": per_replica,
    }
    if notes:
        estimate["notes"] = notes
    if budget is not None:
        estimate["search"] = budget.summary()
    return Plan(ctx.model.name, ctx.cluster.name, algorithm, tuple(replicas), tuple(routes), estimate)
