"""Array forms of per-pair loops must rank and sum as the loops they replace:

* ``partition.group_bandwidth`` (sparse class counts) is the dense C·B·Cᵀ;
* ``refine_moves._best_connected`` ranks same-role pairs as sorting them by (−bandwidth, pair).
"""

import random

import numpy as np

from hetserve.planner import PlanOptions
from hetserve.planner.context import PlanContext
from hetserve.planner.pool.groups import Group
from hetserve.planner.search.partition import group_bandwidth
from hetserve.planner.search.refine_moves import _best_connected
from hetserve.specs.cluster import load_cluster


def test_group_bandwidth_is_the_dense_product(llama70b, azure):
    ctx = PlanContext(load_cluster("hexgen2-het1"), llama70b, azure, PlanOptions())
    rng = random.Random(0)
    devices = list(range(ctx.num_devices))
    for _ in range(20):
        rng.shuffle(devices)
        k = rng.randint(1, len(devices))
        groups = [sorted(devices[i::k]) for i in range(k)]
        counts = np.zeros((k, len(ctx.classes)))
        for j, g in enumerate(groups):
            for d in g:
                counts[j, ctx.class_of[d]] += 1
        want = counts @ ctx.class_bandwidth_gbps @ counts.T
        np.fill_diagonal(want, 0.0)
        assert np.array_equal(group_bandwidth(ctx, groups), want)


def test_best_connected_ranks_as_the_sort():
    rng = random.Random(1)
    for _ in range(500):
        n = rng.randint(0, 30)
        groups = [Group((i,), rng.choice(("prefill", "decode", "colocated"))) for i in range(n)]
        w = np.array([[float(rng.choice((3, 3, 100, 200, rng.random()))) for _ in range(n)] for _ in range(n)])
        w = w + w.T if n else np.zeros((0, 0))
        idx = rng.sample(range(n), rng.randint(0, n))
        want = sorted(((a, b) for a in idx for b in idx if a < b and groups[a].role == groups[b].role),
                      key=lambda p: (-w[p], p))[:4]
        assert _best_connected(groups, idx, w, 4) == want
