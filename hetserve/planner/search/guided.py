"""Max-flow-guided edge swaps (HexGen-2 §3.3 / §4.3): edits read from the solved flow's min cut.

After a pool layout's max flow is solved, the residual graph says what limits it: the edges from
the source side of a minimum cut to the sink side are saturated and together carry the whole
flow; raising any of them (and only them) can raise the flow. Nodes the flow leaves with slack
are where capacity idles. ``min_cut`` returns both; ``cut_moves`` proposes the edits that move
capacity from the second to the first:

* a saturated **prefill or decode node** (its group's compute / memory binds): move or swap one
  device into it from an under-used group (best-connected first), or flip an under-used group of
  the other role to this role;
* a saturated **KV edge** p → d (the links between the two groups bind): swap devices between the
  two groups (so layers meet over faster links), move one device across, or hand the flow to a
  better-connected group by flipping an under-used neighbour of p to decode (of d to prefill);
* a saturated **network resource** (a NIC or a site pipe, when the network has them): swap devices
  between a prefill and a decode group on either side of it, so the KV pair meets behind it;

(Turning under-used groups colocated is left to the final step, ``mixing.mixed_alternative``: as
a move inside the climb it strands devices where the prefill/decode moves no longer reach them.)

Each candidate is labelled with the cut edge it relieves, so the search log can say which kind
of move earned the gain. Running time: one residual-graph search per accepted pool layout, O(P·D),
plus O(cut edges × donors) candidates.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hetserve.planner.context import PlanContext
from hetserve.planner.pool.flow import resource_loads
from hetserve.planner.search.moves import PoolLayout, move, pick_device, swap, with_roles
from hetserve.planner.search.partition import group_bandwidth
from hetserve.planner.pool.evaluator import Evaluation

MAX_DONORS = 3  # under-used groups tried per saturated node
MAX_CUT_EDGES = 6  # saturated edges relieved per iteration (the largest flows first)
SLACK = 0.98  # a node below this utilisation has spare capacity
SATURATED = 0.999  # an edge or resource at or above this fraction of its capacity is full


@dataclass
class Cut:
    """The min cut of a solved pool layout: saturated node groups, KV edges and other resources."""

    nodes: list[int] = field(default_factory=list)  # groups whose capacity edge is cut
    kv_edges: list[tuple[int, int]] = field(default_factory=list)  # (prefill group, decode group)
    resources: list[tuple] = field(default_factory=list)  # (resource, p, d): a full NIC/pipe closes p → d
    slack: list[int] = field(default_factory=list)  # groups the flow leaves under-used


def min_cut(ev: Evaluation) -> Cut:
    """Saturated edges of a minimum cut of ``ev``'s solved flow, and the under-used groups.

    Breadth-first search of the residual graph from the source (forward along edges with spare
    capacity, backward along edges carrying flow); a route p → d is closed when its KV edge is
    full or a shared resource on it (NIC, pipe) is. The cut is every edge from a reached node to
    an unreached one. O(P·D) per call, on the flow the evaluator already solved."""
    net, flow = ev.network, ev.flow
    cut = Cut()
    if not net.prefill or not net.decode:
        return cut
    loads = resource_loads(net, flow)
    full_res = {r for r, cap in net.resource_cap.items() if loads.get(r, 0.0) >= SATURATED * cap}

    def has_room(used: float, cap: float) -> bool:
        return used < SATURATED * cap

    nf, ef = flow.node_flow, flow.edge_flow
    blocked: dict[tuple[int, int], list[str]] = {}
    for p in net.prefill:
        for d in net.decode:
            on = [r for r in net.route_load(p, d) if r in full_res]
            if on:
                blocked[(p, d)] = on
    reach = {("in", p) for p in net.prefill}  # source → p.in is uncapacitated
    todo = list(reach)
    while todo:
        kind, g = todo.pop()
        nxt = []
        if g in net.prefill:
            if kind == "in" and has_room(nf.get(g, 0.0), net.node_cap[g]):
                nxt.append(("out", g))
            if kind == "out":
                if nf.get(g, 0.0) > 0:
                    nxt.append(("in", g))
                nxt += [("in", d) for d in net.decode
                        if (p_d := (g, d)) not in blocked and has_room(ef.get(p_d, 0.0), net.edge_cap[p_d])]
        else:
            if kind == "in":
                if has_room(nf.get(g, 0.0), net.node_cap[g]):
                    nxt.append(("out", g))
                nxt += [("out", p) for p in net.prefill if ef.get((p, g), 0.0) > 0]
            elif nf.get(g, 0.0) > 0:
                nxt.append(("in", g))
        for v in nxt:
            if v not in reach:
                reach.add(v)
                todo.append(v)
    for g in net.prefill + net.decode:
        if ("in", g) in reach and ("out", g) not in reach:
            cut.nodes.append(g)
    for p in net.prefill:
        if ("out", p) not in reach:
            continue
        for d in net.decode:
            if ("in", d) in reach:
                continue
            if (p, d) in blocked:
                cut.resources.extend((r, p, d) for r in blocked[(p, d)])
            elif not has_room(ef.get((p, d), 0.0), net.edge_cap[(p, d)]):
                cut.kv_edges.append((p, d))
    cut.slack = [i for i in net.prefill + net.decode if ev.utilization(i) < SLACK]
    cut.kv_edges.sort(key=lambda e: (-ef.get(e, 0.0), e))
    cut.nodes.sort(key=lambda i: (-nf.get(i, 0.0), i))
    cut.resources.sort(key=lambda x: (-ef.get((x[1], x[2]), 0.0), x))
    return cut


def cut_moves(ctx: PlanContext, ev: Evaluation, cut: Cut | None = None) -> list[tuple[str, PoolLayout | None]]:
    """Candidate edits relieving ``ev``'s min cut (see the module docstring), labelled by kind."""
    cut = cut or min_cut(ev)
    groups = ev.groups
    if not cut.nodes and not cut.kv_edges and not cut.resources:
        return []
    w = group_bandwidth(ctx, [g.devices for g in groups])
    dead = [i for i in range(len(groups)) if ev.capacities[i] <= 0]
    out: list[tuple[str, PoolLayout | None]] = []

    def classes(i: int) -> list[int]:
        return sorted({ctx.class_of[d] for d in groups[i].devices})

    # saturated compute nodes: more devices for them, from under-used or idle groups
    for g in cut.nodes[:MAX_CUT_EDGES]:
        role = groups[g].role
        donors = sorted((h for h in cut.slack + dead if h != g), key=lambda h: (-w[g, h], h))[:MAX_DONORS]
        for h in donors:
            for k in classes(h)[:2]:
                d = pick_device(ctx, groups[h], k)
                out.append((f"cut {role} node: move device", move(groups, h, g, d)))
                for kg in classes(g):
                    if kg != k:
                        out.append((f"cut {role} node: swap devices",
                                    swap(groups, h, g, d, pick_device(ctx, groups[g], kg))))
        other = "decode" if role == "prefill" else "prefill"
        for h in sorted((h for h in cut.slack if groups[h].role == other), key=lambda h: (-w[g, h], h))[:2]:
            out.append((f"cut {role} node: flip role", with_roles(groups, {h: role})))

    # saturated KV edges: make the two groups meet over faster links, or hand the flow to a
    # better-connected neighbour
    for p, d in cut.kv_edges[:MAX_CUT_EDGES]:
        for kp in classes(p):
            for kd in classes(d):
                if kp != kd:
                    out.append(("cut KV edge: swap devices",
                                swap(groups, p, d, pick_device(ctx, groups[p], kp), pick_device(ctx, groups[d], kd))))
            out.append(("cut KV edge: move device", move(groups, p, d, pick_device(ctx, groups[p], kp))))
        for kd in classes(d):
            out.append(("cut KV edge: move device", move(groups, d, p, pick_device(ctx, groups[d], kd))))
        for h in sorted((h for h in cut.slack if h not in (p, d)), key=lambda h: (-w[p, h] - w[d, h], h))[:2]:
            out.append(("cut KV edge: flip role", with_roles(groups, {h: "decode" if groups[h].role == "prefill"
                                                                else "prefill"})))

    # saturated network resources (a NIC or pipe every blocked route crosses): swap devices between
    # the prefill and decode groups of those routes so the pair meets behind the resource, or flip
    # an under-used group next to one end so the KV stays on its side
    for r, p, d in cut.resources[:MAX_CUT_EDGES]:
        for kp in classes(p)[:2]:
            for kd in classes(d)[:2]:
                if kp != kd:
                    out.append(("cut network resource: swap devices",
                                swap(groups, p, d, pick_device(ctx, groups[p], kp), pick_device(ctx, groups[d], kd))))
        for h in sorted((h for h in cut.slack if h not in (p, d)), key=lambda h: (-w[p, h], h))[:2]:
            if groups[h].role == "prefill":
                out.append(("cut network resource: flip role", with_roles(groups, {h: "decode"})))
    return out
