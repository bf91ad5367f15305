"""An evaluated pool layout written out as a ``Plan``: replica names, KV routes ∝ flow, and the
``estimate`` other tools read (docs/design.md's plan format: per-replica capacity and flow, period,
mean lengths, cost, the upper bound, the load on every shared NIC / pipe)."""

from __future__ import annotations

from hetserve.planner.bound.throughput import upper_bound
from hetserve.planner.context import PlanContext
from hetserve.planner.pool.flow import resource_loads
from hetserve.planner.options import Budget
from hetserve.planner.pool.evaluator import Evaluation
from hetserve.planner.plan import KVRoute, Plan, PlanReplica
from hetserve.planner.slo import slo_batch

_ROLE_ORDER = {"prefill": 0, "decode": 1, "colocated": 2}
_PREFIX = {"prefill": "p", "decode": "d", "colocated": "c"}


def to_plan(ctx: PlanContext, ev: Evaluation, algorithm: str, budget: Budget | None = None,
            notes: str | None = None) -> Plan:
    """Turn an evaluated pool layout into a ``Plan`` with KV routes ∝ flow and its estimates."""
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
    digests = {r.id: r.stages_digest() for r in replicas}
    for i in order:
        entry = {"role": ev.groups[i].role, "capacity_requests_per_period": round(ev.capacities[i], 3),
                 "stages_sha256": digests[names[i]]}
        if ev.groups[i].role != "colocated":
            entry["flow_requests_per_period"] = round(ev.flow.node_flow.get(i, 0.0), 3)
        elif i in ev.flow.colocated_flow:  # what it serves: less than its capacity where a shared link binds
            entry["flow_requests_per_period"] = round(ev.flow.colocated_flow[i], 3)
        if ctx.slo is not None and ev.groups[i].role != "prefill":
            # the decode batch the SLO capacity assumes: run the replica with at most this many
            entry["slo_max_batch"] = slo_batch(ctx.cost, ev.layouts[i], ev.groups[i].role, ctx.input_tokens,
                                               ctx.output_tokens, ctx.slo)
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
    if ctx.options.objective != "throughput":
        estimate["objective"] = ctx.options.objective
    if ctx.slo is not None:
        estimate["goodput_requests_per_s"] = round(ev.requests_per_period / ctx.period_s, 4)
        estimate["slo"] = {"ttft_s": ctx.slo.ttft_s, "tpot_s": ctx.slo.tpot_s}
    # what no pool layout of this pool can beat under the cost model (planner.bound), within what the
    # search left of its time limit
    bound = upper_bound(ctx, time_limit_s=None if budget is None else budget.bound_time_s())
    estimate["upper_bound_tokens_per_s"] = round(bound.tokens_per_s, 3)
    estimate["upper_bound_wall_s"] = round(bound.wall_s, 3)
    if bound.cut_short:
        estimate["upper_bound_cut_short"] = True
    estimate["network"] = network_estimate(ctx, ev)
    estimate["pricing"] = ctx.cost.pricing()  # per GPU type: fitted / transferred kernel model, or roofline
    if notes:
        estimate["notes"] = notes
    if budget is not None:
        estimate["search"] = budget.summary()
    return Plan(ctx.model.name, ctx.cluster.name, algorithm, tuple(replicas), tuple(routes), estimate,
                search_log=None if budget is None else budget.log())


def _planned_bytes(ctx: PlanContext, ev: Evaluation) -> dict[str, float]:
    """Bytes per T the flow puts on each shared resource. Within the SLOs the flow network charges
    a route's KV above what it sends (``slo.kv_loads_within``): the KV routes count the bytes of
    ``CostModel.kv_resource_bytes`` here."""
    if ctx.slo is None:
        return resource_loads(ev.network, ev.flow)
    sent = {}
    for (p, d), f in ev.flow.edge_flow.items():
        if f > 0:
            kv = ctx.cost.kv_resource_bytes(ev.layouts[p], ev.layouts[d], ctx.input_tokens)
            sent[(p, d)] = {r.name: b for r, b in kv.items()}
    return resource_loads(ev.network, ev.flow, sent)


def network_estimate(ctx: PlanContext, ev: Evaluation) -> dict[str, dict]:
    """Per shared resource the plan loads: planned Gbit/s (KV routes ∝ flow, PP hand-offs and TP
    all-reduces between machines), capacity and utilisation, busiest first."""
    loads = _planned_bytes(ctx, ev)
    rows = []
    for name, per_period in loads.items():
        r = ctx.resources.get(name)
        if r is None or per_period <= 0:
            continue
        gbps = per_period / ctx.period_s * 8 / 1e9
        cap = r.bandwidth * 8 / 1e9
        rows.append((gbps / cap, name, {"kind": r.kind, "planned_gbps": round(gbps, 4),
                                        "capacity_gbps": round(cap, 4), "utilisation": round(gbps / cap, 4)}))
    return {name: entry for _, name, entry in sorted(rows, key=lambda x: (-x[0], x[1]))}
