"""``integerize``: integer layer counts by largest remainder, each in [1, cap], summing to the total;
the heap it keeps gives what moving one layer at a time by a full scan gives."""

import random

from hetserve.planner.layout.layer_split import integerize


def _one_layer_at_a_time(weights, caps, total):
    """The rule written plainly: each layer short goes to the largest remainder (lowest index on
    ties), each layer over comes from the smallest."""
    s = sum(weights)
    x = [total * w / s for w in weights]
    n = [min(c, max(1, int(v))) for v, c in zip(x, caps)]
    while sum(n) < total:
        i = max((j for j in range(len(n)) if n[j] < caps[j]), key=lambda j: (x[j] - n[j], -j))
        n[i] += 1
    while sum(n) > total:
        i = min((j for j in range(len(n)) if n[j] > 1), key=lambda j: (x[j] - n[j], j))
        n[i] -= 1
    return tuple(n)


def test_integerize_is_the_largest_remainder_rule_within_caps():
    rng = random.Random(0)
    checked = 0
    while checked < 3000:
        stages = rng.randint(1, 24)
        total = rng.randint(stages, 120)
        caps = [rng.randint(1, total) for _ in range(stages)]
        if sum(caps) < total:
            continue
        weights = [float(c) for c in caps] if rng.random() < 0.3 else \
            [rng.choice([rng.random(), float(rng.randint(1, 5)), 1.0]) for _ in range(stages)]
        got = integerize(weights, caps, total)
        assert got == _one_layer_at_a_time(weights, caps, total), (weights, caps, total)
        assert sum(got) == total and all(1 <= n <= c for n, c in zip(got, caps))
        checked += 1


def test_integerize_ties_go_to_the_first_stage():
    assert integerize([1.0, 1.0, 1.0], [80, 80, 80], 80) == (27, 27, 26)
    assert integerize([1.0, 1.0], [3, 80], 80) == (3, 77)  # the cap holds
