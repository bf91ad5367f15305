"""The flow network of HexGen-2 §3.2 and its max flow.

Network (one per disaggregated pool layout)::

    source ──► p_i.in ──cap_p(i)──► p_i.out ──kv(i,j)──► d_j.in ──cap_d(j)──► d_j.out ──► sink

Invariants of ``FlowNetwork``:

* ``prefill`` and ``decode`` hold distinct group ids (indices into the pool layout's groups);
* ``node_cap[g]`` is requests per period T that group g can process in its role (> 0);
* ``edge_cap[(p, d)]`` is requests per T whose KV cache the p → d links can carry, one entry for
  every prefill × decode pair; source and sink edges are uncapacitated (the coordinator is not a
  bottleneck: requests and tokens are tiny next to KV caches);
* capacities are scaled to integer milli-requests before solving, so the networkx and the scipy
  solvers see the same integer network and return the same value.

**Capacity nodes for shared links** (docs/design.md, "Links are shared resources"). KV caches, PP
hand-offs and TP all-reduces that leave a machine cross its NIC, the site pipe and the receiving
NIC, and every route through one of them shares it. Each such resource r is a capacity node:

* ``resource_cap[r]``: bytes per period T it carries (bandwidth × T);
* ``edge_load[(p, d)][r]``: bytes one request routed p → d puts on r (its KV cache's parts that
  cross r); ``node_load[g][r]``: bytes one request served by group g puts on r by itself (PP
  hand-offs / TP all-reduces between its machines);
* a route may carry at most ``resource_cap[r] / bytes per request`` requests through r — summed
  over the routes and groups crossing r: ``Σ flow · load ≤ cap``.

Because routes put different bytes per request on the same node, a resource is a *weighted*
node constraint; the max flow with capacity nodes is then a small linear program (HiGHS),
exact, with the flow on every edge (past ``flow_lp.RESTRICT_COLUMNS`` columns solved by column
generation: the same optimum, not always the same routes among equally good ones). ``colocated``
groups sit outside the flow (their requests never cross a KV edge) but may load resources too;
they are variables of that program, capped by their capacity. Without resources, or when the
unconstrained max flow already respects every resource (it is then optimal: the constrained value
can only be lower), the network is the paper's and is solved as below.

``solve`` runs networkx's preflow-push (Goldberg–Tarjan) on exactly that network and returns the
flow on every edge: the refinement reads bottlenecks from it and KV-route weights are
proportional to it (past ``PREFLOW_MAX_EDGES`` KV edges it returns scipy's Dinic flow instead).
``max_flow_value`` returns the same value from scipy's Dinic solver on the equivalent compact
network (source → p with cap_p, p → d, d → sink with cap_d) in well under a
millisecond; searches use it to score candidate moves and call ``solve`` on the ones they keep.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import product

import networkx as nx
import numpy as np
from networkx.algorithms.flow import preflow_push
from scipy.sparse import csr_array
from scipy.sparse.csgraph import maximum_flow

from hetserve.planner.pool.flow_lp import build_programme, solve_programme

_MAX_INT = 2**31 - 1
# past this many KV edges ``solve`` returns scipy's Dinic flow instead of preflow-push's: the same
# value, another of the equally large flows (the guided moves and the KV routes read it); in pure
# Python, preflow-push took a quarter of the 4,096-GPU search (1,024 replicas, ~260,000 edges)
PREFLOW_MAX_EDGES = 32_768


@dataclass
class FlowNetwork:
    prefill: list[int]
    decode: list[int]
    node_cap: dict[int, float]
    edge_cap: dict[tuple[int, int], float]
    colocated: list[int] = field(default_factory=list)  # groups outside the flow (node_cap holds theirs)
    resource_cap: dict[str, float] = field(default_factory=dict)  # bytes per T
    edge_load: dict[tuple[int, int], dict[str, float]] = field(default_factory=dict)  # bytes / request
    node_load: dict[int, dict[str, float]] = field(default_factory=dict)  # bytes / request

    def route_load(self, p: int, d: int, edge_load: dict | None = None) -> dict[str, float]:
        """Bytes one request routed p → d puts on each resource: its KV (``edge_load``'s, default
        the network's own) plus both groups' own."""
        out = dict((self.edge_load if edge_load is None else edge_load).get((p, d), {}))
        for g in (p, d):
            for r, b in self.node_load.get(g, {}).items():
                out[r] = out.get(r, 0.0) + b
        return out

    def loads_resources(self) -> bool:
        return bool(self.resource_cap) and (any(self.edge_load.values()) or any(self.node_load.values()))

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
    value: float  # requests per T through the prefill → decode network (colocated not included)
    node_flow: dict[int, float] = field(default_factory=dict)  # through each compute node
    edge_flow: dict[tuple[int, int], float] = field(default_factory=dict)  # prefill → decode
    colocated_flow: dict[int, float] = field(default_factory=dict)  # requests per T each colocated group serves
    # the LP's dual values (``solve_with_resources`` only): per group's node row, per byte of a resource
    node_dual: dict[int, float] = field(default_factory=dict)
    resource_dual: dict[str, float] = field(default_factory=dict)
    # ``solve_fast`` only, when it needed the LP: the max flow that ignores resources (``solve``
    # reads it to skip preflow-push, whose flow then surely overloads a resource)
    unconstrained: float | None = None

    @property
    def total(self) -> float:
        return self.value + sum(self.colocated_flow.values())


def resource_loads(net: FlowNetwork, flow: FlowResult, edge_load: dict | None = None) -> dict[str, float]:
    """Bytes per T the flow puts on every resource it crosses (the KV routes' bytes per request:
    ``edge_load``, default what the network charges them)."""
    out: dict[str, float] = {}
    for (p, d), f in flow.edge_flow.items():
        if f > 0:
            for r, b in net.route_load(p, d, edge_load).items():
                out[r] = out.get(r, 0.0) + f * b
    for c, f in flow.colocated_flow.items():
        for r, b in net.node_load.get(c, {}).items():
            out[r] = out.get(r, 0.0) + f * b
    return out


def _respects_resources(net: FlowNetwork, flow: FlowResult) -> bool:
    loads = resource_loads(net, flow)
    return all(v <= net.resource_cap.get(r, math.inf) * (1 + 1e-9) + 1e-6 for r, v in loads.items())


def solve_with_resources(net: FlowNetwork) -> FlowResult:
    """The exact max flow with capacity nodes (module doc) as a linear program (HiGHS).

    Variables: the flow on every KV edge and what every colocated group serves; maximise their
    sum under the node, edge and resource capacities. O(LP on P·D + C variables)."""
    edges = [(p, d) for p in net.prefill for d in net.decode]
    P, D = len(net.prefill), len(net.decode)
    cols = len(edges) + len(net.colocated)
    if cols == 0:
        return FlowResult(0.0)
    lp = build_programme(net, edges)  # rows and columns: ``flow_lp``
    x, marginals = solve_programme(lp, P, D)
    edge_flow = {e: float(x[k]) for k, e in enumerate(edges)}
    node_flow = {g: 0.0 for g in net.prefill + net.decode}
    for (p, d), f in edge_flow.items():
        node_flow[p] += f
        node_flow[d] += f
    colocated = {c: float(x[len(edges) + k]) for k, c in enumerate(net.colocated)}
    # duals of the maximisation (HiGHS reports ∂min/∂b ≤ 0); resource rows were scaled by 1 / top
    lam = np.maximum(-marginals, 0.0)
    node_dual = {g: float(lam[i]) for i, g in enumerate(net.prefill + net.decode)}
    resource_dual = {r: float(lam[P + D + i]) / float(lp.tops[i]) for i, r in enumerate(lp.names) if lp.tops[i] > 0}
    return FlowResult(sum(edge_flow.values()), node_flow, edge_flow, colocated, node_dual, resource_dual)


def dual_bound(net: FlowNetwork, node_dual: dict[int, float | None], resource_dual: dict[str, float]) -> float:
    """An upper bound on ``solve_with_resources(net).total`` from any dual prices, by weak duality.

    The LP is max Σx s.t. node rows (y_g), resource rows (z_r, per byte) and x ≤ u. Any y, z ≥ 0
    with w_e = max(0, 1 − y_p − y_d − z·load(p, d)) for every column is dual feasible, so
    Σ y·cap + Σ z·resource cap + Σ w·u ≥ the max flow. Prices from a neighbouring pool layout's
    LP (``node_dual`` per group of this network; None for a group that pool layout did not have,
    priced here at the price that minimises the bound, ``_best_price``) make it tight enough to
    skip most candidate LPs of a search step. O(P·D·resources)."""
    z = {r: v for r, v in resource_dual.items() if v > 0 and r in net.resource_cap}

    def zl(load: dict[str, float]) -> float:
        return sum(z[r] * b for r, b in load.items() if r in z) if z else 0.0

    groups = net.prefill + net.decode
    zn = {g: zl(net.node_load.get(g, {})) for g in groups + net.colocated}
    ze = {e: zl(ld) for e, ld in net.edge_load.items()} if z else {}
    dec = set(net.decode)

    def column_cost(p: int, d: int, y: dict) -> float:
        w = 1.0 - (y.get(p) or 0.0) - (y.get(d) or 0.0) - ze.get((p, d), 0.0) - zn[p] - zn[d]
        if w <= 0:
            return 0.0
        u = net.edge_cap.get((p, d), 0.0)
        return w * min(u, 1e15)

    y: dict[int, float | None] = {g: node_dual.get(g) for g in groups}
    new = [g for g in groups if y[g] is None]
    for _ in range(2 if len(new) > 1 else 1):  # a second pass: the new groups' prices see each other's
        for g in new:
            y[g] = _best_price(net, g, g in dec, y, ze, zn)
    total = sum((y[g] or 0.0) * net.node_cap[g] for g in groups)
    total += sum(v * net.resource_cap[r] for r, v in z.items())
    total += sum(column_cost(p, d, y) for p in net.prefill for d in net.decode)
    total += sum(net.node_cap[c] * max(0.0, 1.0 - zn[c]) for c in net.colocated)
    return total


def _best_price(net: FlowNetwork, g: int, is_decode: bool, y: dict, ze: dict, zn: dict) -> float:
    """The price y_g ≥ 0 of group g's node row that minimises ``dual_bound`` with the other
    prices fixed: its part, y·cap_g + Σ_e u_e·max(0, a_e − y) over g's columns e (a_e = 1 − the
    other prices on e), is convex and piecewise linear in y, so the minimum sits where the slope
    cap_g − Σ_{a_e > y} u_e turns non-negative, at 0 or at one of the a_e. Any y ≥ 0 keeps the
    bound valid; this one is the tightest (at least as tight as 0 or 1). O(columns log columns)."""
    others = net.prefill if is_decode else net.decode
    pts = []
    for o in others:
        p, d = (o, g) if is_decode else (g, o)
        a = 1.0 - (y.get(o) or 0.0) - ze.get((p, d), 0.0) - zn[p] - zn[d]
        u = min(net.edge_cap.get((p, d), 0.0), 1e15)
        if a > 0 and u > 0:
            pts.append((a, u))
    cap = net.node_cap[g]
    slope = cap - sum(u for _, u in pts)  # at y = 0
    best = 0.0
    for a, u in sorted(pts):
        if slope >= 0:
            break
        best = a
        slope += u
    return best


def _unconstrained_colocated(net: FlowNetwork) -> dict[int, float]:
    return {c: net.node_cap[c] for c in net.colocated}


def max_flow_total(net: FlowNetwork) -> float:
    """Requests per T of the whole pool layout: the max flow plus what colocated groups serve,
    with every capacity node respected (Dinic first; the LP only when a resource binds)."""
    if not net.loads_resources():
        return max_flow_value(net) + sum(_unconstrained_colocated(net).values())
    return solve_fast(net).total


def solve_fast(net: FlowNetwork) -> FlowResult:
    """``solve``'s answer with scipy's Dinic in place of preflow-push (for scoring)."""
    flow = _dinic_flow(net)
    if net.loads_resources() and not _respects_resources(net, flow):
        lp = solve_with_resources(net)
        lp.unconstrained = flow.total
        return lp
    return flow


def max_flow_value(net: FlowNetwork) -> float:
    """Max flow value (requests per T) through the prefill → decode network, capacity nodes
    respected (scipy's Dinic on the compact network; the LP when a resource binds)."""
    return max_flow_nodes(net, nodes=False)[0]


def max_flow_nodes(net: FlowNetwork, nodes: bool = True) -> tuple[float, dict[int, float]]:
    """(max flow value, flow through every compute node), in requests per T."""
    if net.loads_resources():
        f = solve_fast(net)
        return f.value, f.node_flow
    value, node_flow, _ = _dinic(net, nodes=nodes, edges=False)
    return value, node_flow


def _dinic(net: FlowNetwork, nodes: bool = True, edges: bool = True):
    """(value, node flows, edge flows) by scipy's Dinic on the compact network, ignoring
    resources. O(V²E) worst case."""
    if not net.prefill or not net.decode:
        return 0.0, {}, {}
    s = net.scale()
    bound = _MAX_INT // 4
    P, D = len(net.prefill), len(net.decode)
    n = P + D + 2
    src, snk = 0, n - 1
    # the compact network in CSR form, rows in order (source, prefill nodes, decode nodes): built
    # directly, capacities as ``FlowNetwork._int`` rounds them (vectorised: it runs per candidate)
    node = _int_caps(np.fromiter((net.node_cap[g] for g in net.prefill + net.decode), float, P + D), s, bound)
    pairs = list(product(net.prefill, net.decode))
    kv = _int_caps(np.fromiter(map(net.edge_cap.__getitem__, pairs), float, P * D), s, bound).reshape(P, D)
    keep = kv > 0
    per_row = keep.sum(axis=1)
    indptr = np.concatenate(([0, P], P + np.cumsum(per_row), P + per_row.sum() + np.arange(1, D + 1),
                             [P + per_row.sum() + D]))
    indices = np.concatenate((np.arange(1, P + 1), (1 + P + np.nonzero(keep)[1]), np.full(D, snk)))
    data = np.concatenate((node[:P], kv[keep], node[P:])).astype(np.int32)
    m = csr_array((data, indices.astype(np.int32), indptr.astype(np.int32)), shape=(n, n))
    res = maximum_flow(m, src, snk, method="dinic")
    if not nodes and not edges:
        return res.flow_value / s, {}, {}
    f = res.flow.toarray() if hasattr(res.flow, "toarray") else np.asarray(res.flow)
    node_flow = {p: float(f[src, 1 + i]) / s for i, p in enumerate(net.prefill)}
    node_flow.update({d: float(f[1 + P + j, snk]) / s for j, d in enumerate(net.decode)})
    # the flows are integers: clipped at 0, then scaled (as ``max(0.0, float(x)) / s`` would)
    edge_flow = (dict(zip(pairs, (np.maximum(f[1:1 + P, 1 + P:1 + P + D], 0).astype(float) / s).ravel().tolist()))
                 if edges else {})
    return res.flow_value / s, node_flow, edge_flow


def _int_caps(caps: np.ndarray, s: float, bound: int) -> np.ndarray:
    """``FlowNetwork._int`` on an array: capacity × scale truncated, at most ``bound`` (inf too)."""
    out = np.full(len(caps), bound, dtype=np.int64)
    finite = np.isfinite(caps)
    out[finite] = np.minimum(caps[finite] * s, bound).astype(np.int64)  # clipped first: no int64 overflow
    return out


def _dinic_flow(net: FlowNetwork) -> FlowResult:
    """The max flow that ignores resources, by scipy's Dinic, with the flow on every edge."""
    return FlowResult(*_dinic(net), _unconstrained_colocated(net))


def _preflow(net: FlowNetwork) -> FlowResult:
    """The max flow that ignores resources, by networkx's preflow-push, with the flow on every edge."""
    s = net.scale()
    value, flow = nx.maximum_flow(build_graph(net), "source", "sink", flow_func=preflow_push)
    node_flow = {p: flow[("in", p)][("out", p)] / s for p in net.prefill}
    node_flow.update({d: flow[("in", d)][("out", d)] / s for d in net.decode})
    edge_flow = {(p, d): flow[("out", p)][("in", d)] / s for p in net.prefill for d in net.decode}
    return FlowResult(value / s, node_flow, edge_flow, _unconstrained_colocated(net))


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
    # the KV edges in bulk (~10⁵ on large pools), capacities rounded as ``FlowNetwork._int``
    pairs = list(product(net.prefill, net.decode))
    caps = _int_caps(np.fromiter(map(net.edge_cap.__getitem__, pairs), float, len(pairs)), s, bound).tolist()
    g.add_edges_from((("out", p), ("in", d), {"capacity": c}) for (p, d), c in zip(pairs, caps))
    return g


def solve(net: FlowNetwork, lp: FlowResult | None = None) -> FlowResult:
    """Max flow by networkx preflow-push, with the flow through every node and KV edge; the
    LP of ``solve_with_resources`` when that flow overloads a capacity node.

    ``lp``: that LP's result for this very network when the caller has it (``solve_fast``'s,
    with ``unconstrained`` set). Where its optimum is below the max flow that ignores
    resources, every max flow — the one preflow-push would find included — overloads a
    resource, so it is returned without running preflow-push (it cost as much as the LP on
    large pools)."""
    if not net.prefill or not net.decode:
        flow = FlowResult(0.0, {g: 0.0 for g in net.prefill + net.decode}, {}, _unconstrained_colocated(net))
        if net.loads_resources() and not _respects_resources(net, flow):
            return solve_with_resources(net)
        return flow
    if lp is not None and lp.unconstrained is not None and lp.total < lp.unconstrained * (1 - 1e-7):
        return lp
    result = _dinic_flow(net) if len(net.prefill) * len(net.decode) > PREFLOW_MAX_EDGES else _preflow(net)
    if net.loads_resources() and not _respects_resources(net, result):
        return lp if lp is not None else solve_with_resources(net)
    return result
