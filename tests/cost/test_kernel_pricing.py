"""The cost model prices real GPUs with the fitted kernel model by default, CPU worker slots and
passed calibrations with the roofline; ``hetserve cost layer`` and ``cost fit`` from the command line."""

from __future__ import annotations

import json
import shutil

import pytest

from hetserve.cli.main import main
from hetserve.cost.analytic import CostModel
from hetserve.cost.efficiency import Efficiency
from hetserve.cost.kernel_pricing import layer_rows
from hetserve.cost.kernel_table import default_table, load_table
from hetserve.cost.layout import ReplicaLayout, StageLayout
from hetserve.cost.memo import memoised
from hetserve.specs.cluster import cluster_from_dict
from hetserve.cost.profiles import BUNDLED_PROFILES
from hetserve.specs.gpus import gpu
from hetserve.specs.model import MODEL_PRESETS

LLAMA7 = MODEL_PRESETS["llama-2-7b"]
PROFILES = BUNDLED_PROFILES  # the profiles the bundled fit was made on


def _cluster(gpu_name: str, count: int = 2, **extra):
    return cluster_from_dict({"name": "k", "machines": [{"name": "m", "gpu": gpu_name, "count": count, **extra}]})


def _one_stage(tp: int = 1) -> ReplicaLayout:
    return ReplicaLayout((StageLayout(tuple(range(tp)), (0, LLAMA7.num_layers)),))


def test_real_gpus_are_priced_by_the_kernel_model_by_default():
    """A decode step of one sequence on one A100: every layer the fitted kernels at one row plus
    reading one token of KV, then the LM head: not the roofline's figure."""
    cm = CostModel(_cluster("A100-SXM-80G", 1), LLAMA7)
    assert cm.pricing() == {"A100-SXM-80G": "fitted"}
    (row,), source = layer_rows(gpu("A100-SXM-80G"), LLAMA7, [1], [1])
    k = cm.kernels
    expected = LLAMA7.num_layers * (row["layer_s"] + k.attention((0,), 4.0 * LLAMA7.q_dim * 1,
                                                                 LLAMA7.kv_bytes_per_token_per_layer)) + k.head((0,), 1)
    assert source == "fitted"
    assert cm.decode_step_time(_one_stage(), 1, 1) == pytest.approx(expected, rel=1e-9)
    roof = CostModel(_cluster("A100-SXM-80G", 1), LLAMA7, kernels=False)
    assert abs(roof.decode_step_time(_one_stage(), 1, 1) / expected - 1) > 0.05
    assert CostModel(_cluster("H100-SXM-80G", 1), LLAMA7).pricing() == {"H100-SXM-80G": "transferred"}


def test_a_passed_efficiency_and_cpu_worker_slots_keep_the_roofline():
    for cm in (CostModel(_cluster("RTX-4090"), LLAMA7, Efficiency()),
               CostModel(_cluster("RTX-4090", cpu_cores=2), LLAMA7)):
        roof = CostModel(cm.cluster, LLAMA7, kernels=False)
        assert cm.pricing() == {"RTX-4090": "roofline"}
        assert cm.decode_step_time(_one_stage(2), 3, 300) == roof.decode_step_time(_one_stage(2), 3, 300)
        assert cm.ttft(_one_stage(2), 500) == roof.ttft(_one_stage(2), 500)


def test_the_simulators_memoised_twin_keeps_the_kernel_model():
    cm = CostModel(_cluster("A40"), LLAMA7)
    twin = memoised(cm)
    assert twin.kernels is not None
    assert twin.decode_step_time(_one_stage(2), 4, 400) == pytest.approx(cm.decode_step_time(_one_stage(2), 4, 400))


def test_in_box_allreduce_from_the_fit_across_boxes_alpha_beta():
    cm = CostModel(_cluster("A100-SXM-80G", 8), LLAMA7)
    link = float(cm.cluster.bandwidth[0, 1])
    assert cm.allreduce_time(range(8), 8e6) == default_table().allreduce_time(8, 8e6, link)
    two = cluster_from_dict({"name": "k", "machines": [{"name": "a", "gpu": "A100-SXM-80G", "count": 1},
                                                       {"name": "b", "gpu": "A100-SXM-80G", "count": 1}],
                             "network": {"intra_site": {"bandwidth_gbps": 100, "latency_ms": 0.5}}})
    cross = CostModel(two, LLAMA7)
    assert cross.allreduce_time([0, 1], 8e6) == CostModel(two, LLAMA7, kernels=False).allreduce_time([0, 1], 8e6)


