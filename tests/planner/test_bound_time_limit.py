"""The plan's upper bound within the time limit (``bound.group_bound(time_limit_s=...)``,
``Budget.bound_time_s``): a solver the time stops still gives a bound, a looser one, and says so."""

from __future__ import annotations

import pytest

from bench.lib.exact_pools import island
from hetserve.planner.context import PlanContext
from hetserve.planner.pool import estimate
from hetserve.specs.model import load_model
from hetserve.specs.workload import load_workload


def test_a_bound_the_time_cuts_short_is_still_a_bound_and_more_time_solves_it_again(monkeypatch):
    """``group_bound(time_limit_s=...)``: a solver stopped by the time still returns a bound (its
    dual bound, looser), flags it, and a later call with more time solves it again rather than
    reading the cut one from the cache; a finished bound serves every later call."""
    from hetserve.planner.bound import throughput as bound
    from hetserve.planner.bound import milp as bound_milp

    _fresh_solves(monkeypatch, bound, bound_milp)
    # a small pool: its MILP takes tens of milliseconds, so the millisecond's cut is real and the full solve cheap
    ctx = PlanContext(island("A100-SXM-80G", 4, "L4", 2), load_model("llama-2-7b"), load_workload("azure-conv"))
    cut = bound.group_bound(ctx, time_limit_s=1e-3)
    assert cut.cut_short
    full = bound.group_bound(ctx)
    assert not full.cut_short
    assert cut.tokens_per_s >= full.tokens_per_s * (1 - 1e-9)
    assert bound.group_bound(ctx, time_limit_s=1e-3) is full


def test_the_time_limit_stops_the_lp_rounds_of_layer_share_cuts_too(monkeypatch):
    """Before its MILP the programme ties the spread columns its LP uses, a round at a time; a
    deadline that has passed stops those rounds after the first (each round's value is a bound)
    rather than letting them run on past the plan's time limit."""
    from hetserve.planner.bound import groups
    from hetserve.planner.bound import milp as bound_milp
    from hetserve.planner.bound import throughput as bound
    from hetserve.specs.cluster import cluster_from_dict

    _fresh_solves(monkeypatch, bound, bound_milp)
    lps = []
    solve_lp = groups.solve_lp
    monkeypatch.setattr(groups, "solve_lp", lambda *a, **k: lps.append(1) or solve_lp(*a, **k))
    pool = cluster_from_dict({"name": "rounds", "machines": [
        {"name": "a", "gpu": "RTX-4090", "count": 4, "site": "s1"},
        {"name": "b", "gpu": "RTX-4090", "count": 4, "site": "s1"},
        {"name": "c", "gpu": "A6000", "count": 4, "site": "s2"}],
        "network": {"intra_site": {"bandwidth_gbps": 10, "latency_ms": 0.2},
                    "inter_site": {"bandwidth_gbps": 1, "latency_ms": 15}}}, "<test>")
    ctx = PlanContext(pool, load_model("llama-2-70b"), load_workload("azure-conv"))
    full = bound.group_bound(ctx)
    assert len(lps) >= 2 and not full.cut_short  # this pool's programme takes more than one round
    lps.clear()
    monkeypatch.setattr(bound, "_CACHE", {})
    cut = bound.group_bound(ctx, time_limit_s=1e-6)
    assert len(lps) == 1 and cut.cut_short
    assert cut.tokens_per_s >= full.tokens_per_s * (1 - 1e-9)


def test_plan_time_limit_covers_the_bound_and_the_plan_says_when_it_cut_it(monkeypatch, tmp_path, capsys):
    """`hetserve plan --time-limit`: the plan's upper bound gets what the search left (at least a
    share of the limit), and a bound cut short is flagged in the plan file and the printout."""
    import json

    from hetserve.cli.main import main
    from hetserve.planner import options
    from hetserve.planner.bound import throughput as bound
    from hetserve.planner.bound import milp as bound_milp

    _fresh_solves(monkeypatch, bound, bound_milp)
    monkeypatch.setattr(options, "BOUND_SHARE", 1e-3)
    out = tmp_path / "plan.json"
    assert main(["plan", "--cluster", "hexgen2-het4", "--model", "llama-2-70b", "--time-limit", "0.2", "--quiet",
                 "-o", str(out)]) == 0
    assert "the bound's solver stopped at the time limit" in capsys.readouterr().out
    e = json.loads(out.read_text())["estimate"]
    assert e["upper_bound_cut_short"] is True
    assert e["upper_bound_tokens_per_s"] >= e["throughput_tokens_per_s"]


def _fresh_solves(monkeypatch, bound, bound_milp):
    """No bound from this process's cache or the session's shared ones (``tests/conftest.py``), and a
    MILP run past its deadline stopped at once (not after ``bound_milp.MIN_RUN_S``)."""
    monkeypatch.setattr(bound, "_CACHE", {})
    monkeypatch.setattr(bound, "_group_bound", getattr(bound._group_bound, "__wrapped__", bound._group_bound))
    monkeypatch.setattr(bound_milp, "MIN_RUN_S", 1e-3)


@pytest.mark.parametrize("whole_cut", [True, False])
def test_a_budgeted_plan_s_bound_keeps_to_the_time_limit_and_its_flag_is_its_own(monkeypatch, whole_cut):
    """``--budget-usd-per-hour``: the budgeted bound over the whole pool (after the subsets' plans)
    gets the rest of the time limit, at least its share, not all it wants; the plan's cut-short flag
    is that bound's, not the flag of the subset plan's own bound (here the opposite of it)."""
    import dataclasses

    from hetserve.planner import ALGORITHMS, PlanOptions, objectives
    from hetserve.specs.cluster import cluster_from_dict

    pool = cluster_from_dict({"name": "priced", "machines": [
        {"name": "a", "gpu": "A100-SXM-80G", "count": 2}, {"name": "b", "gpu": "RTX-4090", "count": 4}],
        "network": {"intra_site": {"bandwidth_gbps": 10, "latency_ms": 0.2}}}, "<test>")
    seen = []
    real_whole, real_subset = objectives.upper_bound, estimate.upper_bound

    def whole(ctx, budget=None, *args, **kwargs):
        seen.append(kwargs.get("time_limit_s"))
        return dataclasses.replace(real_whole(ctx, budget, *args, **kwargs), cut_short=whole_cut)

    def subset(ctx, *args, **kwargs):
        return dataclasses.replace(real_subset(ctx, *args, **kwargs), cut_short=not whole_cut)

    monkeypatch.setattr(objectives, "upper_bound", whole)
    monkeypatch.setattr(estimate, "upper_bound", subset)
    price = sum(d.gpu.usd_per_hour for d in pool.devices[:4])
    plan = objectives.plan_for(ALGORITHMS["hexgen2"], pool, load_model("llama-2-7b"), load_workload("azure-conv"),
                               PlanOptions(seed=0, budget_usd_per_hour=price, time_limit_s=4, max_iterations=2))
    assert seen and all(t is not None and 0 < t <= 4 for t in seen)
    assert plan.estimate.get("upper_bound_cut_short", False) is whole_cut
