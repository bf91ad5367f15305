"""What makes the planner fast on pools of thousands of GPUs must not change what it computes:

* the max-flow programme built from arrays (``flow_lp.build_programme``) is, entry for entry, the
  programme a column-by-column fill gives (same rows, same sums in the same order);
* ``Evaluator._capacity_bound`` is ``_pending(...).bound``, bit for bit, whether a group is one
  of the last evaluated pool layout's objects or a fresh one;
* ``best_of`` does not solve a candidate behind the pick whose bound is only a rounding error
  above the pick's value (a tie), and still picks what a full scan picks;
* the search's collector setting is undone after it.
"""

import gc
import math
import random

import numpy as np
import pytest

from hetserve.planner import PlanOptions
from hetserve.planner.pool.evaluator import Evaluator, start_search
from hetserve.planner.pool.flow import FlowNetwork
from hetserve.planner.pool.flow_lp import build_programme
from hetserve.planner.pool.groups import Group, canonical
from hetserve.planner.search.collector import fewer_collections
from hetserve.planner.search.hexgen2 import phase1
from hetserve.planner.search.moves import random_edit
from hetserve.specs.cluster import cluster_from_dict


def _reference(net: FlowNetwork):
    """The programme filled column by column: a request routed p → d puts its KV, then p's own
    bytes, then d's own bytes on a resource; colocated columns their own."""
    edges = [(p, d) for p in net.prefill for d in net.decode]
    cols = len(edges) + len(net.colocated)
    finite = {r for r, c in net.resource_cap.items() if math.isfinite(c)}
    used = {r for e in edges for r in net.edge_load.get(e, {})}
    used |= {r for g in net.prefill + net.decode + net.colocated for r in net.node_load.get(g, {})}
    names = sorted(used & finite)
    rows = {r: i for i, r in enumerate(names)}
    a = np.zeros((len(names), cols))
    for j, (p, d) in enumerate(edges):
        for part in (net.edge_load.get((p, d), {}), net.node_load.get(p, {}), net.node_load.get(d, {})):
            for r, b in part.items():
                if r in rows:
                    a[rows[r], j] = a[rows[r], j] + b
    for k, c in enumerate(net.colocated):
        for r, b in net.node_load.get(c, {}).items():
            if r in rows:
                a[rows[r], len(edges) + k] = b
    tops = a.max(axis=1)
    a = a / tops[:, None]
    node = np.zeros((len(net.prefill) + len(net.decode), cols))
    for j, (p, d) in enumerate(edges):
        node[net.prefill.index(p), j] = 1.0
        node[len(net.prefill) + net.decode.index(d), j] = 1.0
    rhs = [net.node_cap[g] for g in net.prefill + net.decode] + [net.resource_cap[r] / tops[i] for i, r in enumerate(names)]
    bounds = [(0.0, min(net.edge_cap[e], 1e15)) for e in edges] + [(0.0, net.node_cap[c]) for c in net.colocated]
    return np.vstack([node, a]), np.asarray(rhs), bounds, names


def test_programme_from_arrays_is_the_column_by_column_programme():
    rng = random.Random(5)
    resources = ["nic-out:a", "nic-in:a", "nic-out:b", "nic-in:b", "pipe:x>y", "pipe:y>x"]
    cap = {r: rng.uniform(1e9, 1e11) for r in resources} | {"link:free": math.inf}
    pre, dec, col = [0, 2, 5], [1, 3, 4, 7], [6, 8]
    net = FlowNetwork(pre, dec, {g: rng.uniform(1, 50) for g in pre + dec + col},
                      {(p, d): rng.choice((rng.uniform(1, 30), math.inf)) for p in pre for d in dec},
                      colocated=col, resource_cap=cap)
    shared = {"nic-out:a": 3.0e8, "pipe:x>y": 1.0e8}  # one dict behind several columns, as the KV cache does
    for p in pre:
        for d in dec:
            net.edge_load[(p, d)] = shared if (p + d) % 3 == 0 else {
                r: rng.uniform(1e6, 1e9) for r in rng.sample(resources + ["link:free"], 3)}
    net.edge_load[(2, 4)] = {"nic-out:a": 0.0, "pipe:y>x": 2.0e8}  # a zero entry: no matrix entry of its own
    for g in pre + dec + col:
        net.node_load[g] = {r: rng.uniform(1e5, 1e8) for r in rng.sample(resources, rng.randint(0, 3))}
    lp = build_programme(net, [(p, d) for p in pre for d in dec])
    a, rhs, bounds, names = _reference(net)
    assert lp.names == names
    got = lp.matrix.toarray()
    assert got.shape == a.shape
    assert np.array_equal(got, a)  # the same floats: sums in the same order, the same scaling
    assert np.array_equal(lp.rhs, rhs)
    assert lp.bounds == bounds


