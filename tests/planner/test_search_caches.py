"""The shortcuts that make large searches fast must not change what they compute:

* isomorphic compositions share one layout search (``LayoutSearch._representative``): the shared
  result has exactly the capacity a fresh search of that composition finds;
* candidates skipped by the weak-duality bound (``flow.dual_bound`` / ``Evaluator._dual_bound``)
  could not have won: the bound is never below the LP's max flow, and a search gives the same
  plan with the shortcut as without it;
* ``Evaluator.best_of`` (bounds first, flows solved best bound first) picks what a scan that
  scores every candidate in full picks: the best value, the first in list order among ties.
"""

import random

import pytest

from hetserve.planner import PlanOptions
from hetserve.planner.pool.flow import dual_bound, solve_with_resources
from hetserve.planner.search.hexgen2 import hexgen2
from hetserve.planner.search.moves import random_edit
from hetserve.planner.pool.evaluator import Evaluator, start_search
from hetserve.specs.cluster import cluster_from_dict, load_cluster


@pytest.fixture(autouse=True)
def _no_group_bound(monkeypatch):
    """The searches' own shortcuts are the subject, not the plan's upper bound: no group programme
    (a MILP of about a minute on het1) prices the estimates or seeds a second climb from its plan."""
    from hetserve.planner.bound import throughput

    monkeypatch.setattr(throughput, "group_bound", lambda *args, **kwargs: None)


def _two_site_pool():
    """Four identical 4×A100 boxes, two per site: {a0, a1} and {a1, b0} have the same GPU types
    and counts but not the same link between their boxes."""
    return cluster_from_dict({
        "name": "two-sites",
        "machines": [{"name": n, "gpu": "A100-SXM-80G", "count": 4, "site": s}
                     for n, s in (("a0", "a"), ("a1", "a"), ("b0", "b"), ("b1", "b"))],
        "network": {"intra_site": {"bandwidth_gbps": 100, "latency_ms": 0.2},
                    "inter_site": {"bandwidth_gbps": 3, "latency_ms": 15}},
    })


def test_isomorphic_compositions_share_a_search_with_the_same_capacity(llama70b, azure):
    cluster = _two_site_pool()
    ctx = start_search("t", cluster, llama70b, azure, PlanOptions())[0]
    fresh = start_search("t", cluster, llama70b, azure, PlanOptions())[0]
    classes = {cluster.devices[ctx.classes[k][0]].machine: k for k in range(len(ctx.classes))}
    pairs = [("a0", "a1"), ("b0", "b1"), ("a1", "b0"), ("a0", "b1"), ("a0", "a1")]
    searched_before = None
    for role in ("prefill", "decode", "colocated"):
        for x, y in pairs:
            for n in (2, 4):
                comp = tuple(sorted(((classes[x], n), (classes[y], 4))))
                got = ctx.layouts.choice(comp, role)
                want = fresh.layouts._search(comp, role)  # no cache, no representative
                assert (got is None) == (want is None)
                if got is None:
                    continue
                assert got.capacity == pytest.approx(want.capacity, rel=1e-12), (role, x, y, n)
                devices = [d for k, c in comp for d in ctx.classes[k][:c]]
                layout = ctx.layouts.materialize(devices, got)
                assert set(layout.devices) <= set(devices)
                assert ctx.layouts.layout_capacity(layout, role) == pytest.approx(got.capacity, rel=1e-12)
                for alt, cap in ctx.layouts.options(devices, role):
                    assert set(alt.devices) <= set(devices)
                    assert ctx.layouts.layout_capacity(alt, role) == pytest.approx(cap, rel=1e-12)
        if searched_before is None:
            searched_before = ctx.layouts.searches
    # same-site pairs share one search, cross-site pairs another: far fewer searches than asks
    assert ctx.layouts.searches < fresh.layouts.searches


def test_dual_bound_is_never_below_the_lp(llama70b, azure):
    """Prices from one placement's LP bound its random neighbours' LPs (weak duality), and a
    new group priced to minimise the bound (``flow._best_price``) keeps it valid; a negative
    price (not dual feasible) fails here."""
    cluster = load_cluster("hexgen2-het1")  # every KV route between sites crosses a shared pipe
    ctx, _, ev = start_search("t", cluster, llama70b, azure, PlanOptions())
    rng = random.Random(3)
    from hetserve.planner.search.hexgen2 import phase1

    cur = phase1(ctx, ev, 0)
    checked = 0
    # random walks until 10 neighbours whose shared resources load were checked (how many of a
    # walk's neighbours qualify depends on the phase-1 start, i.e. on the BLAS's rounding)
    for _ in range(60):
        if checked >= 10:
            break
        e = ev.evaluate(cur)
        if e.flow.node_dual:
            prices = {cur[i]: y for i, y in e.flow.node_dual.items()}
            for _ in range(6):
                cand = random_edit(ctx, cur, rng)
                if cand is None:
                    continue
                _, _, net, _ = ev._network(cand)
                if not (net.prefill and net.decode and net.loads_resources()):
                    continue
                lp = solve_with_resources(net).total
                bound = dual_bound(net, {i: prices.get(cand[i]) for i in net.prefill + net.decode},
                                   e.flow.resource_dual)
                assert bound >= lp * (1 - 1e-7) - 1e-9
                checked += 1
        cur = random_edit(ctx, cur, rng) or cur
    assert checked >= 10


OPTS = PlanOptions(seed=0, restarts=2, max_iterations=6)


