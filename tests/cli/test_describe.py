import json
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
