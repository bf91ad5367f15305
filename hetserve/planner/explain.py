"""``hetserve plan --explain``: what bounds a plan, and what more hardware would give.

* **Bound**: the plan's pool layout is priced again with its own layouts (the shared
  ``Evaluator``) and the min cut of its flow (``guided.min_cut``) is read: which groups' compute
  or memory (saturated prefill / decode replicas), which KV edges, which NICs or site pipes
  carry the whole flow; colocated replicas add their own capacity beside it.
* **What-ifs** on an edited copy of the cluster file: one more GPU of each type (on the first
  machine that has it), and twice the bandwidth of the plan's busiest shared link (its NIC, or its
  site pipe as a ``network.links`` entry). More hardware never takes a plan away: the current plan
  still runs on the edited pool (the new GPU idle, or the same replicas over the wider link), so
  each what-if is the better of that plan priced there (the shared ``Evaluator``, as for the
  bound) and a new search with the same algorithm and options (fewer restarts: a quick estimate,
  not a full search, which can lose to the current plan), and says which it is. Each row also
  gives the upper bound (``planner.bound``) of the edited pool, from the new search.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import NamedTuple

from hetserve.errors import InfeasibleError, PlanError, SpecError
from hetserve.planner.context import PlanContext
from hetserve.planner.search.guided import min_cut
from hetserve.planner.pool.evaluator import Evaluator
from hetserve.planner.pool.groups import Group
from hetserve.specs._validation import read_mapping
from hetserve.specs.cluster import _preset_dir, cluster_from_dict

WHAT_IF_RESTARTS = 4


def _priced(plan, cluster, model, workload, options):
    """``plan``'s replicas, with their own layouts, priced on ``cluster`` by the shared evaluator."""
    ctx = PlanContext(cluster, model, workload, options)
    layouts = [r.layout(cluster) for r in plan.replicas]
    groups = [Group.of(lay.devices, r.role) for lay, r in zip(layouts, plan.replicas)]
    return ctx, groups, Evaluator(ctx).evaluate_layouts(groups, layouts)


def plan_tokens_per_s(plan, cluster, model, workload, options) -> float:
    """Tokens/s of ``plan`` as it stands, priced on ``cluster`` under ``options`` (its replicas'
    device names must exist there: true of the pool it was made on and of every what-if pool)."""
    return _priced(plan, cluster, model, workload, options)[2].tokens_per_s


def bottlenecks(plan, cluster, model, workload, options) -> list[str]:
    """Lines naming what limits ``plan`` (see the module docstring)."""
    ctx, groups, ev = _priced(plan, cluster, model, workload, options)
    ids = [r.id for r in plan.replicas]
    cut = min_cut(ev)
    lines = []
    for i in cut.nodes:
        role = groups[i].role
        what = "compute (TTFT of one prompt)" if role == "prefill" else "compute / memory (decode batch)"
        lines.append(f"{role} replica {ids[i]}: its {what} is saturated — "
                     f"{ev.capacities[i]:,.0f} requests per {ctx.period_s:.0f} s, all used")
    for p, d in cut.kv_edges:
        lines.append(f"KV links {ids[p]} → {ids[d]} are full ({ev.network.edge_cap[(p, d)]:,.0f} requests per "
                     f"{ctx.period_s:.0f} s)")
    for r in dict.fromkeys(x[0] for x in cut.resources):
        res = ctx.resources.get(r)
        gbps = "" if res is None else f", {res.bandwidth * 8 / 1e9:.3g} Gbit/s"
        lines.append(f"shared link {r} is full{gbps} (KV of routes "
                     + ", ".join(f"{ids[p]}→{ids[d]}" for x, p, d in cut.resources if x == r) + ")")
    col = [i for i, g in enumerate(groups) if g.role == "colocated" and ev.capacities[i] > 0]
    if col:
        lines.append(f"{len(col)} colocated replica(s) serve {sum(ev.capacities[i] for i in col):,.0f} requests per "
                     f"{ctx.period_s:.0f} s on their own (each bound by its own compute / memory)")
    if not lines:
        lines.append("no prefill/decode flow to cut")
    return lines


def engine_cost(plan, cluster, model, workload, options, hexgen2) -> dict:
    """``plan`` (made under ``options.engine``'s rules) beside an unrestricted ``hexgen2`` plan of the
    same pool and options, and the bound (the smaller of the two plans' bounds: both bound the same
    pool, and a solver cut short by the time limit gives a looser one)."""
    from hetserve.planner.objectives import plan_for

    free = plan_for(hexgen2, cluster, model, workload, dataclasses.replace(options, engine="hetserve", progress=None))
    bounds = [p.estimate.get("upper_bound_tokens_per_s") or 0.0 for p in (plan, free)]
    return {"engine": options.engine, "engine_tokens_per_s": plan.estimate.get("throughput_tokens_per_s", 0.0),
            "unrestricted_tokens_per_s": free.estimate.get("throughput_tokens_per_s", 0.0),
            "upper_bound_tokens_per_s": min((b for b in bounds if b > 0), default=0.0),
            "unrestricted_plan": free}


