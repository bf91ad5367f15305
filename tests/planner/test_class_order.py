"""The pipeline's class order on groups of many classes (``LayoutSearch._class_order``): nearest
neighbour from every start, the cheapest path kept; the matrix version picks what the plain one
picks, ties included."""

import itertools
import random

from bench.lib.pools import synthetic_pool
from hetserve.planner.context import PlanContext
from hetserve.planner.layout.search import _nearest_neighbour_paths
from hetserve.planner.options import PlanOptions


def _plain(classes, hop):
    """The rule in plain Python: from each start, step to the nearest unvisited class (the
    smallest one among equally near)."""
    out = []
    for start in classes:
        path, left = [start], set(classes) - {start}
        while left:
            nxt = min(left, key=lambda b: (hop[(path[-1], b)], b))
            path.append(nxt)
            left.remove(nxt)
        out.append(tuple(path))
    return out


def test_the_matrix_nearest_neighbour_matches_the_plain_rule(llama70b, azure):
    ctx = PlanContext(synthetic_pool(128), llama70b, azure, PlanOptions())
    rng = random.Random(0)
    n_classes = len(ctx.classes)
    for _ in range(30):
        classes = tuple(rng.sample(range(n_classes), rng.randint(7, min(24, n_classes))))
        ctx.layouts._order_cache.clear()
        order = ctx.layouts._class_order(classes)
        nbytes = ctx.input_tokens * ctx.model.hidden * ctx.model.dtype_bytes
        rep = {k: ctx.classes[k][0] for k in classes}
        hop = {(a, b): ctx.cost.p2p_time(rep[a], rep[b], nbytes) for a in classes for b in classes if a != b}
        assert sorted(_nearest_neighbour_paths(sorted(classes), hop)) == sorted(_plain(classes, hop))
        plain_best = min(_plain(classes, hop), key=lambda p: (sum(hop[(a, b)] for a, b in itertools.pairwise(p)), p))
        assert order == plain_best
        # sites make many hops equal: the ties are what the order of visits decides
        assert len({round(v, 12) for v in hop.values()}) < len(hop)
