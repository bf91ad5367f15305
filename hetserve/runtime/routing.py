"""Which decode replica receives a prefill replica's KV: a policy object, plan-weighted by default.

``KVRoutePolicy.choose(src, candidates)`` returns one of ``candidates`` (alive decode replicas).
``WeightedRoutes`` follows the plan's KV-route weights with smooth weighted round robin (each
choice adds every weight to a running credit and picks the largest, then debits it by the total),
so over any window the share of requests sent to each decode replica tracks its weight, without
randomness. Routes to replicas that are not candidates are skipped; a prefill replica without
routes spreads evenly. Pure Python, so the simulator's policies can replace it one-for-one.
"""

from __future__ import annotations

from typing import Protocol

from hetserve.planner.plan import Plan


class KVRoutePolicy(Protocol):
    def choose(self, src: str, candidates: list[str]) -> str: ...


class WeightedRoutes:
    def __init__(self, weights: dict[str, dict[str, float]]):
        self.weights = weights
        self._credit: dict[tuple[str, str], float] = {}

    @staticmethod
    def from_plan(plan: Plan) -> "WeightedRoutes":
        weights: dict[str, dict[str, float]] = {}
        for k in plan.kv_routes:
            weights.setdefault(k.src, {})[k.dst] = weights.get(k.src, {}).get(k.dst, 0.0) + k.weight
        return WeightedRoutes(weights)

    def choose(self, src: str, candidates: list[str]) -> str:
        if not candidates:
            raise ValueError("no decode replica to route to")
        w = {d: x for d, x in self.weights.get(src, {}).items() if d in candidates and x > 0}
        if not w:
            w = {d: 1.0 for d in candidates}
        total = sum(w.values())
        for d, x in w.items():
            self._credit[(src, d)] = self._credit.get((src, d), 0.0) + x
        best = max(w, key=lambda d: self._credit[(src, d)])
        self._credit[(src, best)] -= total
        return best
