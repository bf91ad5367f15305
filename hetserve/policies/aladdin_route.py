"""Aladdin beyond prompt placement: its decode scheduler for split-phase serving (``AladdinRoute``),
and how the policy registries build Aladdin from a ``PolicyContext`` (``from_context``).

``make_placement("aladdin", ...)`` and ``make_route("aladdin", ...)`` import this module lazily
(``policies/placement.py``, ``policies/routing.py``); the placement itself is ``policies/aladdin.py``.
"""

from __future__ import annotations

from typing import Sequence

from hetserve.policies.aladdin import AladdinPlacement
from hetserve.policies.aladdin_models import models_from_cost
from hetserve.policies.base import ReplicaState, RequestInfo
from hetserve.specs.workload import SLO


class AladdinRoute:
    """Aladdin's decode scheduler for split-phase serving (§5.1, Figure 5): places a finished
    prefill on a decode replica with the same best fit (a ``RoutePolicy``). Routes of weight 0
    are skipped unless every route has weight 0."""

    name = "aladdin"
    needs_requests = True

    def __init__(self, placement: AladdinPlacement):
        self.placement = placement

    @property
    def stats(self) -> dict:
        return self.placement.stats

    def choose(self, request: RequestInfo, src: str, candidates: Sequence[tuple[ReplicaState, float]],
               now: float) -> str:
        live = [r for r, w in candidates if w > 0] or [r for r, _ in candidates]
        return self.placement.choose(request, live, now)

    def on_finish(self, request_id: int, input_tokens: int, output_tokens: int) -> None:
        self.placement.on_finish(request_id, input_tokens, output_tokens)


# ----------------------------------------------------------------------------- registries


def from_context(ctx) -> AladdinPlacement:
    """Build Aladdin from a ``PolicyContext``: coefficients fitted to the analytic cost model of
    every replica unless ``ctx.options["models"]`` gives them; ``gamma``, ``theta`` and
    ``rebalance`` from ``ctx.options``. Predictions come from the caller's predictor."""
    opts = dict(ctx.options or {})
    models = opts.get("models")
    if models is None:
        if ctx.cost is None or not ctx.layouts:
            raise ValueError("aladdin needs performance models: PolicyContext.cost and .layouts, "
                             "or options['models']")
        models = models_from_cost(ctx.cost, ctx.layouts, slo=ctx.slo)
    return AladdinPlacement(models, ctx.slo or SLO(), gamma=opts.get("gamma", 0.5), theta=opts.get("theta", 1.0),
                            rebalance=opts.get("rebalance", True), token_budget=opts.get("token_budget", 4096),
                            overflow=opts.get("overflow", "least_overdraft"))


def _register() -> None:
    from hetserve.policies.placement import register_placement
    from hetserve.policies.routing import register_route

    register_placement("aladdin", from_context)
    register_route("aladdin", lambda ctx: AladdinRoute(from_context(ctx)))


_register()
