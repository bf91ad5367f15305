"""Weak-duality bounds on a neighbouring pool layout's LP without building its whole network.

``flow.dual_bound`` prices a candidate pool layout's LP with the prices of the last priced
pool layout (the *base*): Σ y·cap over its groups, Σ z·cap over the resources, and per KV column
(p, d) a term u·max(0, 1 − y_p − y_d − z·load). It needs every column, i.e. the candidate's
whole P × D network. A search step's candidates keep most of the base's groups, and a column
between two kept groups has the same capacity, loads and prices as in the base, so its term is
the base's: ``NeighbourBound`` keeps the base's terms by group and adds only the columns of the
groups the candidate adds (priced as ``dual_bound`` prices new groups). O((added groups) ·
(P + D)) per candidate instead of O(P · D).

The bound on that LP bounds the candidate's score only where a shared resource binds (the LP is
below the max flow that ignores resources; ``Evaluator._dual_bound``). Without the candidate's
network that max flow is not known, but the base's resource-free max flow, less what it routes
through the groups the candidate removes, is a feasible flow of the candidate's network (kept
groups keep their capacities and their columns), so it is a lower bound on it; ``bound`` returns
a bound only when the LP bound is below that.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from hetserve.planner.pool.flow import FlowNetwork, _best_price


@dataclass
class NeighbourBound:
    """The base pool layout's dual terms, by group (``of``), and the bounds they give (``bound``)."""

    groups: tuple  # the base's groups (``Group``s), by network index
    z: dict[str, float]  # resource prices per byte (> 0 only)
    resource_term: float  # Σ z · resource capacity
    y: dict  # Group → node price (prefill and decode groups of the base's network)
    zn: dict  # Group → z · its own bytes per request
    node_term: dict  # Group → y · cap (prefill / decode) or cap · max(0, 1 − zn) (colocated)
    pair_term: dict  # (prefill Group, decode Group) → the column's term
    row: dict  # Group → Σ of its columns' terms
    pairs_total: float
    free_flow: dict  # Group → flow through it in the base's max flow without resources
    free_value: float  # that max flow's value

    @staticmethod
    def of(groups, net: FlowNetwork, node_dual: dict[int, float], resource_dual: dict[str, float],
           free_value: float, free_nodes: dict[int, float]) -> "NeighbourBound":
        z = {r: v for r, v in resource_dual.items() if v > 0 and r in net.resource_cap}

        def zl(load: dict[str, float]) -> float:
            return sum(z[r] * b for r, b in load.items() if r in z) if z else 0.0

        y = {groups[g]: node_dual[g] for g in net.prefill + net.decode}
        zn = {groups[g]: zl(net.node_load.get(g, {})) for g in net.prefill + net.decode + net.colocated}
        node_term = {groups[g]: node_dual[g] * net.node_cap[g] for g in net.prefill + net.decode}
        node_term.update({groups[c]: net.node_cap[c] * max(0.0, 1.0 - zn[groups[c]]) for c in net.colocated})
        pair_term, row = {}, {groups[g]: 0.0 for g in net.prefill + net.decode}
        for p in net.prefill:
            gp = groups[p]
            for d in net.decode:
                gd = groups[d]
                w = 1.0 - y[gp] - y[gd] - zl(net.edge_load.get((p, d), {})) - zn[gp] - zn[gd]
                t = w * min(net.edge_cap.get((p, d), 0.0), 1e15) if w > 0 else 0.0
                pair_term[(gp, gd)] = t
                row[gp] += t
                row[gd] += t
        return NeighbourBound(tuple(groups), z, sum(v * net.resource_cap[r] for r, v in z.items()), y, zn,
                              node_term, pair_term, row, sum(pair_term.values()),
                              {groups[g]: free_nodes.get(g, 0.0) for g in net.prefill + net.decode}, free_value)

    def bound(self, key, net: FlowNetwork, column: Callable[[int, int], tuple[float, dict[str, float]]],
              node_load: Callable[[int], dict[str, float]]) -> float | None:
        """A bound (requests per T) on the LP of the candidate ``key`` whose groups' capacities
        ``net`` holds (KV edges not built), or None where it cannot be shown to bound its score.
        ``column(p, d)``: the (capacity, loads) of a KV column of the candidate; ``node_load(g)``:
        a group's own bytes per request; both asked only for the groups the base lacks."""
        if not (net.prefill and net.decode):
            return None
        live = {key[g] for g in net.prefill + net.decode + net.colocated}
        removed = [g for g in self.node_term if g not in live]
        added = [i for i in net.prefill + net.decode + net.colocated if key[i] not in self.node_term]
        z = self.z

        def zl(load: dict[str, float]) -> float:
            return sum(z[r] * b for r, b in load.items() if r in z) if z else 0.0

        zn = {i: (self.zn[key[i]] if key[i] in self.zn else zl(node_load(i)))
              for i in net.prefill + net.decode + net.colocated}
        y: dict[int, float | None] = {i: self.y.get(key[i]) for i in net.prefill + net.decode}
        new = [i for i in net.prefill + net.decode if y[i] is None]
        # the columns of the added groups: capacity and z · KV bytes
        cols: dict[tuple[int, int], tuple[float, float]] = {}
        for i in new:
            for o in (net.decode if key[i].role == "prefill" else net.prefill):
                e = (i, o) if key[i].role == "prefill" else (o, i)
                if e not in cols:
                    cap, load = column(*e)
                    cols[e] = (cap, zl(load))
        ze = {e: v[1] for e, v in cols.items()}
        if new:
            sub = FlowNetwork(net.prefill, net.decode, net.node_cap, {e: v[0] for e, v in cols.items()})
            dec = set(net.decode)
            for _ in range(2 if len(new) > 1 else 1):  # as ``flow.dual_bound`` prices new groups
                for i in new:
                    y[i] = _best_price(sub, i, i in dec, y, ze, zn)
        total = self.resource_term
        total += sum(self.node_term[key[i]] for i in net.prefill + net.decode + net.colocated if key[i] in self.node_term)
        total += sum((y[i] or 0.0) * net.node_cap[i] for i in new)
        total += sum(net.node_cap[i] * max(0.0, 1.0 - zn[i]) for i in added if key[i].role == "colocated")
        # columns between kept groups: the base's, less those of the groups removed
        pairs = self.pairs_total - sum(self.row[g] for g in removed if g in self.row)
        removed_pre = [g for g in removed if g in self.y and g.role == "prefill"]
        removed_dec = [g for g in removed if g in self.y and g.role == "decode"]
        pairs += sum(self.pair_term[(p, d)] for p in removed_pre for d in removed_dec)
        for (p, d), (cap, zkv) in cols.items():
            w = 1.0 - (y[p] or 0.0) - (y[d] or 0.0) - zkv - zn[p] - zn[d]
            if w > 0:
                pairs += w * min(cap, 1e15)
        total += max(0.0, pairs)
        return total if total < self._free_flow(key, net, removed, new, cols) * (1 - 1e-9) else None

    def _free_flow(self, key, net: FlowNetwork, removed, new, cols) -> float:
        """A feasible flow of the candidate's network without resources, plus its colocated
        capacity: a lower bound on what ``Evaluator._bound_without_resources`` would compute.
        The base's max flow less what it sent through the removed groups, then, greedily, what
        each added group can send or take over its columns within the capacity the base's flow
        left on the other groups."""
        free = self.free_value - sum(self.free_flow.get(g, 0.0) for g in removed)
        left = {i: net.node_cap[i] - self.free_flow.get(key[i], 0.0) for i in net.prefill + net.decode}
        # a column between two added groups is met from both ends: what the first sent over it
        # is gone for the second (counted twice, the "feasible" flow exceeded the max flow)
        room = {e: cap for e, (cap, _) in cols.items()}
        for i in new:
            sent = 0.0
            for e in cols:
                if i not in e:
                    continue
                o = e[1] if e[0] == i else e[0]
                x = min(room[e], left[o], left[i] - sent)
                if x > 0:
                    left[o] -= x
                    room[e] -= x
                    sent += x
            left[i] -= sent
            free += sent
        return free + sum(net.node_cap[c] for c in net.colocated)
