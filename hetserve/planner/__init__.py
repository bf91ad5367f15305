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

The package itself imports only the plan's data types: the searches (scipy, the cost model's
tables) load on first use of ``ALGORITHMS``, ``plan`` or ``validate_plan``, so a worker process
or a CLI that only reads a plan file starts without them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from hetserve.planner.plan import KVRoute, Plan, PlanReplica, PlanStage

if TYPE_CHECKING:
    from hetserve.planner.options import PlanOptions

__all__ = ["ALGORITHMS", "Algorithm", "KVRoute", "Plan", "PlanOptions", "PlanReplica", "PlanStage",
           "SearchProgress", "plan", "validate_plan"]

_LAZY = {"ALGORITHMS": "hetserve.planner.algorithms", "Algorithm": "hetserve.planner.algorithms",
         "PlanOptions": "hetserve.planner.options",
         "SearchProgress": "hetserve.planner.options", "validate_plan": "hetserve.planner.validate"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


def plan(cluster, model, workload, algorithm: str = "hexgen2", options: PlanOptions | None = None) -> Plan:
    """Run one algorithm by name (see ``ALGORITHMS``) for the options' objective and budget
    (``PlanOptions``; None: the defaults)."""
    from hetserve.errors import PlanError
    from hetserve.planner.algorithms import ALGORITHMS
    from hetserve.planner.objectives import plan_for
    from hetserve.planner.options import PlanOptions

    if algorithm not in ALGORITHMS:
        raise PlanError(f"unknown planning algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}")
    return plan_for(ALGORITHMS[algorithm], cluster, model, workload, options or PlanOptions())
