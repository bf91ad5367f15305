"""HexGen-2's stall rule (``PlanOptions.stall_iterations``): the search stops after that many
iterations in a row that do not raise the best plan found — its own best, or a plan the caller
already holds — by more than ``STALL_TOLERANCE``; small pools keep the restarts rule alone."""

from __future__ import annotations

import random

import pytest

from hetserve.planner.options import Budget, PlanOptions, default_stall_iterations
from hetserve.planner.pool.evaluator import start_search
from hetserve.planner.search.hexgen2 import hexgen2, phase1, refine
from hetserve.planner.search.refine_moves import guided_moves
from hetserve.specs.cluster import load_cluster


@pytest.fixture(scope="module")
def het1_start(llama70b, azure):
    """het1's search context, evaluator and phase-1 placement, shared by the climbs below: the
    evaluator's caches are pure, so a climb from them goes where a fresh one goes, without pricing
    the same layouts and flows again."""
    ctx, _, ev = start_search("hexgen2", load_cluster("hexgen2-het1"), llama70b, azure, PlanOptions(seed=0))
    return ctx, ev, phase1(ctx, ev, 0)


def _climb(start, stall, reference, restarts=30):
    ctx, ev, placement = start
    budget = Budget("hexgen2", PlanOptions(time_limit_s=600))
    refine(ctx, ev, placement, budget, guided_moves, random.Random(0), restarts=restarts, stall=stall,
           reference=reference)
    return budget


def test_a_climb_that_cannot_reach_the_plan_in_hand_stops_after_the_stall_iterations(het1_start):
    b = _climb(het1_start, stall=3, reference=1e12)
    assert (b.iteration, b.stopped_by) == (3, "stalled")


def test_progress_on_the_best_plan_restarts_the_count(het1_start):
    # het1's first descent steps each gain more than the tolerance: one stall iteration is not the end
    b = _climb(het1_start, stall=1, reference=0.0)
    assert b.iteration > 2 and b.stopped_by == "stalled"
    assert b.history[-1][1] > b.start_value * 1.01


def test_without_the_rule_the_restarts_decide(het1_start):
    b = _climb(het1_start, stall=None, reference=1e12, restarts=2)
    assert b.iteration > 3 and b.stopped_by == "converged"


def test_the_default_is_off_on_small_pools_and_shrinks_with_the_pool():
    assert default_stall_iterations(64) is None
    assert [default_stall_iterations(n) for n in (128, 320, 1024, 4096)] == [18, 7, 5, 5]


def test_the_option_reaches_the_search(llama70b, azure):
    plan = hexgen2(load_cluster("hexgen2-het4"), llama70b, azure, PlanOptions(seed=0, stall_iterations=1))
    assert plan.estimate["search"]["stopped_by"] == "stalled"
    with pytest.raises(ValueError, match="stall_iterations"):
        PlanOptions(stall_iterations=0)
