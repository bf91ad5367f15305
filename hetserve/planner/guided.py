"""Max-flow-guided edge swaps (HexGen-2 §3.3 / §4.3): edits read from the solved flow's min cut.

After a placement's max flow is solved, the residual graph says what limits it: the edges from
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
of move earned the gain. Running time: one preflow-push min cut per accepted placement
(networkx, tens of milliseconds at 100 groups) plus O(cut edges × donors) candidates.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import networkx as nx
from networkx.algorithms.flow import preflow_push

from hetserve.planner.context import PlanContext
from hetserve.planner.flow import build_graph
from hetserve.planner.moves import Placement, move, pick_device, swap
from hetserve.planner.partition import group_bandwidth
from hetserve.planner.placement import Evaluation, Group, canonical

MAX_DONORS = 3  # under-used groups tried per saturated node
MAX_CUT_EDGES = 6  # saturated edges relieved per iteration (the largest flows first)
SLACK = 0.98  # a node below this utilisation has spare capacity


@dataclass
class Cut:
    """The min cut of a solved placement: saturated node groups, KV edges and other resources."""

    nodes: list[int] = field(default_factory=list)  # groups whose capacity edge is cut
    kv_edges: list[tuple[int, int]] = field(default_factory=list)  # (prefill group, decode group)
    resources: list[tuple] = field(default_factory=list)  # other cut edges (network nodes), as (u, v)
    slack: list[int] = field(default_factory=list)  # groups the flow leaves under-used


def min_cut(ev: Evaluation) -> Cut:
    """Saturated edges of a minimum cut of ``ev``'s flow network, and the under-used groups."""
    net = ev.network
    cut = Cut()
    if not net.prefill or not net.decode:
        return cut
    g = build_graph(net)
    _, (src_side, _) = nx.minimum_cut(g, "source", "sink", flow_func=preflow_push)
    for u in src_side:
        for v, attrs in g[u].items():
            if v in src_side or "capacity" not in attrs:
                continue
            if isinstance(u, tuple) and isinstance(v, tuple) and u[0] == "in" and v == ("out", u[1]):
                cut.nodes.append(u[1])
            elif isinstance(u, tuple) and u[0] == "out" and isinstance(v, tuple) and v[0] == "in" \
                    and u[1] in net.node_cap and v[1] in net.node_cap:
                cut.kv_edges.append((u[1], v[1]))
            else:
                cut.resources.append((u, v))
    cut.slack = [i for i in net.prefill + net.decode if ev.utilization(i) < SLACK]
    flows = ev.flow.edge_flow
    cut.kv_edges.sort(key=lambda e: (-flows.get(e, 0.0), e))
    cut.nodes.sort(key=lambda i: (-ev.flow.node_flow.get(i, 0.0), i))
    return cut


def _role_of(groups: Placement, i: int, role: str) -> Placement:
    out = list(groups)
    out[i] = Group(groups[i].devices, role)
    return canonical(out)


def cut_moves(ctx: PlanContext, ev: Evaluation, cut: Cut | None = None) -> list[tuple[str, Placement | None]]:
    """Candidate edits relieving ``ev``'s min cut (see the module docstring), labelled by kind."""
    cut = cut or min_cut(ev)
    groups = ev.groups
    if not cut.nodes and not cut.kv_edges and not cut.resources:
        return []
    w = group_bandwidth(ctx, [g.devices for g in groups])
    dead = [i for i in range(len(groups)) if ev.capacities[i] <= 0]
    out: list[tuple[str, Placement | None]] = []

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
            out.append((f"cut {role} node: flip role", _role_of(groups, h, role)))

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
            out.append(("cut KV edge: flip role", _role_of(groups, h, "decode" if groups[h].role == "prefill"
                                                            else "prefill")))

    # saturated network resources: pair prefill and decode groups on each side of it
    if cut.resources:
        pre = [i for i in ev.network.prefill]
        dec = [i for i in ev.network.decode]
        pairs = sorted(((p, d) for p in pre for d in dec), key=lambda e: (-ev.flow.edge_flow.get(e, 0.0), e))
        for p, d in pairs[:MAX_CUT_EDGES]:
            for kp in classes(p)[:2]:
                for kd in classes(d)[:2]:
                    if kp != kd:
                        out.append(("cut network resource: swap devices",
                                    swap(groups, p, d, pick_device(ctx, groups[p], kp),
                                         pick_device(ctx, groups[d], kd))))

    return out
