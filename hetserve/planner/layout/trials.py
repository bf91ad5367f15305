"""The layout alternatives a pool layout's groups may switch to when its KV edges bind, for
``pool.Evaluator``.

Every group starts from its capacity-best layout. When the max flow then falls short of
min(Σ prefill, Σ decode) capacity — KV edges limit it — the evaluator also tries the groups'
KV-friendlier alternatives (``LayoutSearch.options``) and keeps the combination with the largest
max flow: all combinations, by branch and bound on that capacity bound, when there are at most
``EXHAUSTIVE_PRODUCT`` of them (always, with ``exhaustive_layouts``, which the exact search sets),
otherwise coordinate ascent over the groups the flow leaves unsaturated. No alternative has more
capacity than the best, so when the flow already meets the bound there is nothing to try, and
the bound stays valid for pruning.
"""

from __future__ import annotations

from hetserve.planner.pool.flow import FlowNetwork, max_flow_nodes, max_flow_total, solve_fast

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


class LayoutTrials:
    """``_choose_layouts`` and its trials; mixed into ``pool.Evaluator`` (reads its
    ``_options``, ``_kv``, ``_add_loads``, ``exhaustive_layouts`` and counts ``layout_trials``)."""

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
