"""Which of a search step's candidate pool layouts serves most, with few flows solved, for
``pool.Evaluator`` (``best_of``).

Each candidate is bounded before it is solved: first by its capacity (min(Σ prefill, Σ decode)
+ colocated; ``Evaluator._capacity_bound``, the candidate's network built only once it is
popped), then — where a shared resource surely binds — by weak duality with the last priced
pool layout's LP prices (``_neighbour_bound`` from that pool layout's terms, else ``_dual_bound`` on
the candidate's whole network). Flows are solved best bound first until no bound left can reach
the best value found; a candidate behind the pick whose bound is within a rounding error of it
(a tie: it cannot come first) is not solved.
"""

from __future__ import annotations

import heapq
import math
from typing import Callable, Sequence

from hetserve.planner.pool.flow import dual_bound
from hetserve.planner.pool.groups import Group, canonical
from hetserve.planner.pool.pending import Pending
from hetserve.planner.layout.trials import MAX_LAYOUT_ROUNDS_SHARED


# ``Evaluator.best_of`` reads a bound as this much higher: a value the flow or LP computes may sit
# a rounding error above a bound computed by another sum (and ties are decided by list order)
BOUND_SLACK = 1 + 1e-9
# ... but a candidate behind the pick is skipped once its bound, read only this much higher, is
# within ``rel`` of the pick: a tie (pool layouts alike up to a swap of alike sites score the same,
# and their capacity bounds are that score to a rounding error) can neither beat the pick nor
# come before it in list order, so its flow is not solved
TIE_SLACK = 1 + 1e-12


class BoundedChoice:
    """``best_of`` and the bounds it reads; mixed into ``pool.Evaluator`` (reads its
    ``_scores``, ``_pending``, ``_build``, ``_solve``, ``_prices``, ``_neighbour``)."""

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
        pending: dict[int, Pending] = {}  # built when first popped (most candidates never are)
        keys: dict[int, tuple[Group, ...]] = {}
        heap: list[tuple[float, int]] = []
        for i, cand in enumerate(candidates):
            key = canonical(cand)
            hit = self._scores.get(key)
            if hit is not None:
                if beats(hit):
                    exact[i] = hit
                continue
            bound = self._capacity_bound(key)
            if beats(bound):
                keys[i] = key
                heap.append((-bound * BOUND_SLACK, i))
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
            c = pending.get(i)
            if c is None:
                c = pending[i] = self._pending(keys[i])
            if first is not None and i > first and c.bound * TIE_SLACK <= top * (1 + rel):
                continue  # can neither beat the pick nor tie it ahead of it
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

    def _neighbour_bound(self, c: "Pending") -> float | None:
        """``_dual_bound`` of a pending pool layout from the last priced pool layout's terms, its KV
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
        """A bound (tokens/s) on a built pending pool layout's score without solving its LP:
        weak duality with the last evaluated pool layout's prices (``flow.dual_bound``; most
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
