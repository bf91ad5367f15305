"""The mixed climb stops where it cannot reach the plan already in hand (``mixing.REACH_SLACK``):
a climb's value plus ``REACH_SLACK`` times its largest gain for each round left must reach the
target, else the climb ends. The climb runs on a fake evaluator whose candidates gain a set amount
per round, so the rule is checked on its own numbers; hexgen2 is checked to hand the climb the
best plan it holds."""

from __future__ import annotations

import importlib

import pytest

from hetserve.planner.search import mixing


class _Steps:
    """Layouts are integers k; each round's one candidate is k + 1, worth ``values[k + 1]``."""

    def __init__(self, values):
        self.values, self.rounds = values, 0

    def score(self, k):
        return self.values[k]

    def best_of(self, cands, floor=-1.0, stop=None):
        self.rounds += 1
        best = max(range(len(cands)), key=lambda i: self.values[cands[i]])
        v = self.values[cands[best]]
        return (best, v) if v > floor else (None, floor)


def _climb(values, target):
    ev = _Steps(values)
    end, v = mixing._climb(ev, 0, lambda k: iter([k + 1] if k + 1 < len(values) else []), target=target)
    return ev.rounds, end, v


def test_a_climb_that_cannot_reach_the_target_stops_after_its_first_round():
    gains = [10.0] * mixing.MAX_MIXED_ROUNDS
    values = [100.0 + sum(gains[:k]) for k in range(len(gains) + 1)]
    left = mixing.MAX_MIXED_ROUNDS - 1
    reach = values[1] + left * mixing.REACH_SLACK * gains[0]
    rounds, end, v = _climb(values, target=reach * 1.01)
    assert (rounds, end, v) == (1, 1, values[1])
    # a target the climb reaches, or none: it runs every round
    for target in (values[-1], 0.0):
        rounds, end, v = _climb(values, target=target)
        assert (rounds, end, v) == (mixing.MAX_MIXED_ROUNDS, mixing.MAX_MIXED_ROUNDS, values[-1])


def test_the_reach_counts_the_largest_gain_so_far_not_the_last():
    # a large first gain, then small ones: the first gain keeps the target within reach
    gains = [40.0] + [1.0] * (mixing.MAX_MIXED_ROUNDS - 1)
    values = [100.0 + sum(gains[:k]) for k in range(len(gains) + 1)]
    target = values[2] + (mixing.MAX_MIXED_ROUNDS - 2) * mixing.REACH_SLACK * 40.0 * 0.99
    rounds, _, _ = _climb(values, target)
    assert rounds > 2


def test_hexgen2_hands_the_mixed_climb_the_best_plan_it_holds(monkeypatch, azure):
    """The target is at least the colocated and the disaggregated plans' values."""
    from hetserve.planner import ALGORITHMS, PlanOptions
    from hetserve.specs.cluster import load_cluster
    from hetserve.specs.model import load_model

    hexgen2 = importlib.import_module("hetserve.planner.search.hexgen2")
    seen = []
    real = hexgen2.mixed_alternative

    def spy(ctx, ev, disaggregated, colocated, stop=None, target=0.0):
        seen.append((target, ev.score(disaggregated), ev.score(colocated)))
        return real(ctx, ev, disaggregated, colocated, stop, target)

    monkeypatch.setattr(hexgen2, "mixed_alternative", spy)
    ALGORITHMS["hexgen2"](load_cluster("hexgen2-homo"), load_model("llama-2-70b"), azure, PlanOptions(seed=0))
    assert seen
    for target, dis, col in seen:
        assert target == pytest.approx(max(target, dis, col)) and target >= col > 0
