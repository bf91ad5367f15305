import json
import re
import subprocess
import sys

import pytest

from hetserve.cli.main import main
from hetserve.specs.cluster import cluster_presets


def test_describe_model_70b(capsys):
    assert main(["describe", "model", "llama-2-70b"]) == 0
    out = capsys.readouterr().out
    assert "68.98 B" in out and "327,680 bytes" in out


def test_describe_a_tiny_model_prints_its_size_not_zero(tmp_path, capsys):
    assert main(["make-model", "--arch", "llama", "--layers", "2", "--hidden", "64", "--heads", "4",
                 "--kv-heads", "2", "-o", str(tmp_path / "tiny")]) == 0
    capsys.readouterr()
    assert main(["describe", "model", str(tmp_path / "tiny")]) == 0
    out = capsys.readouterr().out
    assert "0.00 B" not in out and "0.00 GB" not in out and " M (" in out


@pytest.mark.parametrize("fields, said", [
    ({}, "float32 (no dtype in config.json: float32 assumed, torch's default, as the runtime loads it)"),
    ({"torch_dtype": "bfloat16"}, "bfloat16 (config.json torch_dtype)")])
def test_describe_model_says_its_dtype_and_where_it_came_from(tmp_path, capsys, monkeypatch, fields, said):
    monkeypatch.setenv("COLUMNS", "1000")  # one line per row: rich folds at the terminal's width
    cfg = {"model_type": "llama", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 128}
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **fields}))
    assert main(["describe", "model", str(tmp_path / "config.json")]) == 0
    out = capsys.readouterr().out
    assert re.search(r"dtype\W+" + re.escape(said), out), out  # the row: its name, the border, its value
    assert main(["describe", "model", "llama-2-7b"]) == 0
    assert re.search(r"dtype\W+float16 / bfloat16 \(the preset's: 2 bytes per parameter\)", capsys.readouterr().out)


@pytest.mark.parametrize("name", cluster_presets())
def test_describe_every_cluster_preset(name, capsys):
    assert main(["describe", "cluster", name]) == 0
    assert name in capsys.readouterr().out


def test_describe_workload(capsys):
    assert main(["describe", "workload", "azure-conv"]) == 0
    out = capsys.readouterr().out
    assert "19,366 requests" in out and "HPHD" in out


