"""KV route choice: which decode replica receives a finished prefill.

Candidates are the plan's KV routes out of the prefill replica, as ``(ReplicaState, weight)``.

* ``flow`` — follow the plan's flow weights (HexGen-2: routes proportional to the max-flow),
  deterministically by smooth weighted round robin (nginx's SWRR): over any window of W = Σw
  decisions each route gets its share within one request, with no RNG.
* ``load`` — load-aware: the candidate with the fewest waiting + running requests per unit of
  route weight, ``(load + 1) / weight`` (ties: fewer outstanding tokens, then plan order). Zero-
  weight routes are never chosen while a weighted one exists.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Callable, Sequence

from hetserve.policies.base import ReplicaState, RequestInfo, RoutePolicy
from hetserve.policies.placement import PolicyContext

if TYPE_CHECKING:  # pragma: no cover
    from hetserve.planner.plan import Plan


def route_candidates(plan: "Plan", src: str, decoders: Sequence[str]) -> list[tuple[str, float]]:
    """The KV routes a route policy chooses among for prefill replica ``src``: the plan's routes out
    of it to replicas in ``decoders`` (the live decode replicas, in plan order), or every one of
    ``decoders`` at weight 1 when it has none. Used by the simulator and the runtime alike."""
    live = set(decoders)
    routes: dict[str, float] = {}
    for k in plan.routes_from(src):
        if k.dst in live:
            routes[k.dst] = routes.get(k.dst, 0.0) + k.weight
    return list(routes.items()) or [(d, 1.0) for d in decoders]


class FlowWeighted:
    name = "flow"

    def __init__(self, ctx: PolicyContext | None = None):
        self._current: dict[tuple[str, str], float] = {}

    def choose(self, request: RequestInfo, src: str, candidates: Sequence[tuple[ReplicaState, float]],
               now: float) -> str:
        weighted = [(s, w) for s, w in candidates if w > 0] or [(s, 1.0) for s, _ in candidates]
        total = sum(w for _, w in weighted)
        best_id, best_val = weighted[0][0].id, float("-inf")
        cur = self._current
        for s, w in weighted:
            v = cur.get((src, s.id), 0.0) + w
            cur[(src, s.id)] = v
            if v > best_val:
                best_id, best_val = s.id, v
        cur[(src, best_id)] -= total
        return best_id


class LoadAware:
    name = "load"

    def __init__(self, ctx: PolicyContext | None = None):
        pass

    def choose(self, request: RequestInfo, src: str, candidates: Sequence[tuple[ReplicaState, float]],
               now: float) -> str:
        weighted = [(s, w) for s, w in candidates if w > 0] or [(s, 1.0) for s, _ in candidates]
        return min(weighted, key=lambda sw: ((sw[0].load + 1) / sw[1], sw[0].outstanding_tokens))[0].id


RouteFactory = Callable[[PolicyContext], RoutePolicy]
ROUTE_POLICIES: dict[str, RouteFactory] = {"flow": FlowWeighted, "load": LoadAware}
DEFAULT_ROUTE = "flow"  # the plan's KV-route weights: what the planner's flow promised
_LAZY_ROUTE: dict[str, str] = {"aladdin": "hetserve.policies.aladdin_route"}


def register_route(name: str, factory: RouteFactory) -> None:
    ROUTE_POLICIES[name] = factory


def route_names() -> list[str]:
    return sorted(set(ROUTE_POLICIES) | set(_LAZY_ROUTE))


def make_route(name: str, ctx: PolicyContext | None = None) -> RoutePolicy:
    if name not in ROUTE_POLICIES and name in _LAZY_ROUTE:
        importlib.import_module(_LAZY_ROUTE[name])
    if name not in ROUTE_POLICIES:
        raise ValueError(f"unknown route policy {name!r}; choose one of {', '.join(route_names())}")
    return ROUTE_POLICIES[name](ctx or PolicyContext())
