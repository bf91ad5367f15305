"""Baseline placement and route policies: each test fails if the policy were round robin."""

import random
from collections import Counter

import pytest

from hetserve.policies.base import ReplicaState, RequestInfo
from hetserve.policies.placement import (PLACEMENT_POLICIES, PolicyContext, make_placement, placement_names,
                                         register_placement)
from hetserve.policies.routing import make_route

REQ = RequestInfo(0, 0.0, 500, 100.0)


def st(rid, queued=0, running=0, outstanding=0.0, cap=1.0):
    return ReplicaState(rid, "colocated", queued, running, 0, outstanding, 0, 0, 1000, capacity_norm=cap)


def test_round_robin_cycles():
    rr = make_placement("rr")
    c = [st("a"), st("b"), st("c")]
    assert [rr.choose(REQ, c, 0) for _ in range(6)] == list("abcabc")


def test_jsq_avoids_the_loaded_replica():
    jsq = make_placement("jsq")
    c = [st("a", queued=5, running=3), st("b", running=1), st("c", queued=1, running=2)]
    assert {jsq.choose(REQ, c, 0) for _ in range(10)} == {"b"}


def test_jsq_spreads_among_ties():
    jsq = make_placement("jsq")
    c = [st("a"), st("b"), st("c", running=1)]
    assert Counter(jsq.choose(REQ, c, 0) for _ in range(10)) == {"a": 5, "b": 5}


def test_jsq_picks_as_the_least_load_and_tokens_key_with_round_robin_ties():
    """The least ``(load, outstanding tokens)`` in candidate order, the n-th decision taking tie n
    (mod their number): the rule written as one key per candidate."""
    rng = random.Random(7)
    jsq, turn = make_placement("jsq"), 0
    for _ in range(300):
        c = [st(f"r{i}", rng.randint(0, 2), rng.randint(0, 2), float(rng.choice((0, 100, 250))))
             for i in range(rng.randint(1, 12))]
        keys = [(x.load, x.outstanding_tokens) for x in c]
        tied = [x.id for x, k in zip(c, keys) if k == min(keys)]
        turn += 1
        assert jsq.choose(REQ, c, 0) == tied[turn % len(tied)]


def test_lot_follows_tokens_not_request_counts():
    lot = make_placement("lot")
    c = [st("a", running=1, outstanding=9000), st("b", running=4, outstanding=800)]
    assert {lot.choose(REQ, c, 0) for _ in range(6)} == {"b"}
    # per unit of capacity: a replica twice as fast may hold twice the tokens
    c = [st("slow", outstanding=600, cap=0.5), st("fast", outstanding=1000, cap=1.0)]
    assert lot.choose(REQ, c, 0) == "fast"


def test_po2_never_picks_the_most_loaded_and_is_seeded():
    c = [st(f"r{i}", running=i) for i in range(8)]
    a = make_placement("po2", PolicyContext(seed=1))
    picks = [a.choose(REQ, c, 0) for _ in range(400)]
    assert "r7" not in picks  # the more loaded of any two draws never wins
    assert Counter(picks)["r0"] > Counter(picks)["r6"]
    b = make_placement("po2", PolicyContext(seed=1))
    assert [b.choose(REQ, c, 0) for _ in range(400)] == picks
    other = make_placement("po2", PolicyContext(seed=2))
    assert [other.choose(REQ, c, 0) for _ in range(400)] != picks


def test_registry_is_extensible():
    class First:
        name = "first"

        def __init__(self, ctx):
            self.seed = ctx.seed

        def choose(self, request, candidates, now):
            return candidates[0].id

        def on_finish(self, *a):
            pass

    register_placement("first-test", First)
    try:
        assert make_placement("first-test", PolicyContext(seed=3)).seed == 3
        assert "first-test" in placement_names() and "aladdin" in placement_names()
    finally:
        PLACEMENT_POLICIES.pop("first-test")
    with pytest.raises(ValueError, match="jsq"):
        make_placement("nope")


def test_flow_route_follows_weights_exactly():
    route = make_route("flow")
    cands = [(st("d0"), 0.75), (st("d1"), 0.25), (st("d2"), 0.0)]
    picks = [route.choose(REQ, "p0", cands, 0) for _ in range(8)]
    assert Counter(picks) == {"d0": 6, "d1": 2}
    assert picks[:4].count("d1") == 1  # smooth: interleaved, not 6 then 2


def test_load_route_avoids_the_loaded_decoder():
    route = make_route("load")
    cands = [(st("d0", running=40), 0.5), (st("d1", running=3), 0.5)]
    assert {route.choose(REQ, "p0", cands, 0) for _ in range(5)} == {"d1"}
    # weights still count: twice the weight may carry twice the load
    cands = [(st("d0", running=5), 0.66), (st("d1", running=3), 0.34)]
    assert route.choose(REQ, "p0", cands, 0) == "d0"
