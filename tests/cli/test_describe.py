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
