"""``eft`` ranks every candidate in one pass: the keys equal ``finish_s``'s, bit for bit."""

import random

from hetserve.planner.plan import Plan
from hetserve.policies.base import ReplicaState, RequestInfo
from hetserve.policies.finish_time import ExpectedFinishTime
from hetserve.policies.placement import PolicyContext

ROLES = {"p0": "prefill", "p1": "prefill", "c0": "colocated", "d0": "decode", "d1": "decode"}


def _policy() -> ExpectedFinishTime:
    reps = [{"id": rid, "role": role, "stages": [{"devices": [f"m{i}:0"], "layers": [0, 80]}]}
            for i, (rid, role) in enumerate(ROLES.items())]
    est = {"period_s": 600.0, "mean_input_tokens": 900.0, "mean_output_tokens": 230.0,
           "replicas": {rid: {"flow_requests_per_period": 40.0 + 17 * i} for i, rid in enumerate(ROLES)}}
    plan = Plan.from_dict({"model": "llama-2-70b", "cluster": "t", "replicas": reps, "estimate": est,
                           "kv_routes": [{"from": "p0", "to": "d0", "weight": 0.3}, {"from": "p0", "to": "d1", "weight": 0.7},
                                         {"from": "p1", "to": "d1", "weight": 1.0}]})
    return ExpectedFinishTime(PolicyContext(plan=plan))


def _snapshot(rng: random.Random, rid: str) -> ReplicaState:
    prompt = rng.randrange(0, 5000)
    return ReplicaState(rid, ROLES[rid], rng.randrange(4), rng.randrange(9), prompt,
                        prompt + rng.random() * 3000 - (1000 if rng.random() < 0.2 else 0), 0, 0, 0)


def test_keys_are_finish_s_for_every_candidate():
    policy, rng = _policy(), random.Random(5)
    assert set(policy.routes) == {"p0", "p1"}
    for i in range(300):
        request = RequestInfo(i, 0.0, rng.randrange(1, 4000), rng.random() * 700 + 1)
        cands = [_snapshot(rng, rid) for rid in rng.sample(sorted(ROLES), rng.randrange(1, len(ROLES) + 1))]
        assert policy._keys(request, cands) == [policy.finish_s(request, c) for c in cands]
        policy.choose(request, cands, 0.0)  # books output on the decode replicas behind a prefill one
    assert policy._decoding  # later rounds ranked prefill replicas with decode work booked


def test_a_candidate_without_a_price_gives_no_keys():
    policy = _policy()
    request = RequestInfo(0, 0.0, 100, 10.0)
    stranger = ReplicaState("x9", "colocated", 0, 0, 0, 0.0, 0, 0, 0)
    assert policy._keys(request, [_snapshot(random.Random(1), "c0"), stranger]) is None
