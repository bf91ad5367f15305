"""``eft`` ranks every candidate in one pass (``_least``), passing over routed ones whose decode
seconds alone exceed the least so far: it keeps those of the least ``finish_s`` key, in order, bit for bit."""

import random

from hetserve.planner.plan import Plan
from hetserve.policies.base import ReplicaState, RequestInfo
from hetserve.policies.finish_time import ExpectedFinishTime
from hetserve.policies.placement import PolicyContext

# two of each kind share their flow (the same prices), so equal snapshots tie; prefill replicas
# with one, two and three KV routes
ROLES = {"p0": "prefill", "p1": "prefill", "p2": "prefill", "p3": "prefill", "p4": "prefill", "c0": "colocated",
         "c1": "colocated", "c2": "colocated", "d0": "decode", "d1": "decode", "d2": "decode"}
FLOW = {"p0": 40.0, "p1": 40.0, "p2": 75.0, "p3": 75.0, "p4": 52.0, "c0": 60.0, "c1": 60.0, "c2": 23.0,
        "d0": 90.0, "d1": 90.0, "d2": 31.0}


def _policy() -> ExpectedFinishTime:
    reps = [{"id": rid, "role": role, "stages": [{"devices": [f"m{i}:0"], "layers": [0, 80]}]}
            for i, (rid, role) in enumerate(ROLES.items())]
    est = {"period_s": 600.0, "mean_input_tokens": 900.0, "mean_output_tokens": 230.0,
           "replicas": {rid: {"flow_requests_per_period": FLOW[rid]} for rid in ROLES}}
    plan = Plan.from_dict({"model": "llama-2-70b", "cluster": "t", "replicas": reps, "estimate": est,
                           "kv_routes": [{"from": "p0", "to": "d0", "weight": 0.3}, {"from": "p0", "to": "d1", "weight": 0.7},
                                         {"from": "p1", "to": "d0", "weight": 0.3}, {"from": "p1", "to": "d1", "weight": 0.7},
                                         {"from": "p2", "to": "d2", "weight": 1.0}, {"from": "p3", "to": "d2", "weight": 1.0},
                                         {"from": "p4", "to": "d0", "weight": 0.2}, {"from": "p4", "to": "d1", "weight": 0.3},
                                         {"from": "p4", "to": "d2", "weight": 0.5}]})
    return ExpectedFinishTime(PolicyContext(plan=plan))


def _snapshot(rng: random.Random, rid: str, few: bool) -> ReplicaState:
    """Backlogs from a wide range, or (``few``) from a handful of values, so candidates tie."""
    if few:
        prompt, out = rng.choice((0, 400)), rng.choice((0.0, 400.0, 650.0))
    else:
        prompt, out = rng.randrange(0, 5000), rng.random() * 3000 - (1000 if rng.random() < 0.2 else 0)
    return ReplicaState(rid, ROLES[rid], rng.randrange(4), rng.randrange(9), prompt, prompt + out, 0, 0, 0)


def _plain_least(policy: ExpectedFinishTime, request: RequestInfo, cands: list[ReplicaState]) -> list[ReplicaState]:
    keys = [policy.finish_s(request, c) for c in cands]
    return [c for c, k in zip(cands, keys) if k == min(keys)]


def test_the_least_are_those_of_the_least_finish_s_key():
    policy, rng = _policy(), random.Random(5)
    assert sorted(len(r) for r in policy.routes.values()) == [1, 1, 2, 2, 3]
    ties = 0
    for i in range(3000):
        few = i % 2 == 0
        request = RequestInfo(i, 0.0, rng.choice((300, 900)) if few else rng.randrange(1, 4000),
                              rng.choice((50.0, 200.0)) if few else rng.random() * 700 + 1)
        cands = [_snapshot(rng, rid, few) for rid in rng.sample(sorted(ROLES), rng.randrange(1, len(ROLES) + 1))]
        got = policy._least(request, cands)
        assert [id(c) for c in got] == [id(c) for c in _plain_least(policy, request, cands)]
        ties += len(got) > 1
        policy.choose(request, cands, 0.0)  # books output on the decode replicas behind a prefill one
        if rng.random() < 0.3 and policy._sent:  # and some finish
            policy.on_finish(rng.choice(sorted(policy._sent)), 0, 0)
    assert policy._decoding  # later rounds ranked prefill replicas with decode work booked
    assert ties > 100  # ties were kept whole, in candidate order


def test_a_candidate_without_a_price_gives_no_least():
    policy = _policy()
    request = RequestInfo(0, 0.0, 100, 10.0)
    stranger = ReplicaState("x9", "colocated", 0, 0, 0, 0.0, 0, 0, 0)
    assert policy._least(request, [_snapshot(random.Random(1), "c0", False), stranger]) is None
