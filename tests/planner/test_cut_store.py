"""Colocated cuts kept across evaluators (``search.cut_store``): reused for the same problem, never
for another."""

import pytest

from hetserve.cost import analytic
from hetserve.cost.efficiency import Efficiency
from hetserve.planner.context import PlanContext
from hetserve.planner.options import PlanOptions
from hetserve.planner.pool.evaluator import Evaluator
from hetserve.planner.search import cut_store, mixing
from hetserve.specs.cluster import load_cluster
from hetserve.specs.model import load_model
from hetserve.specs.workload import load_workload


def _cut(ctx, devices):
    return sorted(tuple(sorted(ds)) for ds in mixing._colocated_cut(ctx, Evaluator(ctx), tuple(devices)))


@pytest.fixture
def fresh_cuts(monkeypatch):
    """Counts the cuts computed rather than found; the store starts (and ends) empty."""
    cut_store.clear()
    calls = []
    real = mixing._colocated_cut_fresh

    def counting(ctx, evaluator, devices, comp):
        calls.append(comp)
        return real(ctx, evaluator, devices, comp)

    monkeypatch.setattr(mixing, "_colocated_cut_fresh", counting)
    yield calls
    cut_store.clear()


POOL, MODEL = "hexgen2-het2", "llama-2-7b"  # cheap cuts (~1 s CPU) that each change below moves


def _ctx(options=PlanOptions(), model=MODEL):
    return PlanContext(load_cluster(POOL), load_model(model), load_workload("azure-conv"), options)


def test_a_second_evaluator_of_the_same_problem_reuses_the_cuts(fresh_cuts, base_ctx):
    devices = range(18)
    first = _cut(base_ctx, devices)
    assert fresh_cuts and first
    n = len(fresh_cuts)
    # another context of the same problem (a new cluster object, search options the cut does not
    # read) finds every cut kept
    again = _cut(_ctx(PlanOptions(seed=3, time_limit_s=5, restarts=1)), devices)
    assert again == first and len(fresh_cuts) == n


@pytest.fixture(scope="module")
def base_ctx():
    return _ctx()


def _changed(change: str) -> PlanContext:
    """The base problem with one input a cut reads changed."""
    if change == "model":
        return _ctx(model="llama-2-13b")
    if change == "slo":
        return _ctx(PlanOptions(objective="goodput", slo_ttft_s=0.3, slo_tpot_s=0.05))
    if change == "efficiency":
        return _ctx(PlanOptions(efficiency=Efficiency(usable_memory=0.3)))
    assert change == "roofline"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(analytic, "_KERNELS_BY_DEFAULT", False)
        return _ctx()


@pytest.mark.parametrize("change", ["model", "slo", "efficiency", "roofline"])
def test_another_problem_misses_the_store_and_gets_its_own_cut(change, fresh_cuts, base_ctx):
    devices = range(18)
    base = _cut(base_ctx, devices)
    changed = _changed(change)
    warm = _cut(changed, devices)  # the store holds the base problem's cuts
    cut_store.clear()
    cold = _cut(changed, devices)  # a new evaluator, an empty store: computed afresh
    assert warm == cold
    assert cold != base  # the change moves the cut: a key blind to it would answer wrongly