def _spied_search(cluster, model, wl):
    """One hexgen2 search with its shortcuts spied on (the spies only record): the candidates the
    duality bound skipped (key, bound), each ``best_of`` call (candidates, floor, its pick, whether
    prices were held) and each neighbour bound claimed (key, its bound, ``_dual_bound``'s)."""
    from types import SimpleNamespace

    run = SimpleNamespace(skipped=[], calls=[], seen=[])
    dual, best_of, neighbour = Evaluator._dual_bound, Evaluator.best_of, Evaluator._neighbour_bound

    def dual_spy(self, c, floor=None):
        bound = dual(self, c, floor)
        if bound is not None:
            run.skipped.append((c.key, bound))
        return bound

    def best_of_spy(self, candidates, floor, *args, **kw):
        got = best_of(self, candidates, floor, *args, **kw)
        run.calls.append((list(candidates), floor, got, self._prices is not None))
        return got

    def neighbour_spy(self, c):
        got = neighbour(self, c)
        if got is not None:
            self._build(c)
            run.seen.append((c.key, got, dual(self, c)))
        return got

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Evaluator, "_dual_bound", dual_spy)
        mp.setattr(Evaluator, "best_of", best_of_spy)
        mp.setattr(Evaluator, "_neighbour_bound", neighbour_spy)
        run.plan = hexgen2(cluster, model, wl, OPTS)
    return run


@pytest.fixture(scope="module")
def het1_search(llama70b, azure):
    """het1's search, run once for the three tests that read what its shortcuts did."""
    from hetserve.planner.bound import throughput

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(throughput, "group_bound", lambda *args, **kwargs: None)
        return _spied_search(load_cluster("hexgen2-het1"), llama70b, azure)


def test_every_candidate_the_dual_shortcut_skips_scores_at_most_its_bound(llama70b, azure, het1_search,
                                                                           monkeypatch):
    """In a real search: each skipped candidate, scored in full by a fresh evaluator (its layout
    alternatives included), is worth no more than the bound that skipped it — so it could not
    have been picked — and the search ends where it ends without the shortcut."""
    cluster = load_cluster("hexgen2-het1")
    skipped = het1_search.skipped
    assert len(skipped) >= 10
    ctx, _, reference = start_search("t", cluster, llama70b, azure, OPTS)
    monkeypatch.setattr(Evaluator, "_dual_bound", lambda self, c, floor=None: None)
    for key, bound in skipped[:40]:
        assert reference.score(key) <= bound * (1 + 1e-9)
    slow = hexgen2(cluster, llama70b, azure, OPTS)
    assert het1_search.plan.estimate["throughput_tokens_per_s"] == pytest.approx(
        slow.estimate["throughput_tokens_per_s"], rel=1e-9)


def test_colocated_side_cuts_pairs_of_machines_together(llama70b, azure):
    """hexgen2-het1: a colocated replica of 2 H100 + 2 A100 (two machines) serves more than the
    per-machine cuts; the colocated alternative finds it from any groups, so seeds agree."""
    from hetserve.planner.search.mixing import colocated_alternative
    from hetserve.planner.pool.groups import Group, canonical

    cluster = load_cluster("hexgen2-het1")
    ctx, _, ev = start_search("t", cluster, llama70b, azure, PlanOptions())
    per_machine: dict[str, list[int]] = {}
    for d in cluster.devices:
        per_machine.setdefault(d.machine, []).append(d.index)
    machines = canonical(Group.of(ds, "colocated") for ds in per_machine.values())
    placement, value = colocated_alternative(ctx, ev, machines)
    spans = [{cluster.devices[d].machine for d in g.devices} for g in placement]
    assert any(len(s) > 1 for s in spans)
    assert value > ev.score(machines) * 1.01


@pytest.mark.parametrize("pool", ["hexgen2-het1", "two-sites"])
def test_best_of_picks_what_a_full_scan_picks(llama70b, azure, pool, request):
    """Over a real search's candidate lists (het1: shared pipes bind, so the duality bound
    prunes; two-sites: identical boxes, so many candidates tie exactly), ``best_of`` returns the
    candidate a scan scoring every candidate in full keeps: the best, the first of equals. A
    bound read too low, or ties broken by which flow was solved first, fails here."""
    cluster = load_cluster(pool) if pool != "two-sites" else _two_site_pool()
    calls = (request.getfixturevalue("het1_search") if pool == "hexgen2-het1"
             else _spied_search(cluster, llama70b, azure)).calls
    reference = start_search("t", cluster, llama70b, azure, OPTS)[2]
    ties = 0
    for candidates, floor, (got, got_v), _ in calls:
        full = [reference.score(c) for c in candidates]
        pick, pick_v = None, floor
        for i, v in enumerate(full):
            if v > pick_v * (1 + 1e-9) + 1e-12:
                pick, pick_v = i, v
        assert got == pick
        assert got_v == pytest.approx(pick_v, rel=1e-12)
        if pick is not None:
            ties += sum(1 for v in full[pick + 1:] if v >= pick_v * (1 - 1e-9))
    assert len(calls) >= 5
    if pool == "two-sites":
        assert ties > 0
    else:
        assert sum(priced for *_, priced in calls) >= 2


def test_neighbour_bound_is_the_duality_bound_from_the_base_terms(llama70b, azure, het1_search):
    """``NeighbourBound`` (the base placement's dual terms plus the added groups' columns) gives
    the bound ``flow.dual_bound`` computes on the candidate's whole network, and claims it only
    where it bounds the candidate's score. A dropped or double-counted column fails here."""
    seen = het1_search.seen
    assert len(seen) >= 5
    reference = start_search("t", load_cluster("hexgen2-het1"), llama70b, azure, OPTS)[2]
    for key, got, exact in seen:
        assert exact == pytest.approx(got, rel=1e-9)
        assert reference.score(key) <= got * (1 + 1e-9)
