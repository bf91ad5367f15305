"""The flow network of HexGen-2 §3.2 and its max flow.

Network (one per disaggregated placement)::

    source ──► p_i.in ──cap_p(i)──► p_i.out ──kv(i,j)──► d_j.in ──cap_d(j)──► d_j.out ──► sink

Invariants of ``FlowNetwork``:

* ``prefill`` and ``decode`` hold distinct group ids (indices into the placement's groups);
* ``node_cap[g]`` is requests per period T that group g can process in its role (> 0);
* ``edge_cap[(p, d)]`` is requests per T whose KV cache the p → d links can carry, one entry for
  every prefill × decode pair; source and sink edges are uncapacitated (the coordinator is not a
  bottleneck: requests and tokens are tiny next to KV caches);
* capacities are scaled to integer milli-requests before solving, so the networkx and the scipy
  solvers see the same integer network and return the same value.

``solve`` runs networkx's preflow-push (Goldberg–Tarjan) on exactly that network and returns the
flow on every edge: the refinement reads bottlenecks from it and KV-route weights are
proportional to it. ``max_flow_value`` returns the same value from scipy's Dinic solver on the
equivalent compact network (source → p with cap_p, p → d, d → sink with cap_d) in well under a
millisecond; searches use it to score candidate moves and call ``solve`` on the ones they keep.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import networkx as nx
import numpy as np
from networkx.algorithms.flow import preflow_push
from scipy.sparse import csr_array
from scipy.sparse.csgraph import maximum_flow

_MAX_INT = 2**31 - 1


@dataclass
class FlowNetwork:
    prefill: list[int]
    decode: list[int]
    node_cap: dict[int, float]
    edge_cap: dict[tuple[int, int], float]

    def scale(self) -> float:
        """Integer units per request: milli-requests unless that would overflow int32 sums."""
        finite = [c for c in list(self.node_cap.values()) + list(self.edge_cap.values()) if math.isfinite(c)]
        top = max(sum(self.node_cap[p] for p in self.prefill), max(finite, default=1.0), 1.0)
        return min(1000.0, (_MAX_INT // 4) / top)

    def _int(self, cap: float, s: float, bound: int) -> int:
        return bound if not math.isfinite(cap) else min(bound, int(cap * s))

    def upper_bound(self) -> float:
        """Min of total prefill and total decode capacity: no flow can exceed it."""
        return min(sum(self.node_cap[p] for p in self.prefill), sum(self.node_cap[d] for d in self.decode))


@dataclass
class FlowResult:
    value: float  # requests per T
    node_flow: dict[int, float] = field(default_factory=dict)  # through each compute node
    edge_flow: dict[tuple[int, int], float] = field(default_factory=dict)  # prefill → decode


def max_flow_value(net: FlowNetwork) -> float:
    """Max flow value (requests per T) by scipy's Dinic on the compact network. O(V²E) worst case."""
    return max_flow_nodes(net, nodes=False)[0]


def max_flow_nodes(net: FlowNetwork, nodes: bool = True) -> tuple[float, dict[int, float]]:
    """(max flow value, flow through every compute node) by scipy's Dinic, in requests per T."""
    if not net.prefill or not net.decode:
        return 0.0, {}
    s = net.scale()
    bound = _MAX_INT // 4
    P, D = len(net.prefill), len(net.decode)
    n = P + D + 2
    src, snk = 0, n - 1
    rows, cols, caps = [], [], []
    for i, p in enumerate(net.prefill):
        rows.append(src), cols.append(1 + i), caps.append(net._int(net.node_cap[p], s, bound))
    for j, d in enumerate(net.decode):
        rows.append(1 + P + j), cols.append(snk), caps.append(net._int(net.node_cap[d], s, bound))
    for i, p in enumerate(net.prefill):
        for j, d in enumerate(net.decode):
            c = net._int(net.edge_cap[(p, d)], s, bound)
            if c > 0:
                rows.append(1 + i), cols.append(1 + P + j), caps.append(c)
    m = csr_array((np.asarray(caps, dtype=np.int32), (np.asarray(rows), np.asarray(cols))), shape=(n, n))
    res = maximum_flow(m, src, snk, method="dinic")
    if not nodes:
        return res.flow_value / s, {}
    f = res.flow.toarray() if hasattr(res.flow, "toarray") else np.asarray(res.flow)
    nodes = {p: float(f[src, 1 + i]) / s for i, p in enumerate(net.prefill)}
    nodes.update({d: float(f[1 + P + j, snk]) / s for j, d in enumerate(net.decode)})
    return res.flow_value / s, nodes


def build_graph(net: FlowNetwork) -> nx.DiGraph:
    """The paper's directed graph with integer capacities (``capacity`` absent = unbounded)."""
    s = net.scale()
    bound = _MAX_INT // 4
    g = nx.DiGraph()
    g.add_node("source")
    g.add_node("sink")
    for p in net.prefill:
        g.add_edge("source", ("in", p))
        g.add_edge(("in", p), ("out", p), capacity=net._int(net.node_cap[p], s, bound))
    for d in net.decode:
        g.add_edge(("in", d), ("out", d), capacity=net._int(net.node_cap[d], s, bound))
        g.add_edge(("out", d), "sink")
    for p in net.prefill:
        for d in net.decode:
            g.add_edge(("out", p), ("in", d), capacity=net._int(net.edge_cap[(p, d)], s, bound))
    return g


def solve(net: FlowNetwork) -> FlowResult:
    """Max flow by networkx preflow-push, with the flow through every node and KV edge."""
    if not net.prefill or not net.decode:
        return FlowResult(0.0, {g: 0.0 for g in net.prefill + net.decode}, {})
    s = net.scale()
    g = build_graph(net)
    value, flow = nx.maximum_flow(g, "source", "sink", flow_func=preflow_push)
    node_flow = {p: flow[("in", p)][("out", p)] / s for p in net.prefill}
    node_flow.update({d: flow[("in", d)][("out", d)] / s for d in net.decode})
    edge_flow = {(p, d): flow[("out", p)][("in", d)] / s for p in net.prefill for d in net.decode}
    return FlowResult(value / s, node_flow, edge_flow)