def test_cost_layer_prints_json_rows_with_the_agreed_keys(capsys):
    assert main(["cost", "layer", "--gpu", "H100-SXM-80G", "--model", "llama-2-70b", "--tp", "1,2,4,8",
                 "--tokens", "1,16,64,512,4096", "--json"]) == 0
    out = capsys.readouterr()
    rows = json.loads(out.out)
    assert len(rows) == 20
    assert all(set(r) == {"gpu", "model", "tp", "tokens", "linear_s", "layer_s", "allreduce_s", "source",
                          "extrapolated"} for r in rows)
    assert {(r["source"], r["extrapolated"]) for r in rows} == {("transferred", False)}
    assert all(0 < r["linear_s"] < r["layer_s"] for r in rows)
    assert [r["allreduce_s"] == 0 for r in rows] == [r["tp"] == 1 for r in rows]
    assert "transferred" in out.err
    assert main(["cost", "layer", "--gpu", "A40", "--model", "llama-2-7b", "--tp", "1", "--tokens", "1"]) == 0
    assert "fitted from measurements of this GPU" in capsys.readouterr().out


def test_cost_layer_says_which_token_counts_lie_past_the_profiles(capsys):
    """The A40's profiles reach 4,096 tokens: a row past them is the fit's form carried on, not a
    fitted figure, and says so (the JSON row and the text)."""
    assert main(["cost", "layer", "--gpu", "A40", "--model", "llama-2-7b", "--tp", "1", "--tokens", "4096,8192",
                 "--json"]) == 0
    out = capsys.readouterr()
    assert [r["extrapolated"] for r in json.loads(out.out)] == [False, True]
    assert "outside the profiled 1–4,096 are extrapolated" in out.err
    assert main(["cost", "layer", "--gpu", "A40", "--model", "llama-2-7b", "--tp", "1", "--tokens", "8192"]) == 0
    assert "fitted, extrapolated" in capsys.readouterr().out


def test_cost_layer_refuses_an_unknown_gpu(capsys):
    assert main(["cost", "layer", "--gpu", "Z100", "--model", "llama-2-7b"]) == 2
    assert "Z100" in capsys.readouterr().err


