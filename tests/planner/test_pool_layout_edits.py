"""Edited pool layouts and the sums they update must equal what is computed from scratch:

* ``PoolLayout.edited`` (groups dropped and added, placed by bisection) is the canonical layout
  of the same groups, and hashes as it;
* the capacity bound of an edited candidate (``Evaluator._capacity_bound``: the parent's exact
  sums updated by the groups it dropped and added) is the float ``_pending`` computes over every
  group, along chains of edits (a flip of a move) and after the kept sums are dropped;
* ``CapacitySums`` rounds exactly as ``math.fsum`` of the same capacities.
"""

import pickle
import random

from hetserve.planner import PlanOptions
from hetserve.planner.context import PlanContext
from hetserve.planner.pool.capacity_sums import CapacitySums, bound_requests
from hetserve.planner.pool.evaluator import MAX_KEPT_SUMS, Evaluator
from hetserve.planner.pool.groups import Group, PoolLayout, canonical
from hetserve.planner.search.hexgen2 import phase1
from hetserve.planner.search.moves import flip, merge, move, random_edit, split, swap, with_roles
from hetserve.specs.cluster import load_cluster


def _layout(rng: random.Random, n: int) -> PoolLayout:
    devices = list(range(n))
    rng.shuffle(devices)
    groups, i = [], 0
    while i < n:
        k = rng.randint(1, 5)
        groups.append(Group.of(devices[i:i + k], rng.choice(("prefill", "decode", "colocated"))))
        i += k
    return canonical(groups)


def test_edited_is_canonical():
    rng = random.Random(0)
    for _ in range(300):
        base = _layout(rng, rng.randint(2, 60))
        drop = rng.sample(range(len(base)), rng.randint(0, min(3, len(base))))
        freed = [d for i in drop for d in base[i].devices]
        rng.shuffle(freed)
        add = [Group.of(freed[:len(freed) // 2], "prefill"), Group.of(freed[len(freed) // 2:], "decode"),
               Group((), "decode")]
        got = base.edited(drop, add)
        want = canonical([g for i, g in enumerate(base) if i not in drop] + add)
        assert type(got) is PoolLayout and got == want and tuple(got) == tuple(want)
        assert hash(got) == hash(tuple(want)) and got in {tuple(want)}
        assert got.parent is base and sorted(got.dropped) == sorted(base[i] for i in drop)
        assert pickle.loads(pickle.dumps(got)) == got
    assert canonical(got) is got


def test_moves_are_canonical():
    rng = random.Random(1)
    for _ in range(200):
        base = _layout(rng, 40)
        plain = tuple(base)  # the same groups without the edit history: sorted again from scratch
        i, j = rng.sample(range(len(base)), 2)
        d, e = base[i].devices[0], base[j].devices[-1]
        for edit in (lambda g: move(g, i, j, d), lambda g: swap(g, i, j, d, e), lambda g: flip(g, i),
                     lambda g: merge(g, i, j), lambda g: with_roles(g, {i: "colocated", j: "prefill"})):
            got, want = edit(base), edit(plain)
            assert got == want and (got is None or type(got) is PoolLayout)


def test_capacity_bound_of_edits(llama70b, azure):
    ctx = PlanContext(load_cluster("hexgen2-het1"), llama70b, azure, PlanOptions())
    ev, rng = Evaluator(ctx), random.Random(2)
    cur, seen = phase1(ctx, ev, 0), 0
    for step in range(20):
        cands = [c for c in (random_edit(ctx, cur, rng) for _ in range(6)) if c is not None]
        cands += [split(ctx, c, 0) for c in cands[:2]]  # edits of edits: a chain back to ``cur``
        cands += [flip(c, len(c) - 1) for c in cands[:2] if c is not None]
        for c in cands:
            if c is None:
                continue
            assert c.parent is not None
            assert ev._capacity_bound(c) == ev._pending(c).bound == ev._pending(tuple(c)).bound
            seen += 1
        cur = cands[0] if cands else cur
        if step == 10:  # past the cap the kept sums are dropped and computed again
            assert 0 < len(ev._sums) <= MAX_KEPT_SUMS
            ev._sums.clear()
    assert seen > 100 and ev._sums


def test_exact_sums_round_as_fsum():
    rng = random.Random(3)
    roles = ("prefill", "decode", "colocated")
    for _ in range(500):
        caps = [(rng.choice(roles), rng.choice((0.0, rng.uniform(0, 900), rng.lognormvariate(0, 6))))
                for _ in range(rng.randint(0, 40))]
        k = rng.randint(0, len(caps))
        add = [(rng.choice(roles), rng.uniform(0, 900)) for _ in range(rng.randint(0, 3))]
        assert CapacitySums.of(caps).requests() == bound_requests(caps)
        assert CapacitySums.of(caps).edited(caps[:k], add).requests() == bound_requests(caps[k:] + add)
