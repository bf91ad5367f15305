"""`plan --explain`'s what-ifs: more hardware never reads below the plan it adds to.

The current plan still runs on a pool with one more GPU (the GPU idle) or a wider link (the same
replicas), so a what-if is the better of that plan priced there and the quick re-plan, and says
which; the re-plan's upper bound of the edited pool is kept either way.
"""

import pytest

from hetserve.errors import InfeasibleError
from hetserve.planner import ALGORITHMS, PlanOptions
from hetserve.planner.explain import plan_tokens_per_s, what_ifs
from hetserve.specs.cluster import load_cluster
from hetserve.specs.model import load_model

POOL = "molink-3x4090"  # three single-GPU sites: a +1 GPU what-if and a 2× pipe what-if, both fast
OPTIONS = PlanOptions(seed=0, time_limit_s=3)


@pytest.fixture(scope="module")
def uniform_plan(azure):
    """A uniform plan whose KV pipe between sites is full (so a wider pipe serves it more)."""
    p = ALGORITHMS["uniform"](load_cluster(POOL), load_model("llama-2-7b"), azure, OPTIONS)
    assert any(n.startswith("pipe:") for n in p.estimate.get("network", {})), p.estimate.get("network")
    return p


def _rows(plan, azure, fn):
    rows = what_ifs(plan, POOL, load_model("llama-2-7b"), azure, OPTIONS, fn)
    assert [r.change.split()[0] for r in rows] == ["+1", "2×"], rows
    return {r.change.split()[0]: r for r in rows}


def test_a_re_plan_that_loses_gives_way_to_the_current_plan(uniform_plan, azure):
    def losing(cluster, model, workload, options):  # a quick search that found little
        return type("P", (), {"estimate": {"throughput_tokens_per_s": 1.0, "upper_bound_tokens_per_s": 1234.0,
                                           "upper_bound_cut_short": True}})()

    base = plan_tokens_per_s(uniform_plan, load_cluster(POOL), load_model("llama-2-7b"), azure, OPTIONS)
    assert base == pytest.approx(uniform_plan.estimate["throughput_tokens_per_s"], abs=1e-3)
    rows = _rows(uniform_plan, azure, losing)
    gpu, link = rows["+1"], rows["2×"]
    assert gpu.tokens_per_s == pytest.approx(base) and gpu.source == "current plan, the new GPU idle"
    # the plan's pipe was full: the same replicas over twice its bandwidth serve more
    assert link.tokens_per_s > base * 1.01 and link.source == "current plan over the wider link"
    assert all(r.upper_bound == 1234.0 and r.cut_short and not r.note for r in rows.values())


def test_a_re_plan_that_wins_is_reported_as_re_planned(uniform_plan, azure):
    base = uniform_plan.estimate["throughput_tokens_per_s"]
    rows = _rows(uniform_plan, azure, ALGORITHMS["hexgen2"])  # colocated replicas: far above uniform's
    assert all(r.source == "re-planned" and r.tokens_per_s > 2 * base and r.upper_bound >= r.tokens_per_s
               for r in rows.values()), rows


def test_a_failed_re_plan_keeps_the_current_plan_and_says_why(uniform_plan, azure):
    def failing(cluster, model, workload, options):
        raise InfeasibleError("no layout found")

    rows = _rows(uniform_plan, azure, failing)
    assert all(r.tokens_per_s >= uniform_plan.estimate["throughput_tokens_per_s"] - 1e-3 and r.upper_bound == 0
               and r.note == "re-plan failed: no layout found" for r in rows.values()), rows
