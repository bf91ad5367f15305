"""A cluster file given where a plan is read (or the reverse) is named as the other kind of file,
not as a list of misspelt fields."""

from __future__ import annotations

import json

import pytest
import yaml

from hetserve.cli.main import main
from hetserve.errors import SpecError
from hetserve.planner.plan import Plan
from hetserve.specs.cluster import cluster_from_dict, preset_path

PLAN = {"model": "llama-2-70b", "cluster": "two-sites", "replicas": [
    {"id": "c0", "role": "colocated", "stages": [{"devices": ["m0:0"], "layers": [0, 80]}]}], "kv_routes": []}


def test_a_plan_read_as_a_cluster_is_named_a_plan_file():
    with pytest.raises(SpecError, match=r"expected a cluster file .* got 'a plan file \(it lists replicas\)'"):
        cluster_from_dict(PLAN, "plan.json")


def test_a_cluster_read_as_a_plan_is_named_a_cluster_file():
    cluster = yaml.safe_load(preset_path("hexgen2-het1").read_text())
    with pytest.raises(SpecError, match=r"expected a plan file .* got 'a cluster file \(it lists machines\)'"):
        Plan.from_dict(cluster, "lab.yaml")


def test_the_cli_says_so_in_one_line(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(PLAN))
    assert main(["describe", "cluster", str(plan)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "a plan file (it lists replicas)" in err[0] and str(plan) in err[0]
    assert main(["simulate", "--plan", str(preset_path("hexgen2-het1")), "--workload", "azure-conv", "-n", "5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "a cluster file (it lists machines)" in err[0]


def test_a_simulation_summary_read_as_a_plan_is_named_so(tmp_path, capsys):
    """summary.json (hetserve simulate -o) lists its replicas as a plan does: read as a plan or a
    cluster it was refused as a plan with a misspelt field ('requests'); it is named as what it is."""
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"model": "llama-2-7b", "cluster": "aladdin-a100", "replicas": [
        {"id": "c0", "role": "colocated", "stages": [{"devices": ["a100-0:0"], "layers": [0, 32]}]}]}))
    out = tmp_path / "out"
    assert main(["simulate", "--plan", str(plan), "--workload", "sharegpt", "-n", "10", "--no-progress",
                 "-o", str(out)]) == 0
    capsys.readouterr()
    summary = str(out / "summary.json")
    for argv in (["describe", "plan", summary], ["describe", "cluster", summary],
                 ["simulate", "--plan", summary, "--workload", "sharegpt", "-n", "5"]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"{summary}: field '(top level)': expected a " in err[0], err
        assert "got 'a simulation summary, as hetserve simulate -o writes (it has slo_attainment)'" in err[0], err


def test_a_rate_sweep_read_as_a_plan_is_named_so():
    with pytest.raises(SpecError, match=r"expected a plan file .* got 'a rate sweep, as hetserve simulate "
                       r"--sweep-rates writes \(it has rate_sweep\)'"):
        Plan.from_dict({"timings": {}, "rate_sweep": []}, "rate_sweep.json")