def test_cost_fit_writes_a_file_cost_layer_reads(tmp_path, capsys):
    src = PROFILES / "compute" / "a40" / "microsoft" / "phi-2" / "mlp.csv"
    dst = tmp_path / "p" / "compute" / "a40" / "microsoft" / "phi-2" / "mlp.csv"
    dst.parent.mkdir(parents=True)
    shutil.copy(src, dst)
    out = tmp_path / "k.json"
    assert main(["cost", "fit", "--profiles", str(tmp_path / "p"), "-o", str(out)]) == 0
    table = load_table(out)
    assert set(table.fitted) == {"A40"} and table.params_for("L40S")[1] == "transferred"
    assert table.profiled_tokens("A40") == table.profiled_tokens("L40S") == (1, 4096)
    capsys.readouterr()
    assert main(["cost", "layer", "--gpu", "A40", "--model", "llama-2-7b", "--tp", "1", "--tokens", "64",
                 "--table", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["allreduce_s"] == 0.0
    again = tmp_path / "k2.json"  # hetserve calibrate --profiles: the same fit
    assert main(["calibrate", "--profiles", str(tmp_path / "p"), "-o", str(again)]) == 0
    assert load_table(again).fitted == table.fitted


def test_the_planners_bound_reads_a_roofline_under_the_kernel_prices_and_the_same_prices_in_arrays():
    """``CostModel._flops`` / ``_membw`` (what the planner's upper bound reads) are the fitted GEMM
    fractions of the peaks, and the roofline at them never prices a layer above the kernel model;
    the bound's array prices are the cost model's, point for point."""
    import numpy as np

    for name in ("A100-SXM-80G", "H100-SXM-80G", "RTX-4090"):
        cm = CostModel(_cluster(name, 8), LLAMA7)
        k, tokens = cm.kernels, np.array([1.0, 7, 64, 65, 200, 1000, 4096])
        for tp in (1, 2, 8):
            devs = tuple(range(tp))
            layer = np.array([k.layer(devs, n) for n in tokens])
            roof = np.maximum(2.0 * LLAMA7.params_per_layer * tokens / (tp * cm._flops[0]),
                              LLAMA7.bytes_per_layer / (tp * cm._membw[0]))
            assert np.all(roof <= layer)
            arr = k.layer_times(name, tp, tokens, 2.0 * LLAMA7.q_dim * tokens ** 2, tokens * 4096)
            one = [k.layer(devs, n) + k.attention(devs, 2.0 * LLAMA7.q_dim * n * n, n * 4096) for n in tokens]
            assert arr == pytest.approx(one, rel=1e-12)
            assert k.head_times(name, tp, tokens) == pytest.approx([k.head(devs, n) for n in tokens], rel=1e-12)
    roof = CostModel(_cluster("A100-SXM-80G", 1), LLAMA7, kernels=False)
    assert roof._flops[0] == gpu("A100-SXM-80G").fp16_flops * 0.5


def test_a_roofline_cost_model_stays_one_in_the_simulators_twin():
    roof = CostModel(_cluster("A40"), LLAMA7, kernels=False)
    assert memoised(roof).kernels is None
    assert memoised(roof).decode_step_time(_one_stage(2), 4, 400) == roof.decode_step_time(_one_stage(2), 4, 400)


def test_prices_never_fall_as_the_work_grows():
    """A layer's time and an all-reduce's never drop when tokens or bytes grow (the planner and
    the property tests of the cost model rely on it), on every GPU type of the catalog."""
    import numpy as np

    from hetserve.specs.gpus import gpu_catalog

    table, tokens = default_table(), np.arange(1, 4200, dtype=float)
    for name in gpu_catalog():
        k = CostModel(_cluster(name, 8), LLAMA7).kernels
        for tp in (1, 2, 8):
            assert np.all(np.diff(k.layer_times(name, tp, tokens, 0 * tokens, 0 * tokens)) >= 0), (name, tp)
    sizes = np.geomspace(1e3, 1e9, 400)
    for w in (2, 3, 4, 8):
        t = [table.allreduce_time(w, s, 3e11) for s in sizes]
        assert np.all(np.diff(t) >= -1e-12 * np.array(t[1:])), w  # flat stretches: equal to rounding


def test_kernel_prices_are_shared_by_equal_groups_on_other_boxes_and_stay_the_same():
    """``layer`` and ``head`` are kept by what they read of a TP group (its size, each GPU type),
    so a group on another box of the same GPUs hits the same entry; the figures (and the group's
    all-reduce and attention, whose rates and link are found once) are a fresh pricing's."""
    c = cluster_from_dict({"name": "k", "machines": [
        {"name": "a", "gpu": "A100-SXM-80G", "count": 2}, {"name": "b", "gpu": "A100-SXM-80G", "count": 2},
        {"name": "c", "gpu": "L40", "count": 2}], "network": {"intra_site": {"bandwidth_gbps": 100, "latency_ms": 0.2}}})
    k = CostModel(c, LLAMA7).kernels
    assert k.group((0, 1)).number == k.group([2, 3]).number != k.group((4, 5)).number
    assert k.group((0,)).number != k.group((0, 1)).number
    for devices in ((0, 1), (2, 3), (4, 5), (0,), (0, 1, 4, 5)):
        fresh = CostModel(c, LLAMA7).kernels
        for n in (1, 7, 300):
            assert k.layer(devices, n) == fresh.layer(devices, n)
            assert k.head(devices, n) == fresh.head(devices, n)
            assert k.allreduce(devices, n * 8192.0) == fresh.allreduce(devices, n * 8192.0)
            assert k.attention(devices, n * 1e9, n * 1e6) == fresh.attention(devices, n * 1e9, n * 1e6)
    assert len({key for key in k._memo if key[0] not in ("head", "allreduce")}) == 4 * 3  # (0, 1) and (2, 3): one entry each
