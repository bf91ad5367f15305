"""Which decode replica receives a prefill replica's KV: the shared route policy, fed live state.

The decision is ``hetserve.policies.routing`` (``flow``: the plan's KV-route weights by smooth
weighted round robin; ``load``; ``aladdin``), the very objects the simulator calls. ``PlanRoutes``
only builds their candidates the way the simulator does (``route_candidates``: the plan's routes
out of the prefill replica to live decode replicas, or every live decode replica evenly when it
has none) with the engine's own snapshot of each decode replica (``hetserve.runtime.snapshot``).
"""

from __future__ import annotations

from typing import Mapping, Protocol

from hetserve.planner.plan import Plan
from hetserve.policies.base import ReplicaState, RequestInfo, RoutePolicy
from hetserve.policies.routing import make_route, route_candidates


class KVRoutePolicy(Protocol):
    def choose(self, request: RequestInfo, src: str, alive: list[str], states: Mapping[str, ReplicaState],
               now: float) -> str: ...


class PlanRoutes:
    def __init__(self, plan: Plan, policy: RoutePolicy | str = "flow"):
        self.plan = plan
        self.policy = make_route(policy) if isinstance(policy, str) else policy
        self.name = getattr(self.policy, "name", "?")

    def choose(self, request: RequestInfo, src: str, alive: list[str], states: Mapping[str, ReplicaState],
               now: float) -> str:
        """A decode replica among ``alive`` for ``request``'s KV from prefill replica ``src``."""
        routes = route_candidates(self.plan, src, alive)
        if not routes:
            raise ValueError("no decode replica to route to")
        if len(routes) == 1:
            return routes[0][0]
        return self.policy.choose(request, src, [(states[d], w) for d, w in routes], now)
