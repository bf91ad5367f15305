"""validate_plan: a good plan passes; each kind of mistake raises PlanError naming it."""

import dataclasses

import pytest

from hetserve.errors import PlanError
from hetserve.planner import KVRoute, Plan, PlanReplica, PlanStage, validate_plan
from hetserve.specs.cluster import load_cluster


@pytest.fixture(scope="module")
def het1():
    return load_cluster("hexgen2-het1")


def good_plan() -> Plan:
    return Plan("llama-2-70b", "hexgen2-het1", "manual", (
        PlanReplica("p0", "prefill", (PlanStage(("a100-0:0", "a100-0:1", "a100-0:2", "a100-0:3"), (0, 80)),)),
        PlanReplica("d0", "decode", (PlanStage(("a6000-0:0", "a6000-0:1", "a6000-0:2", "a6000-0:3"), (0, 40)),
                                     PlanStage(("a6000-0:4", "a6000-0:5", "a6000-0:6", "a6000-0:7"), (40, 80)))),
        PlanReplica("d1", "decode", (PlanStage(("h100-0:0", "h100-0:1"), (0, 80)),)),
    ), (KVRoute("p0", "d0", 0.6), KVRoute("p0", "d1", 0.4)))


def with_replica(plan, i, **changes):
    reps = list(plan.replicas)
    reps[i] = dataclasses.replace(reps[i], **changes)
    return dataclasses.replace(plan, replicas=tuple(reps))


def test_good_plan_passes(het1, llama70b):
    validate_plan(good_plan(), het1, llama70b)
    validate_plan(good_plan(), het1)  # model from the plan's preset name


def check(plan, cluster, model, *needles):
    with pytest.raises(PlanError) as err:
        validate_plan(plan, cluster, model)
    for n in needles:
        assert n in str(err.value), str(err.value)


def test_device_used_twice(het1, llama70b):
    p = with_replica(good_plan(), 2, stages=(PlanStage(("h100-0:0", "a100-0:0"), (0, 80)),))
    check(p, het1, llama70b, "device a100-0:0 is used twice", "replica p0 stage 0", "replica d1 stage 0")


def test_layer_gap(het1, llama70b):
    p = with_replica(good_plan(), 1, stages=(PlanStage(("a6000-0:0", "a6000-0:1", "a6000-0:2", "a6000-0:3"), (0, 40)),
                                             PlanStage(("a6000-0:4", "a6000-0:5", "a6000-0:6", "a6000-0:7"), (46, 80))))
    check(p, het1, llama70b, "replica d0 stage 1: starts at layer 46", "layers 40–46 are served by no stage")


def test_layer_overlap_and_short(het1, llama70b):
    p = with_replica(good_plan(), 1, stages=(PlanStage(("a6000-0:0", "a6000-0:1", "a6000-0:2", "a6000-0:3"), (0, 40)),
                                             PlanStage(("a6000-0:4", "a6000-0:5", "a6000-0:6", "a6000-0:7"), (30, 70))))
    check(p, het1, llama70b, "overlapping the previous stage", "stages end at layer 70")


def test_stage_over_memory(het1, llama70b):
    p = with_replica(good_plan(), 2, stages=(PlanStage(("h100-0:0",), (0, 80)),))
    check(p, het1, llama70b, "replica d1 stage 0", "GB per device", "h100-0:0 (H100-SXM-80G) has 72")


def test_route_from_decode_replica(het1, llama70b):
    p = dataclasses.replace(good_plan(), kv_routes=good_plan().kv_routes + (KVRoute("d0", "d1", 1.0),))
    check(p, het1, llama70b, "KV route d0 → d1: routes start at a prefill replica, but d0 is decode")


def test_route_weights_must_sum_to_one(het1, llama70b):
    p = dataclasses.replace(good_plan(), kv_routes=(KVRoute("p0", "d0", 0.6), KVRoute("p0", "d1", 0.1)))
    check(p, het1, llama70b, "weights out of prefill replica p0 sum to 0.7, expected 1")


def test_unknown_device(het1, llama70b):
    p = with_replica(good_plan(), 2, stages=(PlanStage(("h100-0:0", "h100-0:9"), (0, 80)),))
    check(p, het1, llama70b, "device 'h100-0:9' is not in cluster hexgen2-het1")


def test_unknown_route_target_and_tp(het1, llama70b):
    p = dataclasses.replace(good_plan(), kv_routes=(KVRoute("p0", "d0", 0.5), KVRoute("p0", "x9", 0.5)))
    check(p, het1, llama70b, "no replica 'x9'")
    q = with_replica(good_plan(), 0, stages=(PlanStage(("a100-0:0", "a100-0:1", "a100-0:2"), (0, 80)),))
    check(q, het1, llama70b, "TP degree 3 does not divide")


def test_prefill_without_decode(het1, llama70b):
    p = dataclasses.replace(good_plan(), replicas=good_plan().replicas[:1], kv_routes=())
    check(p, het1, llama70b, "no decode replica")


def test_plan_round_trip(tmp_path, het1, llama70b):
    for suffix in (".json", ".yaml"):
        path = tmp_path / f"plan{suffix}"
        good_plan().save(path)
        loaded = Plan.load(path)
        assert loaded == good_plan()
        validate_plan(loaded, het1, llama70b)
