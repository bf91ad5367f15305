"""The time limit covers the whole plan call (``options.Budget``): the search stops early by
``FINAL_SHARE``, and what follows it — HexGen-2's colocated and mixed alternatives, its colocated
HexGen search — stops where the limit runs out instead of taking a limit of its own. The clock is
replaced by a fake one, so nothing here depends on this machine's speed."""

from __future__ import annotations

from hetserve.planner import options
from hetserve.planner.search import mixing
from hetserve.planner.context import PlanContext
from hetserve.planner.options import Budget, PlanOptions
from hetserve.planner.pool.evaluator import Evaluator
from hetserve.planner.pool.groups import Group, canonical
from hetserve.specs.cluster import load_cluster
from hetserve.specs.model import load_model
from hetserve.specs.workload import load_workload


class _Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_the_search_stops_a_share_early_and_what_follows_has_the_rest(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(options.time, "perf_counter", clock)
    b = Budget("hexgen2", PlanOptions(time_limit_s=10))
    clock.t += 10 * (1 - options.FINAL_SHARE) - 0.01
    assert not b.exhausted()
    clock.t += 0.02
    assert b.exhausted() and b.stopped_by == "time_limit" and not b.out_of_time()
    rest = b.rest("hexgen")  # the 2.5 s left, all of it the sub-search's own
    assert abs(rest.time_limit_s - 10 * options.FINAL_SHARE) < 0.02 and rest.search_limit_s == rest.time_limit_s
    clock.t += 10
    assert b.out_of_time()
    assert b.rest("hexgen").time_limit_s == options.REST_MIN_SHARE * 10  # past the limit: one iteration's worth


def _pool():
    ctx = PlanContext(load_cluster("demo-cpu"), load_model("llama-2-7b"), load_workload("azure-conv"), PlanOptions())
    return ctx, Evaluator(ctx)


class _Counting:
    """An evaluator that counts the placements ``colocated_alternative`` scores (one per unit set)."""

    def __init__(self, ev):
        self.ev, self.scored, self.colocated_cuts = ev, 0, ev.colocated_cuts

    def score(self, placement, **kw):
        self.scored += 1
        return self.ev.score(placement, **kw)

    def __getattr__(self, name):
        return getattr(self.ev, name)


def test_the_colocated_alternative_stops_after_its_first_unit_set_when_the_time_is_spent():
    ctx, ev = _pool()
    groups = canonical([Group.of((0, 1), "prefill"), Group.of((2, 3), "decode")])
    whole = _Counting(ev)
    full, full_v = mixing.colocated_alternative(ctx, whole, groups)
    assert whole.scored > 1
    cut = _Counting(ev)
    first, first_v = mixing.colocated_alternative(ctx, cut, groups, stop=lambda: True)
    assert cut.scored == 1 and 0 < first_v <= full_v * (1 + 1e-9)


def test_the_mixed_climb_ends_at_the_best_it_scored_when_the_time_is_spent():
    ctx, ev = _pool()
    disagg = canonical([Group.of((0, 1), "prefill"), Group.of((2, 3), "decode")])
    colocated, _ = mixing.colocated_alternative(ctx, ev, disagg)
    seen = []

    def candidates(cur):
        for c in (colocated, disagg):
            seen.append(c)
            yield c

    p, v = mixing._climb(ev, disagg, candidates, stop=lambda: True)
    assert len(seen) == 1  # stopped after the first candidate, which it keeps if it scored higher
    assert v == max(ev.score(disagg), ev.score(colocated))


def test_hexgen2s_colocated_search_gets_what_the_limit_left_not_a_limit_of_its_own(monkeypatch):
    """Before, `_choose` gave HexGen's genetic search a fresh Budget: the whole time limit again."""
    import importlib

    hexgen = importlib.import_module("hetserve.planner.search.hexgen")  # the module (the package exports its function)
    hexgen2 = importlib.import_module("hetserve.planner.search.hexgen2")
    given = []
    real = hexgen.search_colocated

    def spy(ctx, evaluator, budget, opts):
        given.append(budget)
        return real(ctx, evaluator, budget, opts)

    monkeypatch.setattr(hexgen, "search_colocated", spy)
    opts = PlanOptions(seed=0, time_limit_s=50, max_iterations=2, restarts=0)
    hexgen2.hexgen2(load_cluster("demo-cpu"), load_model("llama-2-7b"), load_workload("azure-conv"), opts)
    assert given and all(b.time_limit_s < 50 and b.search_limit_s == b.time_limit_s for b in given)
