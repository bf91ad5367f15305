"""A plan checked against another pool altogether (none of its devices there) is refused in one
clause naming both pools' devices, not one clause per device (a 20-GPU plan gave 20); a pool that
lacks some of them still names each one missing."""

import json

from hetserve.cli.main import main

from .bad_input_runner import CLUSTER

PLAN = {"model": "llama-2-7b", "cluster": "hexgen2-homo", "replicas": [
    {"id": f"c{i}", "role": "colocated", "stages": [{"devices": [f"h100-0:{i}"], "layers": [0, 32]}]}
    for i in range(4)]}


def test_a_plan_on_another_pool_is_one_clause(tmp_path, capsys):
    (tmp_path / "c.yaml").write_text(CLUSTER)
    (tmp_path / "p.json").write_text(json.dumps(PLAN))
    assert main(["simulate", "--plan", str(tmp_path / "p.json"), "--cluster", str(tmp_path / "c.yaml"),
                 "--workload", "azure-conv", "--limit", "3", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "none of its 4 devices (h100-0:0 … h100-0:3) is in cluster c (its devices are a:0 … b:1)" in err
    assert "is not in cluster" not in err


def test_a_pool_lacking_some_devices_names_each(tmp_path, capsys):
    plan = {**PLAN, "replicas": PLAN["replicas"] + [
        {"id": "c9", "role": "colocated", "stages": [{"devices": ["h100-0:99"], "layers": [0, 32]}]}]}
    (tmp_path / "p.json").write_text(json.dumps(plan))
    assert main(["describe", "plan", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err
    assert "replica c9 stage 0: device 'h100-0:99' is not in cluster hexgen2-homo" in err and "none of its" not in err