def test_malformed_cluster_is_one_line_exit_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nmachines:\n  - {name: a, gpu: H100-SXM-80G, count: many}\n")
    proc = subprocess.run([sys.executable, "-m", "hetserve.cli.main", "describe", "cluster", str(bad)],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "machines.0.count" in lines[0] and str(bad) in lines[0]
    assert "Traceback" not in proc.stderr


def test_list_presets(capsys):
    assert main(["describe", "model"]) == 0
    assert "llama-2-70b" in capsys.readouterr().out


def test_describe_plan_prints_its_table_and_checks_it(tmp_path, capsys):
    path = tmp_path / "plan.json"
    assert main(["plan", "--cluster", "demo-cpu", "--model", "llama-2-7b", "--algorithm", "uniform", "--quiet",
                 "-o", str(path)]) == 0
    planned = capsys.readouterr().out
    assert main(["describe", "plan", str(path)]) == 0
    out = capsys.readouterr().out
    # the same replica table and estimate line as `plan` printed, then the check against demo-cpu
    table = [line for line in planned.splitlines() if "TP" in line]
    assert table and all(line in out for line in table)
    assert "estimated throughput" in out and "checked: the plan fits demo-cpu" in out
    # the estimate is of output tokens (requests x mean output / T), as simulate's "output tokens/s"
    flat = " ".join(out.split())
    assert re.search(r"estimated throughput [\d,.]+ output tokens/s", flat) and " output tokens/$)" in flat


def test_describe_plan_names_what_no_longer_fits(tmp_path, capsys):
    path = tmp_path / "plan.json"
    assert main(["plan", "--cluster", "demo-cpu", "--model", "llama-2-7b", "--algorithm", "uniform", "--quiet",
                 "-o", str(path)]) == 0
    capsys.readouterr()
    # the pool it is checked against lacks the plan's devices: exit 2, one line saying why
    assert main(["describe", "plan", str(path), "--cluster", "molink-3x4090"]) == 2
    err = capsys.readouterr().err
    assert "is invalid" in err and "Traceback" not in err
    # a plan naming a cluster this machine does not know is printed, not checked
    data = json.loads(path.read_text())
    data["cluster"] = "a-pool-from-elsewhere"
    path.write_text(json.dumps(data))
    assert main(["describe", "plan", str(path)]) == 0
    out = capsys.readouterr().out
    assert "not checked" in out and "a-pool-from-elsewhere" in out and "--cluster" in out


def test_describe_plan_without_a_file_says_what_to_give(capsys):
    assert main(["describe", "plan"]) == 2
    assert "give a plan file" in capsys.readouterr().err


def test_describe_plan_refuses_a_cluster_or_model_the_user_names_that_does_not_load(tmp_path, capsys):
    """An explicit --cluster / --model that cannot be loaded is an error (exit 2), not "not checked"
    with exit 0: a script reading the exit code took that as "the plan fits"."""
    for flag in ("--cluster", "--model"):
        assert main(["describe", "plan", "examples/plans/demo-tiny-disagg.json", flag, "nosuch"]) == 2
        assert "nosuch" in capsys.readouterr().err


def test_describe_plan_of_a_hand_written_plan_says_it_holds_no_estimate(capsys):
    """The bundled hand-written plans have no estimate: not "0.0 tokens/s" and capacities of 0."""
    assert main(["describe", "plan", "examples/plans/asym-colocated.json", "--cluster", "demo-cpu"]) in (0, 2)
    out = capsys.readouterr().out
    assert "holds no estimate" in out and "0.0 tokens/s" not in out and "None" not in out


def test_describe_plan_of_a_partial_estimate_prints_only_the_figures_it_holds(tmp_path, capsys, wide):
    """A plan file whose estimate holds only some fields (design.md's format example: throughput and
    cost) says what it holds and counts the plan's own devices, never "None/None devices"."""
    data = json.loads(open(DISAGG).read())
    data["estimate"] = {"throughput_tokens_per_s": 100.0, "cost_usd_per_hour": 1.5}
    path = tmp_path / "partial.json"
    path.write_text(json.dumps(data))
    assert main(["describe", "plan", str(path), "--cluster", "demo-tiny"]) in (0, 2)
    out = " ".join(capsys.readouterr().out.split())
    assert "None" not in out and "requests per 600 s" not in out
    assert "100.0 output tokens/s; 4 devices; $1.50/hour" in out


DISAGG = "examples/plans/demo-tiny-disagg.json"


@pytest.fixture
def wide(monkeypatch):
    """A console wide enough that rich wraps no line or table cell the assertions read."""
    monkeypatch.setenv("COLUMNS", "400")


@pytest.mark.parametrize("argv, option", [
    (["describe", "cluster", "demo-cpu", "--rate", "3"], "--rate"),
    (["describe", "plan", DISAGG, "--rate", "5"], "--rate"),
    (["describe", "model", "llama-2-7b", "--model", "llama-2-13b"], "--model"),
    (["describe", "workload", "sharegpt", "--cluster", "demo-cpu"], "--cluster"),
    (["describe", "workload", "--rate", "3"], "--rate"),  # listing the presets: nothing to rescale
])
def test_an_option_the_kind_does_not_act_on_is_refused(argv, option, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and option in err[0] and f"drop {option}" in err[0]


def test_a_length_only_trace_says_its_arrivals_are_drawn_and_at_what_rate(tmp_path, capsys, wide):
    assert main(["describe", "workload", "sharegpt"]) == 0
    assert "Poisson at 1.00 req/s, the default for a length-only trace; --rate sets it" in capsys.readouterr().out
    trace = tmp_path / "wlen.csv"
    trace.write_text("num_prefill_tokens,num_decode_tokens\n10,10\n20,20\n30,5\n")
    assert main(["describe", "workload", str(trace), "--rate", "2e6"]) == 0
    out = capsys.readouterr().out
    assert "Poisson at 2e+06 req/s, as --rate set" in out
    assert re.search(r"\d{8}", out) is None  # a large rate or a tiny span reads in 3 digits, not dozens
    assert main(["describe", "workload", "azure-conv"]) == 0
    assert "Poisson" not in capsys.readouterr().out  # a timed trace's arrivals are read, not drawn


def test_describe_cluster_says_where_prices_and_in_box_links_come_from(tmp_path, capsys, wide):
    assert main(["describe", "cluster", "hexgen2-het1"]) == 0
    out = capsys.readouterr().out
    assert "(gpus.csv)" in out and "default NVLink" in out and "default PCIe" in out
    path = tmp_path / "t4.yaml"
    path.write_text("name: t4s\nmachines:\n  - {name: a, gpu: T4, count: 2, intra: {bandwidth_gbps: 64, latency_ms: 0.02}}\n")
    assert main(["describe", "cluster", str(path)]) == 0
    out = capsys.readouterr().out
    assert "price unknown" in out and "gpu_usd_per_hour" in out and "(file)" in out
    path.write_text("name: t4s\nmachines:\n  - {name: a, gpu: T4, count: 2, gpu_usd_per_hour: 0.35}\n")
    assert main(["describe", "cluster", str(path)]) == 0
    out = capsys.readouterr().out
    assert "$0.70/h" in out and "0.70 (file)" in out


def _edited(tmp_path, edit) -> str:
    data = json.loads(open(DISAGG).read())
    edit(data)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_describe_plan_labels_the_saved_estimate_and_finds_no_drift_in_a_planned_file(capsys, wide):
    assert main(["describe", "plan", DISAGG]) == 0
    out = capsys.readouterr().out
    assert "saved in the file when it was planned" in out
    assert "no longer matches" not in out and "warning" not in out


def test_describe_plan_says_when_the_saved_estimate_no_longer_matches(tmp_path, capsys, wide):
    def second_decode(data):  # a decode replica added by hand, no KV route to it
        data["replicas"][1]["stages"] = [{"devices": ["m1:0"], "layers": [0, 8]}]
        data["replicas"].append({"id": "d1", "role": "decode", "stages": [{"devices": ["m1:1"], "layers": [0, 8]}]})
    assert main(["describe", "plan", _edited(tmp_path, second_decode)]) == 0
    out = capsys.readouterr().out
    assert "decode replica d1 has no KV route feeding it" in out
    assert "no longer matches" in out and "d1 not in the estimate" in out

    def unrouted(data):  # the one route dropped: its decode replica's saved flow has no source
        data["kv_routes"] = []
    # said, then refused (exit 2) by the checks that need no model: the plan's tiny-llama is not here
    assert main(["describe", "plan", _edited(tmp_path, unrouted)]) == 2
    out, err = capsys.readouterr()
    assert "prefill replica p0 has no KV route" in err
    assert "decode replica d0 has no KV route feeding it" in out and "prefill replica p0 has no KV route out" in out
    assert "the KV routes carry 0 requests per period into decode replica d0, the estimate 5,847" in out

    def moved(data):  # the replicas swap boxes: other GPUs, another price
        data["replicas"][0]["stages"] = [{"devices": ["m1:0", "m1:1"], "layers": [0, 8]}]
        data["replicas"][1]["stages"] = [{"devices": ["m0:0"], "layers": [0, 8]}]
    assert main(["describe", "plan", _edited(tmp_path, moved)]) == 0
    out = capsys.readouterr().out
    assert "3 devices used, estimated on 4" in out and "cost $" in out and "on demo-tiny" in out
    assert "replica p0's stages (devices or layers) are not those estimated" in out

    def swapped(data):  # d0's two stages trade GPUs in their box: the same count, types and price
        st = data["replicas"][1]["stages"]
        st[0]["devices"], st[1]["devices"] = st[1]["devices"], st[0]["devices"]
    assert main(["describe", "plan", _edited(tmp_path, swapped)]) == 0
    out = capsys.readouterr().out
    assert "no longer matches" in out and "replica d0's stages (devices or layers) are not those estimated" in out
    assert "p0's stages" not in out


def test_make_model_writes_every_file_with_the_umask_mode(tmp_path, capsys):
    import os

    assert main(["make-model", "-o", str(tmp_path / "m")]) == 0
    mask = os.umask(0)
    os.umask(mask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "m").iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {0o666 & ~mask}


def test_a_kv_route_of_a_sliver_of_flow_shows_its_weight_not_zero(tmp_path, capsys):
    """The max flow may send a sliver (5e-05) over a route: shown as such, not as a route of weight 0.000."""
    def replica(rid, role, device):
        return {"id": rid, "role": role, "stages": [{"devices": [device], "layers": [0, 8]}]}

    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"model": "tiny-llama", "cluster": "demo-tiny", "algorithm": "hand", "replicas": [
        replica("p0", "prefill", "m0:0"), replica("d0", "decode", "m1:0"), replica("d1", "decode", "m1:1")],
        "kv_routes": [{"from": "p0", "to": "d0", "weight": 1 - 4.9e-5}, {"from": "p0", "to": "d1", "weight": 4.9e-5}]}))
    assert main(["describe", "plan", str(path)]) == 0
    out = capsys.readouterr().out
    assert "4.9e-05" in out and "0.000" not in out, out
