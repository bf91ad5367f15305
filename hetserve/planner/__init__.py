"""Planners: from (cluster, model, workload) to a deployment ``Plan``.

Every algorithm is a plain function ``fn(cluster, model, workload, options) -> Plan`` listed in
``ALGORITHMS``; all of them score pool layouts with the same ``pool.Evaluator`` (per-replica
layout search + the cost model + HexGen-2's flow network), so their estimates compare directly.

    hexgen2          HexGen-2: graph partition + max flow + max-flow-guided refinement
    random-swap      HexGen-2 with random instead of guided edits (§5.3)
    genetic          HexGen-2 with HexGen's genetic search generating the groups (§5.3)
    uniform          DistServe-style: one shape for all prefill and one for all decode replicas
    hexgen           HexGen: colocated replicas, genetic search with K-means + elbow init
    exact            optimal disaggregated pool layout by enumeration (≤ 8 devices)
    exact-colocated  optimal colocated pool layout (≤ 8 devices)
"""

from __future__ import annotations

from typing import Callable

from hetserve.planner.search.baselines import genetic, uniform
from hetserve.planner.search.exact import exact, exact_colocated
from hetserve.planner.search.hexgen import hexgen
from hetserve.planner.search.hexgen2 import hexgen2, random_swap
from hetserve.planner.options import PlanOptions, SearchProgress
from hetserve.planner.plan import KVRoute, Plan, PlanReplica, PlanStage
from hetserve.planner.validate import validate_plan

Algorithm = Callable[..., Plan]

ALGORITHMS: dict[str, Algorithm] = {
    "hexgen2": hexgen2,
    "random-swap": random_swap,
    "genetic": genetic,
    "uniform": uniform,
    "hexgen": hexgen,
    "exact": exact,
    "exact-colocated": exact_colocated,
}

__all__ = ["ALGORITHMS", "KVRoute", "Plan", "PlanOptions", "PlanReplica", "PlanStage", "SearchProgress",
           "plan", "validate_plan"]


def plan(cluster, model, workload, algorithm: str = "hexgen2", options: PlanOptions | None = None) -> Plan:
    """Run one algorithm by name (see ``ALGORITHMS``) for the options' objective and budget."""
    from hetserve.errors import PlanError

    if algorithm not in ALGORITHMS:
        raise PlanError(f"unknown planning algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}")
    from hetserve.planner.objectives import plan_for

    return plan_for(ALGORITHMS[algorithm], cluster, model, workload, options or PlanOptions())
