"""A search step prunes its candidates by the capacity bound without building them
(``Evaluator._capacity_bound``): that bound must be exactly the one the built pending pool layout
carries, or ``best_of`` would prune a candidate the old path kept (or keep one it pruned)."""

from __future__ import annotations

import random

from hetserve.planner import PlanOptions
from hetserve.planner.pool.evaluator import start_search
from hetserve.planner.pool.groups import Group, canonical
from hetserve.planner.search.hexgen2 import phase1
from hetserve.planner.search.moves import flip
from hetserve.planner.search.refine_moves import guided_moves
from hetserve.specs.cluster import load_cluster
from hetserve.specs.model import load_model
from hetserve.specs.workload import load_workload


def test_capacity_bound_equals_the_pending_bound_on_a_search_step():
    ctx, _, ev = start_search("hexgen2", load_cluster("hexgen2-het3"), load_model("llama-2-70b"),
                              load_workload("azure-conv"), PlanOptions(seed=0))
    start = phase1(ctx, ev, 0)
    cands = [c for _, c in guided_moves(ctx, ev.evaluate(start), random.Random(0))]
    # every role on the board: a group made colocated, and one with no replica's worth of devices
    cands += [canonical(start[:i] + (Group(g.devices, "colocated"),) + start[i + 1:]) for i, g in enumerate(start)]
    cands += [c for c in (flip(start, i) for i in range(len(start))) if c is not None]
    cands.append(canonical(start + (Group((start[0].devices[0],), "decode"),)))
    assert len(cands) > 10
    roles = set()
    for c in cands:
        key = canonical(c)
        roles.update(g.role for g in key)
        assert ev._capacity_bound(key) == ev._pending(key).bound, key
    assert roles == {"prefill", "decode", "colocated"}
