"""One set of plan checks: the planner's validator, the simulator and the runtime refuse the same
broken plans with the same words (``planner.validate.plan_problems``), and accept the same good ones.

No worker starts: ``build_layout`` is the runtime's check, the ``Simulator`` constructor the
simulator's; the model is the tiny Llama of the runtime tests, described by its config only.
"""

from __future__ import annotations

import dataclasses

import pytest

from hetserve.errors import PlanError
from hetserve.planner.plan import Plan
from hetserve.planner.validate import validate_plan
from hetserve.runtime.deployment import DTYPE_BYTES, build_layout, model_spec
from hetserve.runtime.model.config import ArchConfig
from hetserve.sim.simulator import Simulator
from hetserve.specs.cluster import cluster_from_dict
from hetserve.specs.workload import Workload

CFG = ArchConfig.from_dict({"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
                            "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
                            "max_position_embeddings": 256})
CLUSTER = cluster_from_dict({"name": "runtime-test", "machines": [{"name": "m0", "gpu": "RTX-4090", "count": 4}]})
SPEC = dataclasses.replace(model_spec(CFG, DTYPE_BYTES["float32"]), name="tiny")


def plan(replicas, routes=()) -> Plan:
    st = lambda devs, lo, hi: {"devices": list(devs), "layers": [lo, hi]}  # noqa: E731
    return Plan.from_dict({"model": "tiny", "cluster": "runtime-test",
                           "replicas": [{"id": i, "role": role, "stages": [st(*s) for s in stages]}
                                        for i, role, stages in replicas],
                           "kv_routes": [{"from": a, "to": b, "weight": 1.0} for a, b in routes]})


GOOD = plan([("p0", "prefill", [(["m0:0", "m0:1"], 0, 3)]), ("d0", "decode", [(["m0:2"], 0, 2), (["m0:3"], 2, 3)])],
            [("p0", "d0")])

BROKEN = {  # plan, the problem every checker must name
    "layer gap": (plan([("c0", "colocated", [(["m0:0"], 0, 1), (["m0:1"], 2, 3)])]),
                  "replica c0 stage 1: starts at layer 2 but the layers before end at 1"),
    "short": (plan([("c0", "colocated", [(["m0:0"], 0, 2)])]), "replica c0: stages end at layer 2"),
    "TP 3": (plan([("c0", "colocated", [(["m0:0", "m0:1", "m0:2"], 0, 3)])]), "TP degree 3 does not divide"),
    "device twice": (plan([("c0", "colocated", [(["m0:0"], 0, 3)]), ("c1", "colocated", [(["m0:0"], 0, 3)])]),
                     "device m0:0 is used twice"),
    "unknown device": (plan([("c0", "colocated", [(["m9:0"], 0, 3)])]), "device 'm9:0' is not in cluster"),
    "prefill alone": (plan([("p0", "prefill", [(["m0:0"], 0, 3)])]),
                      "prefill replicas (p0) but no decode replica to send KV caches to"),
    "route from decode": (plan([("p0", "prefill", [(["m0:0"], 0, 3)]), ("d0", "decode", [(["m0:1"], 0, 3)]),
                                ("d1", "decode", [(["m0:2"], 0, 3)])], [("p0", "d0"), ("d0", "d1")]),
                          "KV route d0 → d1: routes start at a prefill replica, but d0 is decode"),
}


def problem_of(check) -> str:
    with pytest.raises(PlanError) as err:
        check()
    return str(err.value)


def simulate_check(p: Plan) -> None:
    Simulator(p, CLUSTER, SPEC, Workload.from_lists("one", [0.0], [8], [4]))


def runtime_check(p: Plan):
    return build_layout(p, CLUSTER, CFG, {d: "cpu" for d in p.devices})


def test_good_plan_passes_every_checker():
    validate_plan(GOOD, CLUSTER, SPEC)
    simulate_check(GOOD)
    assert [r.id for r in runtime_check(GOOD)] == ["p0", "d0"]


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_validator_simulator_and_runtime_refuse_the_same_plans(name):
    broken, problem = BROKEN[name]
    for check in (lambda: validate_plan(broken, CLUSTER, SPEC), lambda: simulate_check(broken),
                  lambda: runtime_check(broken)):
        assert problem in problem_of(check)


def test_engines_accept_a_prefill_replica_without_routes_the_validator_does_not():
    """Without routes a prefill replica sends to every decode replica (``route_candidates``), so the
    engines run it; a plan file the planner writes must carry its routes."""
    no_routes = dataclasses.replace(GOOD, kv_routes=())
    simulate_check(no_routes)
    runtime_check(no_routes)
    assert "prefill replica p0 has no KV route" in problem_of(lambda: validate_plan(no_routes, CLUSTER, SPEC))


def test_the_engine_sizes_kv_by_the_planners_memory_rule():
    """One rule: the engine's KV pool per replica is the cost model's stage KV capacity (weights,
    activation buffers and KV within the usable memory), whatever the rounding to whole tokens."""
    from hetserve.cost.analytic import CostModel
    from hetserve.cost.efficiency import Efficiency
    from hetserve.planner.plan import Plan
    from hetserve.runtime.deployment import build_layout, check_memory, model_spec
    from hetserve.runtime.model.config import ArchConfig
    from hetserve.specs.cluster import load_cluster

    cluster = load_cluster("demo-cpu")
    raw = {"model_type": "llama", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
           "max_position_embeddings": 128, "_name_or_path": "tiny"}
    cfg = ArchConfig.from_dict(raw)
    plan = Plan.from_dict({"model": "tiny", "cluster": "demo-cpu", "replicas": [
        {"id": "c0", "role": "colocated", "stages": [{"devices": ["m0:0"], "layers": [0, 2]},
                                                     {"devices": ["m0:1", "m1:0"], "layers": [2, 4]}]}]})
    layout = build_layout(plan, cluster, cfg, {d.name: d.name for d in cluster.devices})
    for fraction in (0.9, 0.5):
        engine = check_memory(layout, cluster, cfg, "float32", fraction)["c0"]
        cost = CostModel(cluster, model_spec(cfg, 4), Efficiency(usable_memory=fraction))
        planned = cost.kv_capacity_tokens(plan.replicas[0].layout(cluster))
        assert engine == int(planned) or abs(engine - planned) <= 1, (engine, planned)
