"""Elastic re-plan of a P/D plan on the demo-tiny pool after one replica's death: the freed devices
alone cannot hold a replica (the planner says "infeasible"), and a kept prefill-only or decode-only
replica cannot serve alone; the re-plan must still give a plan that serves (its public promise:
"when the freed devices cannot hold a replica the kept ones make the whole plan")."""

from __future__ import annotations

import json

import pytest

from hetserve.planner.options import PlanOptions
from hetserve.planner.plan import Plan
from hetserve.planner.replan import replan
from hetserve.specs.cluster import load_cluster
from hetserve.specs.model import ModelSpec
from hetserve.specs.workload import load_workload

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
          "intermediate_size": 768, "num_attention_heads": 4, "num_hidden_layers": 8, "num_key_value_heads": 1,
          "head_dim": 64, "max_position_embeddings": 1024, "vocab_size": 320, "dtype": "float32",
          "tie_word_embeddings": False}
RUNNING = {"model": "tiny-llama", "cluster": "demo-tiny", "replicas": [
    {"id": "p0", "role": "prefill", "stages": [{"devices": ["m1:0"], "layers": [0, 1]},
                                               {"devices": ["m0:1"], "layers": [1, 8]}]},
    {"id": "d0", "role": "decode", "stages": [{"devices": ["m1:1"], "layers": [0, 4]},
                                              {"devices": ["m0:0"], "layers": [4, 8]}]}],
    "kv_routes": [{"from": "p0", "to": "d0", "weight": 1.0}]}


def _serves(plan: Plan) -> bool:
    roles = {r.role for r in plan.replicas}
    if "decode" in roles and not ({"prefill"} <= roles):
        return False
    fed = {k.dst for k in plan.kv_routes}
    return all(r.id in fed for r in plan.replicas if r.role == "decode") and (
        "colocated" in roles or {"prefill", "decode"} <= roles)


@pytest.mark.parametrize("dead, lost", [("d0", {"m1:1"}), ("p0", {"m0:1"}), ("p0", set())],
                         ids=["decode-died", "prefill-died", "prefill-died-device-back"])
def test_replan_after_a_death_gives_a_plan_that_serves(dead, lost, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    model = ModelSpec.from_hf_config(tmp_path, name="tiny-llama")
    plan = replan(load_cluster("demo-tiny"), model, load_workload("azure-conv"), Plan.from_dict(RUNNING), lost,
                  dead_replicas={dead}, options=PlanOptions(seed=0, time_limit_s=2))
    used = {d for r in plan.replicas for d in r.devices}
    assert not used & lost and _serves(plan), [(r.id, r.role, r.devices) for r in plan.replicas]