def _pool():
    """Three sites of two 4×A100 boxes and one 4×L40 box each."""
    machines = []
    for s in "abc":
        machines += [{"name": f"{s}{i}", "gpu": "A100-SXM-80G", "count": 4, "site": s} for i in range(2)]
        machines.append({"name": f"{s}l", "gpu": "L40", "count": 4, "site": s})
    return cluster_from_dict({"name": "three-sites", "machines": machines,
                              "network": {"intra_site": {"bandwidth_gbps": 100, "latency_ms": 0.2},
                                          "inter_site": {"bandwidth_gbps": 3, "latency_ms": 15}}})


def test_capacity_bound_is_the_pending_bound_bit_for_bit(llama70b, azure):
    ctx, _, ev = start_search("t", _pool(), llama70b, azure, PlanOptions())
    cur = phase1(ctx, ev, 0)
    ev.evaluate(cur)  # its Group objects are now read by identity
    rng = random.Random(2)
    checked = 0
    for _ in range(200):
        cand = random_edit(ctx, cur, rng)
        if cand is None:
            continue
        fresh = canonical(Group(tuple(g.devices), str(g.role)) for g in cand)  # equal, not identical
        for layout in (cand, fresh):
            assert ev._capacity_bound(layout) == ev._pending(layout).bound
        checked += 1
    assert checked >= 50


def test_a_tie_behind_the_pick_is_not_solved(llama70b, azure, monkeypatch):
    """Candidates whose bounds sit a rounding error above their (equal) values: the first is
    solved, the rest tie with it and come later in list order, so they are not; the pick and its
    value are what scoring every candidate gives."""
    cluster = cluster_from_dict({
        "name": "two-sites",
        "machines": [{"name": n, "gpu": "A100-SXM-80G", "count": 4, "site": s}
                     for n, s in (("a0", "a"), ("a1", "a"), ("b0", "b"), ("b1", "b"))],
        "network": {"intra_site": {"bandwidth_gbps": 100, "latency_ms": 0.2},
                    "inter_site": {"bandwidth_gbps": 3, "latency_ms": 15}}})
    ctx, _, ev = start_search("t", cluster, llama70b, azure, PlanOptions())
    box = {}
    for d in cluster.devices:
        box.setdefault(d.machine, []).append(d.index)

    def layout(roles: dict[str, str]):
        return canonical(Group.of(box[m], r) for m, r in roles.items())

    # a site's two boxes are alike and the sites are alike: these four tie exactly
    cands = [layout({"a0": "prefill", "a1": "decode", "b0": "colocated", "b1": "colocated"}),
             layout({"a0": "decode", "a1": "prefill", "b0": "colocated", "b1": "colocated"}),
             layout({"b0": "prefill", "b1": "decode", "a0": "colocated", "a1": "colocated"}),
             layout({"b0": "decode", "b1": "prefill", "a0": "colocated", "a1": "colocated"})]
    values = [start_search("t", cluster, llama70b, azure, PlanOptions())[2].score(c) for c in cands]
    assert max(values) == pytest.approx(min(values), rel=1e-12)
    # bounds read a rounding error high (as sums in another order give them)
    bound = values[0] * (1 + 1e-14)
    monkeypatch.setattr(Evaluator, "_capacity_bound", lambda self, key: bound)
    pending = Evaluator._pending

    def rounded(self, groups, choice=None):
        c = pending(self, groups, choice)
        c.bound = bound
        return c

    monkeypatch.setattr(Evaluator, "_pending", rounded)
    solved = []
    solve = Evaluator._solve
    monkeypatch.setattr(Evaluator, "_solve", lambda self, c: solved.append(c.key) or solve(self, c))
    got, got_v = ev.best_of(cands, floor=0.0)
    assert got == 0
    assert got_v == values[0]
    assert solved == [cands[0]]


def test_fewer_collections_is_undone():
    before = gc.get_threshold()
    with fewer_collections(threshold=before[0] + 12345):
        assert gc.get_threshold()[0] == before[0] + 12345
        assert gc.get_threshold()[1:] == before[1:]
    assert gc.get_threshold() == before
