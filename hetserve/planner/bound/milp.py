"""HiGHS (scipy's ``linprog`` / ``milp``) runs for the group-column programme (``bound_groups``):
the LP relaxation, and MILP runs within a time budget whose dual bound is the bound.

A MILP stopped early (node limit, time limit, deadline) still proves its dual bound, so every run
here returns one; ``run_milp`` says whether the time cut it short (a looser bound).
"""

from __future__ import annotations

import math
import time
import warnings

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, linprog, milp

MIN_RUN_S = 0.5  # a MILP run started at (or past) the deadline still gets this long to find a dual bound


def solve_lp(obj, matrix, upper):
    """The LP relaxation: maximise ``obj`` under ``matrix`` (A, rhs) with 0 ≤ x ≤ ``upper``."""
    A, rhs = matrix
    lp = linprog(-obj, A_ub=A, b_ub=rhs, bounds=list(zip(np.zeros(len(obj)), upper)), method="highs")
    if lp.status != 0:  # pragma: no cover - all zeros is feasible, every variable is capped
        raise RuntimeError(f"group-column LP failed: {lp.message}")
    return lp


# HiGHS stops within 0.2 % of its best integer point (the dual bound stays a bound).
_GAP = {"mip_rel_gap": 0.002}
# Only the dual bound is used, so on the large pools' GPU-type columns HiGHS's primal heuristics
# (sub-MIPs) are switched off: they add to the root's time (1,024 GPUs: 4.5 s of bound against 3.3).
# The tied programmes of pools of few machines keep them: a good integer point found early lets
# reduced-cost fixing shrink the programme, where branching alone finds one late (het3's cutting
# rounds: 39 s with them, 80-94 s without; het1, het2, het4, het5 within noise, the same bounds).
# scipy passes these HiGHS options through verbatim (with a warning, silenced here).
_NO_HEURISTICS = {"mip_heuristic_effort": 0.0, "mip_heuristic_run_rins": False, "mip_heuristic_run_rens": False,
                  "mip_heuristic_run_root_reduced_cost": False}


def dual_bound(res) -> float:
    """The run's dual bound on the (maximised) objective; inf where it has none."""
    dual = getattr(res, "mip_dual_bound", None)
    return -float(dual) if dual is not None and math.isfinite(dual) else math.inf


def run_milp(c, A, rhs, integrality, upper, node_limit: int, time_limit: float, deadline: float | None,
             heuristics: bool = False):
    """HiGHS's run (minimising ``c``) and whether the time (``time_limit`` per run, ``deadline`` in
    all) cut it short. ``heuristics``: keep HiGHS's primal heuristics on (``_NO_HEURISTICS``)."""
    def run(highs_options):
        left = time_limit if deadline is None else min(time_limit, max(MIN_RUN_S, deadline - time.perf_counter()))
        return milp(c, constraints=LinearConstraint(A, -np.inf, rhs), integrality=integrality, bounds=Bounds(0, upper),
                    options={"node_limit": node_limit, **highs_options, "time_limit": left, "disp": False})

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        res = run(_GAP if heuristics else {**_NO_HEURISTICS, **_GAP})
    # scipy's status 4 is "other": HiGHS refused the run (an option it does not know), or, with scipy
    # 1.17, it stopped at the node limit (HiGHS's status 16, which scipy does not name). Both run
    # again without the HiGHS options. Rerunning costs time (on hexgen2-het1 about 68 s of bound
    # against 45 s) but gives a tighter bound than the node-limited run's dual bound (2,048 against
    # 2,147 tokens/s), so the rerun is kept.
    if res.status != 4:
        # scipy's 1: "iteration or time limit reached" (the node limit is its 4 with scipy 1.17, above)
        return res, res.status == 1
    again = run({})
    if again.status == 1 and math.isfinite(dual_bound(res)):
        return res, True  # the rerun ran out of time: keep the run that searched all its nodes
    return again, again.status == 1
