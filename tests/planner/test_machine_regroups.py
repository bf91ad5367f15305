"""The refinement's machine-part swaps (``refine_moves.machine_regroups``): two groups of one role
that each span several machines trade equal-sized machine parts so that the pair spans fewer
machines. On het3 this is the step from the plan the search used to stop at (two pipelines of
2 A6000 + 2 L40) to one of 4 A6000 and one of 2 + 2 L40."""

import random

from hetserve.planner import PlanOptions
from hetserve.planner.pool.evaluator import start_search
from hetserve.planner.pool.groups import Group, canonical
from hetserve.planner.search.refine_moves import guided_moves, machine_regroups
from hetserve.planner.search.moves import swap_parts
from hetserve.specs.cluster import load_cluster

HET3_STOP = [  # hexgen2's plan on het3 before these swaps (1,749.9 tokens/s)
    (["a100-0:0", "a100-0:1"], "prefill"),
    (["a6000-0:4", "a6000-0:5", "l40-0:0", "l40-0:1"], "prefill"),
    (["l40-1:0", "l40-1:1", "l40-1:2", "l40-1:3"], "prefill"),
    (["a6000-0:0", "a6000-0:1", "l40-1:4", "l40-1:5"], "prefill"),
    (["a6000-0:2", "a6000-0:3", "l40-0:2", "l40-0:3", "l40-0:4", "l40-0:5"], "decode"),
    (["a100-0:2", "a100-0:3", "a100-0:4", "a100-0:5"], "colocated"),
]


def _machines(ctx, devices) -> set[str]:
    return {ctx.cluster.devices[d].machine for d in devices}


def test_the_swap_gathers_het3s_a6000_prefill_and_raises_the_plan(llama70b, azure):
    ctx, _, ev = start_search("hexgen2", load_cluster("hexgen2-het3"), llama70b, azure, PlanOptions(seed=0))
    index = {d.name: d.index for d in ctx.cluster.devices}
    stop = canonical(Group.of([index[n] for n in names], role) for names, role in HET3_STOP)
    four_a6000 = Group.of([index[f"a6000-0:{k}"] for k in (0, 1, 4, 5)], "prefill")
    live = [i for i in range(len(stop)) if ev.evaluate(stop).capacities[i] > 0]
    swaps = [swap_parts(stop, *s) for s in machine_regroups(ctx, stop, live, 4)]
    gathered = [p for p in swaps if four_a6000 in p]
    assert gathered, swaps
    assert ev.score(gathered[0]) > ev.score(stop) * 1.04  # 1,836.6 against 1,749.9
    # and the refinement's guided moves propose it
    assert gathered[0] in [p for _, p in guided_moves(ctx, ev.evaluate(stop), random.Random(0))]


def test_each_swap_trades_equal_parts_of_one_machine_within_one_role_and_saves_machines(llama70b, azure):
    ctx, _, _ = start_search("hexgen2", load_cluster("hexgen2-het3"), llama70b, azure, PlanOptions(seed=0))
    rng = random.Random(1)
    n, proposed = ctx.num_devices, 0
    for _ in range(200):
        devices = list(range(n))
        rng.shuffle(devices)
        groups, at = [], 0
        while at < n:
            k = rng.choice((2, 4, 6))
            groups.append(Group.of(devices[at:at + k], rng.choice(("prefill", "decode"))))
            at += k
        layout = canonical(groups)
        for i, j, pi, pj in machine_regroups(ctx, layout, list(range(len(layout))), 10**6):  # all of them
            proposed += 1
            assert layout[i].role == layout[j].role and len(pi) == len(pj)
            assert len(_machines(ctx, pi)) == 1 and len(_machines(ctx, pj)) == 1
            assert _machines(ctx, pi) != _machines(ctx, pj)
            assert set(pi) <= set(layout[i].devices) and set(pj) <= set(layout[j].devices)
            before = len(_machines(ctx, layout[i].devices)) + len(_machines(ctx, layout[j].devices))
            gi = (set(layout[i].devices) - set(pi)) | set(pj)
            gj = (set(layout[j].devices) - set(pj)) | set(pi)
            assert len(_machines(ctx, gi)) + len(_machines(ctx, gj)) < before
    assert proposed > 50

