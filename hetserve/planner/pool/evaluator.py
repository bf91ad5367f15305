"""A pool layout (device groups with roles) and its value under the cost model.

Every algorithm searches over pool layouts and is scored by the same ``Evaluator``, so their
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

The ``Plan`` an evaluated pool layout becomes is written by ``planner.estimate.to_plan``.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import repeat
from typing import Iterable, Sequence

from hetserve.cost.layout import ReplicaLayout
from hetserve.planner.pool.bounded_choice import BoundedChoice
from hetserve.planner.context import PlanContext
from hetserve.planner.pool.flow import FlowNetwork, FlowResult, _dinic, max_flow_nodes, max_flow_total, solve, solve_fast
from hetserve.planner.pool.capacity_sums import CapacitySums, bound_requests
from hetserve.planner.pool.groups import Group, PoolLayout, canonical
from hetserve.planner.layout.trials import (LayoutTrials)
from hetserve.planner.bound.neighbour import NeighbourBound
from hetserve.planner.options import Budget, PlanOptions
from hetserve.planner.pool.pending import Pending

MAX_EDIT_CHAIN = 8  # edits followed back to a pool layout with kept capacity sums, at most
MAX_KEPT_SUMS = 64  # pool layouts whose capacity sums are kept (all dropped past it)


@dataclass
class Evaluation:
    """A pool layout priced in full: layouts, capacities, and (disaggregated) the solved flow."""

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


class Evaluator(LayoutTrials, BoundedChoice):
    """Scores pool layouts for one ``PlanContext``; caches scores by canonical pool layout.

    Layouts: every group starts from its capacity-best layout; where KV edges bind, the groups'
    KV-friendlier alternatives are tried (``layout_trials.LayoutTrials``). A search step's
    candidates are compared by ``best_of`` (``bounded_choice.BoundedChoice``): bounds first,
    flows only for the candidates that may win.
    """

    def __init__(self, ctx: PlanContext, exhaustive_layouts: bool = False):
        self.ctx = ctx
        self.exhaustive_layouts = exhaustive_layouts
        self._scores: dict[tuple[Group, ...], float] = {}
        self._choices: dict[tuple[Group, ...], tuple[int, ...]] = {}
        self._fixed_caps: dict[tuple[ReplicaLayout, str], float] = {}
        self.evaluations = 0  # distinct pool layouts scored
        # LP prices (per group, per byte of a resource) of the last evaluated pool layout: bound
        # its neighbours' LPs by weak duality (``_dual_bound``)
        self._prices: tuple[dict[Group, float], dict[str, float]] | None = None
        self.layout_trials = 0  # max flows solved while choosing alternative layouts
        # LP results of pool layouts scored since the last ``evaluate``: the one it keeps was
        # usually just scored, and its flow needs that very LP (``flow.solve``)
        self._solved: dict[tuple[Group, ...], FlowResult] = {}
        self._neighbour: NeighbourBound | None = None  # ``_prices``' pool layout's dual terms
        # capacity sums of the pool layouts a search step's candidates were edited from (``_capacity_bound``)
        self._sums: dict[PoolLayout, CapacitySums] = {}
        self.colocated_cuts: dict[tuple, list[tuple[int, ...]]] = {}  # composition -> ``mixing._colocated_cut``

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
        """A pool layout's layouts, capacities and capacity bound, its KV edges not yet built."""
        ctx = self.ctx
        layouts: list[ReplicaLayout | None] = []
        caps: list[float] = []
        for i, g in enumerate(groups):
            if choice is None or choice[i] == 0:
                best = self._best(g)
            else:
                best = self._options(g)[choice[i]]
            if best is None:
                layouts.append(None)
                caps.append(0.0)
            else:
                layouts.append(best[0])
                caps.append(best[1])
        net = self._empty_network(groups, caps)
        colocated = sum(net.node_cap[c] for c in net.colocated)
        bound = ctx.tokens_per_s(bound_requests(zip((g.role for g in groups), caps)))
        return Pending(tuple(groups), layouts, caps, net, colocated, bound, tuple(choice or (0,) * len(groups)))

    def _best(self, g: Group) -> tuple[ReplicaLayout, float] | None:
        """A group's best layout and capacity (a ``Group`` is its own layout-cache key)."""
        return self.ctx.layouts.best_of_key(g) if g.devices else None

    def _best_capacity(self, g: Group) -> float:
        """Capacity of a group's best layout (0 when none fits), as ``_pending`` reads it."""
        best = self._best(g)
        return 0.0 if best is None else best[1]

    def _capacity_bound(self, groups: Sequence[Group]) -> float:
        """``_pending(groups).bound`` without the rest of ``_pending``: for a pool layout edited
        from another (``PoolLayout.edited``), that one's capacity sums updated by the groups it
        dropped and added (``capacity_sums``: the same float)."""
        if type(groups) is not PoolLayout or groups.parent is None:
            return self.ctx.tokens_per_s(bound_requests((g.role, self._best_capacity(g)) for g in groups))
        return self.ctx.tokens_per_s(self._capacity_sums(groups).requests())

    def _capacity_sums(self, groups: Sequence[Group], depth: int = 0) -> CapacitySums:
        """Capacity sums of a pool layout; those of the layouts candidates are edited from are
        kept (a step's candidates share one, and the next step's share the one it picks)."""
        parent = groups.parent if type(groups) is PoolLayout else None
        if parent is None or depth >= MAX_EDIT_CHAIN:
            return CapacitySums.of((g.role, self._best_capacity(g)) for g in groups)
        base = self._sums.get(parent)
        if base is None:
            if len(self._sums) >= MAX_KEPT_SUMS:
                self._sums.clear()
            base = self._sums[parent] = self._capacity_sums(parent, depth + 1)
        cap = self._best_capacity
        return base.edited([(g.role, cap(g)) for g in groups.dropped], [(g.role, cap(g)) for g in groups.added])

    def _build(self, c: "Pending") -> None:
        """Fill in a pending pool layout's KV edges and resource loads."""
        if c.built:
            return
        c.built = True
        c.net.edge_cap = self._kv_edges(c.key, c.layouts, c.choice, c.net.prefill, c.net.decode)
        self._add_loads(c.key, c.layouts, c.choice, c.net)

    def _empty_network(self, groups: Sequence[Group], caps: Sequence[float]) -> FlowNetwork:
        """Groups and their capacities as a flow network, KV edges and loads not yet filled in."""
        by_role: dict[str, list[int]] = {"prefill": [], "decode": [], "colocated": []}
        for i, g in enumerate(groups):
            if caps[i] > 0:
                by_role[g.role].append(i)
        pre, dec, col = by_role["prefill"], by_role["decode"], by_role["colocated"]
        return FlowNetwork(pre, dec, {i: caps[i] for i in pre + dec + col}, {}, colocated=col,
                           resource_cap=self.ctx.resource_cap)

    def _add_loads(self, groups, layouts, choice, net: FlowNetwork, changed=None) -> None:
        """Fill in the bytes per request each route and group puts on the shared resources
        (``changed``: only those of routes and groups touching these groups)."""
        if not net.resource_cap:
            return
        ctx = self.ctx
        for g in (net.prefill + net.decode + net.colocated if changed is None else changed):
            net.node_load[g] = ctx.node_load(layouts[g], groups[g].role)
        if changed is None:
            self._fill_pairs(groups, layouts, choice, net.prefill, net.decode, ctx._kv_load_cache, ctx.kv_load,
                             net.edge_load)
            return
        for p in net.prefill:
            for d in net.decode:
                if p in changed or d in changed:
                    net.edge_load[(p, d)] = self._kv_pair_value(groups, layouts, choice, p, d, ctx.kv_load)

    def _kv(self, groups, layouts, choice, p: int, d: int) -> float:
        return self._kv_pair_value(groups, layouts, choice, p, d, self.ctx.kv_capacity)

    def _kv_pair_value(self, groups, layouts, choice, p: int, d: int, price):
        """``price`` (``PlanContext.kv_capacity`` or ``kv_load``) of the p → d hand-off, cached by
        the two groups' ids."""
        ctx = self.ctx
        key = (ctx.group_id(groups[p].devices, choice[p]), ctx.group_id(groups[d].devices, choice[d]))
        return price(layouts[p], layouts[d], key)

    def _kv_edges(self, groups, layouts, choice, pre, dec) -> dict[tuple[int, int], float]:
        """Every p → d KV-edge capacity."""
        out: dict[tuple[int, int], float] = {}
        self._fill_pairs(groups, layouts, choice, pre, dec, self.ctx._kv_cache, self.ctx.kv_capacity, out)
        return out

    def _fill_pairs(self, groups, layouts, choice, pre, dec, cache: dict, price, out: dict) -> None:
        """``out[(p, d)]`` for every prefill p × decode d, p-major: ``cache`` read by the two groups'
        ids, ``price`` (``kv_capacity`` / ``kv_load``) on a miss. Row by row with C-level
        iteration (``map``/``zip``): at thousands of GPUs a network has ~10⁵ pairs."""
        ctx = self.ctx
        ids = [ctx.group_id(groups[d].devices, choice[d]) for d in dec]
        for p in pre:
            ip = ctx.group_id(groups[p].devices, choice[p])
            row = list(map(cache.get, zip(repeat(ip), ids)))
            if None in row:
                for j, value in enumerate(row):
                    if value is None:
                        row[j] = price(layouts[p], layouts[dec[j]], (ip, ids[j]))
            out.update(zip(zip(repeat(p), dec), row))

    def score(self, groups: Iterable[Group], floor: float = -1.0) -> float:
        """Estimated tokens/s of a pool layout (scipy max flow; cached).

        With ``floor`` ≥ 0, a pool layout whose capacity upper bound cannot beat ``floor`` is
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

    def _solve(self, c: "Pending") -> float:
        """Score a built pending pool layout in full: its flow, then (where KV edges bind) the
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
