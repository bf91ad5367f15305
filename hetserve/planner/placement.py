"""A placement (device groups with roles) and its value under the cost model.

Every algorithm searches over placements and is scored by the same ``Evaluator``, so their
numbers compare fairly:

* each group gets its best layout for its role (``LayoutSearch``) and that layout's capacity in
  requests per period T — or, where KV links limit the flow, the combination of per-group
  alternatives (``LayoutSearch.options``) with the largest max flow; a group whose devices
  cannot hold a replica has capacity 0 and its devices stay idle (it is left out of the plan);
* prefill and decode groups form the flow network of HexGen-2 §3.2; its max flow is the
  disaggregated part's requests per T;
* every route's KV bytes, and each group's own PP / TP bytes between machines, load the shared
  NICs and site pipes they cross: capacity nodes of the same network (``flow``); colocated
  groups add their capacities, less what a saturated shared resource takes from them;
* throughput = requests per T × mean output tokens / T (``PlanContext.tokens_per_s``).

The ``Plan`` an evaluated placement becomes is written by ``planner.estimate.to_plan``.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from hetserve.cost.layout import ReplicaLayout
from hetserve.planner.context import PlanContext
from hetserve.planner.flow import (FlowNetwork, FlowResult, _dinic, dual_bound, max_flow_nodes, max_flow_total, solve,
                                   solve_fast)
from hetserve.planner.neighbour_bound import NeighbourBound
from hetserve.planner.options import Budget, PlanOptions

# Alternative layouts (see ``Evaluator``): enumerate all combinations up to this many, else
# coordinate ascent over at most this many unsaturated groups for at most this many rounds.
EXHAUSTIVE_PRODUCT = 64
MAX_LAYOUT_GROUPS = 8
MAX_LAYOUT_ROUNDS = 4
# ... and where a shared NIC / pipe binds (every trial is then a linear program): none, unless
# the search asks for exhaustive layouts (exact). Spreading KV over more device pairs (what most
# alternatives do) gains nothing once a shared NIC, not a pair, is the bottleneck; measured on
# hexgen2-het1 (every KV route crosses a 3 Gbit/s pipe) the ascent cost 60 % of the search time.
MAX_LAYOUT_GROUPS_SHARED = 3
MAX_LAYOUT_ROUNDS_SHARED = 0
# ``Evaluator.best_of`` reads a bound as this much higher: a value the flow or LP computes may sit
# a rounding error above a bound computed by another sum (and ties are decided by list order)
BOUND_SLACK = 1 + 1e-9


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


@dataclass
class Pending:
    """A placement part-way through ``Evaluator.score``: its groups' layouts (``choice``: index
    into each group's options) and capacities, its flow network (KV edges and loads filled in
    once ``built``) and the best bound (tokens/s) known on its score."""

    key: tuple[Group, ...]
    layouts: list[ReplicaLayout | None]
    caps: list[float]
    net: FlowNetwork
    colocated: float  # requests per T the colocated groups serve
    bound: float
    choice: tuple[int, ...]
    built: bool = False
    tightened: bool = False  # ``bound`` is the duality bound where one applies


class Evaluator:
    """Scores placements for one ``PlanContext``; caches scores by canonical placement.

    Layouts: every group starts from its capacity-best layout. When the max flow then falls
    short of min(Σ prefill, Σ decode) capacity — KV edges limit it — the evaluator also tries
    the group's KV-friendlier alternatives (``LayoutSearch.options``) and keeps the combination
    with the largest max flow: all combinations, by branch and bound on that capacity bound,
    when there are at most ``EXHAUSTIVE_PRODUCT`` of them (always, with ``exhaustive_layouts``,
    which the exact search sets), otherwise coordinate ascent over the groups the flow leaves
    unsaturated. No alternative has more capacity than the best, so when the flow already meets
    the bound there is nothing to try, and the bound stays valid for pruning.
    """

    def __init__(self, ctx: PlanContext, exhaustive_layouts: bool = False):
        self.ctx = ctx
        self.exhaustive_layouts = exhaustive_layouts
        self._scores: dict[tuple[Group, ...], float] = {}
        self._choices: dict[tuple[Group, ...], tuple[int, ...]] = {}
        self._fixed_caps: dict[tuple[ReplicaLayout, str], float] = {}
        self.evaluations = 0  # distinct placements scored
        # LP prices (per group, per byte of a resource) of the last evaluated placement: bound
        # its neighbours' LPs by weak duality (``_dual_bound``)
        self._prices: tuple[dict[Group, float], dict[str, float]] | None = None
        self.layout_trials = 0  # max flows solved while choosing alternative layouts
        # LP results of placements scored since the last ``evaluate``: the one it keeps was
        # usually just scored, and its flow needs that very LP (``flow.solve``)
        self._solved: dict[tuple[Group, ...], FlowResult] = {}
        self._neighbour: NeighbourBound | None = None  # ``_prices``' placement's dual terms

    def capacity(self, devices: Sequence[int], role: str) -> float:
        return self.ctx.layouts.capacity(devices, role)

    def _options(self, g: Group) -> tuple[tuple[ReplicaLayout, float], ...]:
        """(layout, capacity) choices of a group, best first; () if it holds no replica."""
        if not g.devices:
            return ()
        if g.role == "colocated":  # colocated capacity is additive: only the best matters
            best = self.ctx.layouts.best(g.devices, g.role)
            return () if best is None else (best,)
        return self.ctx.layouts.options(g.devices, g.role)

    def _network(self, groups: Sequence[Group], choice: Sequence[int] | None = None, floor: float = -1.0):
        """(layouts, capacities, flow network, colocated requests per T) for a layout ``choice``
        (index into each group's options; None = the best of each).

        With ``floor`` ≥ 0 and a capacity bound that cannot beat it, the KV edges are not built
        (the network's ``edge_cap`` stays empty and only its ``upper_bound`` is meaningful)."""
        c = self._pending(groups, choice)
        if floor < 0 or c.bound > floor:
            self._build(c)
        return c.layouts, c.caps, c.net, c.colocated

    def _pending(self, groups: Sequence[Group], choice: Sequence[int] | None = None) -> "Pending":
        """A placement's layouts, capacities and capacity bound, its KV edges not yet built."""
        ctx = self.ctx
        layouts: list[ReplicaLayout | None] = []
        caps: list[float] = []
        for i, g in enumerate(groups):
            if choice is None or choice[i] == 0:
                best = ctx.layouts.best(g.devices, g.role) if g.devices else None
            else:
                best = self._options(g)[choice[i]]
            layouts.append(None if best is None else best[0])
            caps.append(0.0 if best is None else best[1])
        net = self._empty_network(groups, caps)
        colocated = sum(net.node_cap[c] for c in net.colocated)
        bound = ctx.tokens_per_s((net.upper_bound() if net.prefill and net.decode else 0.0) + colocated)
        return Pending(tuple(groups), layouts, caps, net, colocated, bound, tuple(choice or (0,) * len(groups)))

    def _build(self, c: "Pending") -> None:
        """Fill in a pending placement's KV edges and resource loads."""
        if c.built:
            return
        c.built = True
        c.net.edge_cap = self._kv_edges(c.key, c.layouts, c.choice, c.net.prefill, c.net.decode)
        self._add_loads(c.key, c.layouts, c.choice, c.net)

    def _empty_network(self, groups: Sequence[Group], caps: Sequence[float]) -> FlowNetwork:
        """Groups and their capacities as a flow network, KV edges and loads not yet filled in."""
        pre = [i for i, g in enumerate(groups) if g.role == "prefill" and caps[i] > 0]
        dec = [i for i, g in enumerate(groups) if g.role == "decode" and caps[i] > 0]
        col = [i for i, g in enumerate(groups) if g.role == "colocated" and caps[i] > 0]
        return FlowNetwork(pre, dec, {i: caps[i] for i in pre + dec + col}, {}, colocated=col,
                           resource_cap=self.ctx.resource_cap)

    def _add_loads(self, groups, layouts, choice, net: FlowNetwork, changed=None) -> None:
        """Fill in the bytes per request each route and group puts on the shared resources."""
        if not net.resource_cap:
            return
        ctx = self.ctx
        for g in (net.prefill + net.decode + net.colocated if changed is None else changed):
            net.node_load[g] = ctx.node_load(layouts[g], groups[g].role)
        ids = {g: ctx.group_id(groups[g].devices, choice[g]) for g in net.prefill + net.decode}
        cache, edge_load = ctx._kv_load_cache, net.edge_load
        for p in net.prefill:
            ip = ids[p]
            for d in net.decode:
                if changed is None or p in changed or d in changed:
                    key = (ip, ids[d])
                    load = cache.get(key)
                    edge_load[(p, d)] = load if load is not None else ctx.kv_load(layouts[p], layouts[d], key)

    def _kv(self, groups, layouts, choice, p: int, d: int) -> float:
        ctx = self.ctx
        key = (ctx.group_id(groups[p].devices, choice[p]), ctx.group_id(groups[d].devices, choice[d]))
        return ctx.kv_capacity(layouts[p], layouts[d], key)

    def _kv_edges(self, groups, layouts, choice, pre, dec) -> dict[tuple[int, int], float]:
        """Every p → d KV-edge capacity (the loop of ``_kv`` inlined: it runs millions of times
        on large pools)."""
        ctx = self.ctx
        ids = {g: ctx.group_id(groups[g].devices, choice[g]) for g in pre + dec}
        cache, out = ctx._kv_cache, {}
        for p in pre:
            ip = ids[p]
            for d in dec:
                key = (ip, ids[d])
                cap = cache.get(key)
                out[(p, d)] = cap if cap is not None else ctx.kv_capacity(layouts[p], layouts[d], key)
        return out

    def score(self, groups: Iterable[Group], floor: float = -1.0) -> float:
        """Estimated tokens/s of a placement (scipy max flow; cached).

        With ``floor`` ≥ 0, a placement whose capacity upper bound cannot beat ``floor`` is
        scored by that bound without solving the flow (callers only compare against ``floor``).
        """
        key = canonical(groups)
        hit = self._scores.get(key)
        if hit is not None:
            return hit
        c = self._pending(key)
        if floor >= 0 and c.bound <= floor:
            return c.bound
        self._build(c)
        if floor >= 0:
            pruned = self._dual_bound(c, floor)
            if pruned is not None:
                return pruned
        return self._solve(c)

    def best_of(self, candidates: Sequence[Sequence[Group]], floor: float, stop: Callable[[], bool] | None = None,
                rel: float = 1e-9, margin: float = 1e-12) -> tuple[int | None, float]:
        """(index, tokens/s) of the candidate that serves most, if it beats ``floor``
        (v > floor·(1 + rel) + margin); among candidates within ``rel`` of that best, the first
        in list order. (None, floor) when none beats it.

        What a scan scoring each candidate against the best so far (``score(c, floor=best)``)
        returns, with far fewer flows solved: every candidate's capacity bound first, then, best
        bound first, the bound tightened by weak duality (its KV edges built), then its flow
        solved, until no bound left can reach the best value found. A scan solves every
        candidate that beats the best *so far*; most of them lose to a later one. ``stop``
        (the search budget) ends it early with the best found so far."""
        def beats(v: float) -> bool:
            return v > floor * (1 + rel) + margin

        exact: dict[int, float] = {}
        pending: dict[int, Pending] = {}
        heap: list[tuple[float, int]] = []
        for i, cand in enumerate(candidates):
            key = canonical(cand)
            hit = self._scores.get(key)
            if hit is not None:
                if beats(hit):
                    exact[i] = hit
                continue
            c = self._pending(key)
            if beats(c.bound):
                pending[i] = c
                heap.append((-c.bound * BOUND_SLACK, i))
        heapq.heapify(heap)
        top, first = -math.inf, None  # the best value found, the first candidate within rel of it

        def settle(i: int, v: float) -> None:
            nonlocal top, first
            exact[i] = v
            top = max(top, v)
            first = min(j for j, u in exact.items() if u >= top * (1 - rel))

        for i, v in list(exact.items()):
            settle(i, v)
        while heap and -heap[0][0] >= top * (1 - rel) and not (stop is not None and stop()):
            b, i = heapq.heappop(heap)
            if -b <= top * (1 + rel) and i > first:  # can neither beat the pick nor tie it ahead of it
                continue
            c = pending[i]
            if not c.tightened:  # tighten its bound first: solve it only if it still leads
                c.tightened = True
                dual = self._neighbour_bound(c)
                if dual is None:  # the whole network, then
                    self._build(c)
                    dual = self._dual_bound(c)
                if dual is not None and dual < c.bound:
                    c.bound = dual
                if beats(c.bound):
                    heapq.heappush(heap, (-c.bound * BOUND_SLACK, i))
                continue
            self._build(c)
            v = self._scores.get(c.key)
            v = self._solve(c) if v is None else v
            if beats(v):
                settle(i, v)
        return (None, floor) if first is None else (first, exact[first])

    def _solve(self, c: "Pending") -> float:
        """Score a built pending placement in full: its flow, then (where KV edges bind) the
        best combination of layout alternatives; cached."""
        key, layouts, caps, net, colocated = c.key, c.layouts, c.caps, c.net, c.colocated
        self.evaluations += 1
        if net.loads_resources():
            flow = solve_fast(net)
            value, nodes = flow.total, flow.node_flow
        else:
            value, nodes = max_flow_nodes(net, nodes=not self.exhaustive_layouts)
            value += colocated
        choice = (0,) * len(key)
        if net.prefill and net.decode and value < (net.upper_bound() + colocated) * (1 - 1e-9):
            known = flow.unconstrained if net.loads_resources() else None
            choice, value = self._choose_layouts(key, layouts, caps, net, value, nodes, known)
        if net.loads_resources() and flow.unconstrained is not None and not any(choice):
            self._solved[key] = flow
        value = self.ctx.tokens_per_s(value)
        self._scores[key] = value
        self._choices[key] = choice
        return value

    def _neighbour_bound(self, c: "Pending") -> float | None:
        """``_dual_bound`` of a pending placement from the last priced placement's terms, its KV
        edges not built (``NeighbourBound``); None where that cannot show it bounds the score."""
        nb, ctx = self._neighbour, self.ctx
        if nb is None or self.exhaustive_layouts or MAX_LAYOUT_ROUNDS_SHARED != 0:
            return None
        key, layouts, choice = c.key, c.layouts, c.choice

        def column(p: int, d: int):
            ids = (ctx.group_id(key[p].devices, choice[p]), ctx.group_id(key[d].devices, choice[d]))
            cap = ctx._kv_cache.get(ids)
            cap = cap if cap is not None else ctx.kv_capacity(layouts[p], layouts[d], ids)
            load = ctx._kv_load_cache.get(ids)
            return cap, load if load is not None else ctx.kv_load(layouts[p], layouts[d], ids)

        requests = nb.bound(key, c.net, column, lambda g: ctx.node_load(layouts[g], key[g].role))
        return None if requests is None else ctx.tokens_per_s(requests) * (1 + 1e-7)

    def _dual_bound(self, c: "Pending", floor: float | None = None) -> float | None:
        """A bound (tokens/s) on a built pending placement's score without solving its LP:
        weak duality with the last evaluated placement's prices (``flow.dual_bound``; most
        neighbours of a search step keep most groups, so the prices fit). Only where a shared
        resource surely binds — the bound is below the max flow that ignores resources — since
        then no layout alternative is tried (``_choose_layouts``) and the score is that LP's
        value. None when it does not apply, or (given a ``floor``) when it is above the floor."""
        net = c.net
        if (self._prices is None or not (net.prefill and net.decode and net.loads_resources())
                or self.exhaustive_layouts or MAX_LAYOUT_ROUNDS_SHARED != 0):
            return None
        prices, resource_prices = self._prices
        requests = dual_bound(net, {i: prices.get(c.key[i]) for i in net.prefill + net.decode}, resource_prices)
        bound = self.ctx.tokens_per_s(requests) * (1 + 1e-7)  # margin for the LP solver's tolerances
        if (floor is not None and bound > floor) or requests >= self._bound_without_resources(net) * (1 - 1e-9):
            return None
        return bound

    # ------------------------------------------------------------------ alternative layouts
    def _choose_layouts(self, groups, layouts, caps, net: FlowNetwork, value: float, nodes: dict[int, float],
                        unconstrained: float | None = None):
        """(choice, requests per T) of the best combination of alternative layouts found
        (``value`` and the result include what colocated groups serve; ``unconstrained``: the
        max flow without resources, ``_bound_without_resources``, when the caller has it)."""
        # a shared resource that binds makes every trial a linear program: a short ascent at most
        if unconstrained is None and not self.exhaustive_layouts:
            unconstrained = self._bound_without_resources(net)
        shared_binds = not self.exhaustive_layouts and value < unconstrained * (1 - 1e-9)
        if shared_binds and MAX_LAYOUT_ROUNDS_SHARED == 0:
            return (0,) * len(groups), value
        opts = {i: self._options(groups[i]) for i in net.prefill + net.decode}
        free = [i for i in net.prefill + net.decode if len(opts[i]) > 1]
        if not free:
            return (0,) * len(groups), value
        product = 1
        for i in free:
            product *= len(opts[i])
        if self.exhaustive_layouts or (product <= EXHAUSTIVE_PRODUCT and not shared_binds):
            return self._enumerate_layouts(groups, opts, free, net, value)
        if shared_binds:
            return self._ascend_layouts(groups, opts, free, layouts, net, value, nodes,
                                        MAX_LAYOUT_ROUNDS_SHARED, MAX_LAYOUT_GROUPS_SHARED)
        return self._ascend_layouts(groups, opts, free, layouts, net, value, nodes)

    def _trial(self, groups, opts, choice, net: FlowNetwork, changed) -> FlowNetwork:
        """``net`` with the groups in ``changed`` switched to ``choice``'s layouts."""
        node_cap = dict(net.node_cap)
        edge_cap = dict(net.edge_cap)
        lay = {i: opts[i][choice[i]][0] for i in net.prefill + net.decode}
        for i in changed:
            node_cap[i] = opts[i][choice[i]][1]
        for i in changed:
            if groups[i].role == "prefill":
                for d in net.decode:
                    edge_cap[(i, d)] = self._kv(groups, lay, choice, i, d)
            else:
                for p in net.prefill:
                    edge_cap[(p, i)] = self._kv(groups, lay, choice, p, i)
        trial = FlowNetwork(net.prefill, net.decode, node_cap, edge_cap, net.colocated, net.resource_cap,
                            dict(net.edge_load), dict(net.node_load))
        self._add_loads(groups, lay, choice, trial, changed=tuple(changed))
        return trial

    @staticmethod
    def _bound_without_resources(net: FlowNetwork) -> float:
        """The max flow (plus colocated capacity) if no shared resource bound it."""
        if not net.loads_resources():
            return -1.0
        return max_flow_nodes(FlowNetwork(net.prefill, net.decode, net.node_cap, net.edge_cap), nodes=False)[0] + \
            sum(net.node_cap[c] for c in net.colocated)

    @staticmethod
    def _bound(net: FlowNetwork) -> float:
        """Requests per T no choice of layouts can beat: min(Σ prefill, Σ decode) + colocated."""
        return net.upper_bound() + sum(net.node_cap[c] for c in net.colocated)

    def _enumerate_layouts(self, groups, opts, free, net: FlowNetwork, value: float):
        """Every combination of the free groups' options, pruned by the capacity bound."""
        best = [value, (0,) * len(groups)]
        choice = [0] * len(groups)
        pre = set(net.prefill)
        # best capacities of the groups not yet assigned, per side, for the bound
        rest_p = [0.0] * (len(free) + 1)
        rest_d = [0.0] * (len(free) + 1)
        for k in range(len(free) - 1, -1, -1):
            i = free[k]
            rest_p[k] = rest_p[k + 1] + (opts[i][0][1] if i in pre else 0.0)
            rest_d[k] = rest_d[k + 1] + (opts[i][0][1] if i not in pre else 0.0)
        fixed_p = sum(net.node_cap[i] for i in net.prefill if i not in free)
        fixed_d = sum(net.node_cap[i] for i in net.decode if i not in free)
        colocated = sum(net.node_cap[c] for c in net.colocated)

        def rec(k: int, cap_p: float, cap_d: float) -> None:
            if min(fixed_p + cap_p + rest_p[k], fixed_d + cap_d + rest_d[k]) + colocated <= best[0] * (1 + 1e-9):
                return
            if k == len(free):
                if any(choice):
                    self.layout_trials += 1
                    v = max_flow_total(self._trial(groups, opts, choice, net, free))
                    if v > best[0] * (1 + 1e-9):
                        best[0], best[1] = v, tuple(choice)
                return
            i = free[k]
            for a, (_, cap) in enumerate(opts[i]):
                choice[i] = a
                rec(k + 1, cap_p + (cap if i in pre else 0.0), cap_d + (cap if i not in pre else 0.0))
            choice[i] = 0

        rec(0, 0.0, 0.0)
        return best[1], best[0]

    def _ascend_layouts(self, groups, opts, free, layouts, net: FlowNetwork, value: float, nodes,
                        rounds: int = MAX_LAYOUT_ROUNDS, max_groups: int = MAX_LAYOUT_GROUPS):
        """Coordinate ascent: switch one group's layout at a time while the max flow grows;
        only groups the flow leaves unsaturated (their KV edges, not their capacity, bind)."""
        choice = [0] * len(groups)
        cur = net
        for _ in range(rounds):
            cands = sorted((i for i in free if nodes.get(i, 0.0) < cur.node_cap[i] * 0.999),
                           key=lambda i: (nodes.get(i, 0.0) / cur.node_cap[i], i))[:max_groups]
            pick = None
            for i in cands:
                for a in range(len(opts[i])):
                    if a == choice[i]:
                        continue
                    trial_choice = choice.copy()
                    trial_choice[i] = a
                    trial = self._trial(groups, opts, trial_choice, cur, (i,))
                    if self._bound(trial) <= value * (1 + 1e-9):
                        continue
                    self.layout_trials += 1
                    v = max_flow_total(trial)
                    if v > value * (1 + 1e-9):
                        value, pick = v, (trial_choice, trial)
            if pick is None:
                break
            choice, cur = pick
            f = solve_fast(cur)
            value, nodes = f.total, f.node_flow
        return tuple(choice), value

    def _fixed_network(self, groups: Sequence[Group], layouts: Sequence[ReplicaLayout]):
        ctx = self.ctx
        caps = []
        for g, lay in zip(groups, layouts):
            key = (lay, g.role)
            if key not in self._fixed_caps:
                self._fixed_caps[key] = ctx.layouts.layout_capacity(lay, g.role)
            caps.append(self._fixed_caps[key])
        net = self._empty_network(groups, caps)
        net.edge_cap = {(p, d): ctx.kv_capacity(layouts[p], layouts[d]) for p in net.prefill for d in net.decode}
        if net.resource_cap:
            for g in net.prefill + net.decode + net.colocated:
                net.node_load[g] = ctx.node_load(layouts[g], groups[g].role)
            for p in net.prefill:
                for d in net.decode:
                    net.edge_load[(p, d)] = ctx.kv_load(layouts[p], layouts[d])
        colocated = sum(net.node_cap[c] for c in net.colocated)
        return caps, net, colocated

    def score_layouts(self, groups: Sequence[Group], layouts: Sequence[ReplicaLayout]) -> float:
        """Tokens/s of groups whose layouts the caller fixes (e.g. the uniform planner)."""
        _, net, colocated = self._fixed_network(groups, layouts)
        self.evaluations += 1
        return self.ctx.tokens_per_s(max_flow_total(net))

    def evaluate_layouts(self, groups: Sequence[Group], layouts: Sequence[ReplicaLayout]) -> Evaluation:
        """Full evaluation of groups with caller-fixed layouts."""
        caps, net, _ = self._fixed_network(groups, layouts)
        flow = solve(net)
        req = flow.total
        return Evaluation(tuple(groups), tuple(layouts), tuple(caps), net, flow, req, self.ctx.tokens_per_s(req))

    def evaluate(self, groups: Iterable[Group]) -> Evaluation:
        """Full evaluation with the flow on every edge (networkx preflow-push), with the layouts
        ``score`` chose."""
        key = canonical(groups)
        if key not in self._choices:
            self.score(key)
        layouts, caps, net, _ = self._network(key, self._choices[key])
        flow = solve(net, self._solved.get(key))
        self._solved.clear()
        if flow.node_dual:
            self._prices = ({key[i]: y for i, y in flow.node_dual.items()}, flow.resource_dual)
            self._neighbour = None
            if not any(self._choices[key]) and net.resource_cap:  # its terms are those of the best layouts
                free_value, free_nodes, _ = _dinic(net, edges=False)
                self._neighbour = NeighbourBound.of(key, net, flow.node_dual, flow.resource_dual,
                                                    free_value, free_nodes)
        req = flow.total
        return Evaluation(key, tuple(layouts), tuple(caps), net, flow, req, self.ctx.tokens_per_s(req))


def start_search(name: str, cluster, model, workload, options: PlanOptions,
                 exhaustive_layouts: bool = False) -> tuple[PlanContext, Budget, Evaluator]:
    """What every algorithm starts from: the context (after the feasibility check, which raises
    InfeasibleError with the numbers), its time/iteration budget and the shared evaluator."""
    ctx = PlanContext(cluster, model, workload, options)
    ctx.check_feasible()
    return ctx, Budget(name, options), Evaluator(ctx, exhaustive_layouts=exhaustive_layouts)