def _cluster_data(cluster_arg: str) -> dict | None:
    path = Path(cluster_arg)
    if not path.exists():
        path = _preset_dir() / f"{cluster_arg}.yaml"
    if not path.exists():
        return None
    data = read_mapping(path)
    return None if "matrix" in data and data.get("matrix") else data


NEW_GPU_IDLE, WIDER_LINK = "current plan, the new GPU idle", "current plan over the wider link"


def _variants(data: dict, plan) -> list[tuple[str, dict, str]]:
    """(label, the edited cluster file, what the current plan on it is called) per what-if."""
    out = []
    seen = set()
    for m in data["machines"]:
        if m["gpu"] in seen:
            continue
        seen.add(m["gpu"])
        d = copy.deepcopy(data)
        for mm in d["machines"]:
            if mm["name"] == m["name"]:
                mm["count"] = int(mm.get("count", 1)) + 1
        out.append((f"+1 {m['gpu']} (on {m['name']})", d, NEW_GPU_IDLE))
    network = plan.estimate.get("network") or {}
    if network:
        name, v = next(iter(network.items()))
        d = copy.deepcopy(data)
        double = 2 * v["capacity_gbps"]
        if name.startswith(("nic-out:", "nic-in:")):
            machine = name.split(":", 1)[1]
            for mm in d["machines"]:
                if mm["name"] == machine:
                    nic = dict(mm.get("nic") or {})
                    nic["bandwidth_gbps"] = double
                    nic.setdefault("latency_ms", d.get("network", {}).get("intra_site", {}).get("latency_ms", 0.5))
                    mm["nic"] = nic
        elif name.startswith("pipe:"):
            a, b = name.split(":", 1)[1].split(">")
            net = d.setdefault("network", {})
            lat = net.get("inter_site", {}).get("latency_ms", 10.0)
            net["links"] = list(net.get("links", [])) + [{"between": [a, b], "bandwidth_gbps": double,
                                                         "latency_ms": lat}]
        else:
            d = None
        if d is not None:
            out.append((f"2× {name} ({v['capacity_gbps']:.3g} → {double:.3g} Gbit/s)", d, WIDER_LINK))
    return out


def what_if_options(options):
    """The options what-ifs search and price with: what more hardware gives at full load, so a
    budget is dropped and the cost objective's search of budgets becomes one plain search, counting
    (as that objective's searches do) what meets the SLOs where any are set."""
    return dataclasses.replace(options, budget_usd_per_hour=None,
                               objective="goodput" if options.objective == "cost" else options.objective)


class WhatIf(NamedTuple):
    """One what-if row. ``tokens_per_s`` is the better of the current plan priced on the edited
    pool and the quick re-plan (None only where neither could be priced); ``source`` says which."""

    change: str
    tokens_per_s: float | None
    upper_bound: float  # the re-plan's bound of the edited pool; 0 where the re-plan failed
    cut_short: bool  # the time limit stopped that bound's solver
    source: str
    note: str = ""  # why the re-plan failed, where it did


def what_ifs(plan, cluster_arg: str, model, workload, options, fn, on_variant=None) -> list[WhatIf]:
    """A ``WhatIf`` per variant of the cluster file (see the module docstring).
    ``on_variant(i, n, label)`` is called before each of the ``n`` re-plans: on a big pool each takes
    tens of seconds, so the CLI shows how far it is."""
    data = _cluster_data(cluster_arg)
    if data is None:
        return []
    quick = dataclasses.replace(options, restarts=WHAT_IF_RESTARTS, progress=None)
    rows = []
    variants = _variants(data, plan)
    for i, (label, d, as_is) in enumerate(variants):
        if on_variant is not None:
            on_variant(i, len(variants), label)
        try:
            edited = cluster_from_dict(d, f"{cluster_arg} ({label})")
        except SpecError as exc:  # reported, not fatal
            rows.append(WhatIf(label, None, 0.0, False, "–", str(exc)))
            continue
        current = plan_tokens_per_s(plan, edited, model, workload, quick)
        try:
            # the re-plan's own bound, solved within its time limit (one solved before it, on its
            # own, took het1's what-ifs a minute each past the limit)
            e = fn(edited, model, workload, quick).estimate
        except (InfeasibleError, PlanError, SpecError) as exc:  # reported, not fatal
            rows.append(WhatIf(label, current, 0.0, False, as_is, f"re-plan failed: {exc}"))
            continue
        replanned = e["throughput_tokens_per_s"]
        # a plan's estimate keeps 3 decimals: a re-plan within that rounding is the same value, and
        # the current plan's (unrounded, no search in it) is the one reported
        better, source = ((replanned, "re-planned") if replanned > current + 1e-3
                          else (current, as_is))
        rows.append(WhatIf(label, better, e["upper_bound_tokens_per_s"], bool(e.get("upper_bound_cut_short")),
                           source))
    return rows
