"""plan --engine: the layout search keeps to the replica shapes an engine runs, and the plan exports."""

import json

import pytest

from hetserve.cli.main import main
from hetserve.export.rules import violations
from hetserve.planner import PlanOptions
from hetserve.planner.context import PlanContext
from hetserve.planner.plan import Plan
from hetserve.specs.cluster import load_cluster
from hetserve.specs.model import load_model
from hetserve.specs.workload import load_workload


@pytest.fixture(scope="module")
def het1():
    return load_cluster("hexgen2-het1"), load_model("llama-2-70b"), load_workload("azure-conv")


def shapes(ctx, devices, role):
    layout, _ = ctx.layouts.best(devices, role)
    return [(len(s.devices), ctx.cluster.devices[s.devices[0]].machine) for s in layout.stages]


def test_layout_search_keeps_to_the_engine(het1):
    # 2 H100 + 4 A100 as a decode replica: unrestricted, TP 4 on the A100s feeds TP 2 on the H100s
    devices = [0, 1, 2, 3, 4, 5]
    free = shapes(PlanContext(*het1, PlanOptions()), devices, "decode")
    assert len({tp for tp, _ in free}) > 1
    vllm = shapes(PlanContext(*het1, PlanOptions(engine="vllm")), devices, "decode")
    assert len(vllm) == 1  # one TP degree, and an unpipelined decode replica (NIXL)
    for role in ("prefill", "colocated", "decode"):
        sg = shapes(PlanContext(*het1, PlanOptions(engine="sglang")), [2, 3, 4, 5, 6, 7, 8, 9], role)
        assert len({tp for tp, _ in sg}) == 1
        per_machine = {}
        for _, m in sg:
            per_machine[m] = per_machine.get(m, 0) + 1
        assert len(set(per_machine.values())) == 1, sg


def test_unknown_engine_is_refused():
    with pytest.raises(ValueError, match="engine must be one of hetserve, vllm, sglang"):
        PlanOptions(engine="trt")


POOL = ("name: pool\nmachines:\n  - {name: a0, gpu: H100-SXM-80G, count: 2, address: 10.0.0.5}\n"
        "  - {name: b0, gpu: A100-SXM-80G, count: 4, address: 10.0.0.6}\n"
        "network:\n  intra_site: {bandwidth_gbps: 25, latency_ms: 0.2}\n")


def test_plan_engine_vllm_explains_and_exports(tmp_path, capsys):
    cluster = tmp_path / "pool.yaml"
    cluster.write_text(POOL)
    out = tmp_path / "plan.json"
    assert main(["plan", "--cluster", str(cluster), "--model", "llama-2-70b", "--engine", "vllm", "--disaggregated",
                 "--time-limit", "1", "--quiet", "--explain", "-o", str(out)]) == 0
    said = " ".join(capsys.readouterr().out.split())  # rich wraps at the terminal width
    assert "what vllm's rules cost" in said and "unrestricted (hexgen2" in said and "bound" in said
    plan = Plan.load(out)
    assert violations(plan, "vllm") == []
    assert plan.estimate["engine"] == "vllm"
    assert main(["export", "--plan", str(out), "--to", "vllm", "-o", str(tmp_path / "b")]) == 0
    deploy = json.loads((tmp_path / "b" / "deploy.json").read_text())
    assert sorted(deploy["replicas"][i]["id"] for i in range(len(deploy["replicas"]))) == sorted(
        r.id for r in plan.replicas)


def test_explain_sets_engine_estimate_beside_unrestricted_and_bound(het1, tmp_path):
    from hetserve.planner import ALGORITHMS
    from hetserve.planner.explain import engine_cost

    (tmp_path / "pool.yaml").write_text(POOL)
    cluster, model, workload = load_cluster(tmp_path / "pool.yaml"), het1[1], het1[2]
    opts = PlanOptions(engine="vllm", time_limit_s=1.0, allow_colocated=False, restarts=0)
    plan = ALGORITHMS["hexgen2"](cluster, model, workload, opts)
    row = engine_cost(plan, cluster, model, workload, opts, ALGORITHMS["hexgen2"])
    assert row["engine"] == "vllm"
    assert row["engine_tokens_per_s"] == plan.estimate["throughput_tokens_per_s"]
    assert violations(plan, "vllm") == []
    # the unrestricted search may use shapes vLLM cannot run; the bound is above both
    assert 0 < row["engine_tokens_per_s"] <= row["upper_bound_tokens_per_s"] * (1 + 1e-9)
    assert 0 < row["unrestricted_tokens_per_s"] <= row["upper_bound_tokens_per_s"] * (1 + 1e-9)
