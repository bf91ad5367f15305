"""What a new user met in the CLI: each test names the behaviour it guards."""

import copy
import json

import pytest

from hetserve.cli.main import main

DISAGG = "examples/plans/demo-tiny-disagg.json"  # names model tiny-llama: a checkpoint not here


def _edited(tmp_path, edit) -> str:
    plan = json.load(open(DISAGG))
    plan.pop("estimate", None)
    plan = copy.deepcopy(plan)
    edit(plan)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(plan))
    return str(path)


def _stage(plan, replica, stage):
    return plan["replicas"][replica]["stages"][stage]


@pytest.mark.parametrize("edit, said", [
    (lambda p: _stage(p, 1, 0).update(devices=["m0:0"]), "device m0:0 is used twice"),
    (lambda p: _stage(p, 1, 0).update(devices=["m9:0"]), "'m9:0' is not in cluster demo-tiny"),
    (lambda p: _stage(p, 0, 1).update(layers=[3, 8]), "overlapping the previous stage"),
    (lambda p: _stage(p, 0, 1).update(layers=[4, 6]), "stages end at layer 6"),
])
def test_describe_plan_without_its_model_still_refuses_what_the_cluster_shows(tmp_path, capsys, edit, said):
    """The plan's model is not here: the checks that need only the cluster still run (exit 2)."""
    assert main(["describe", "plan", _edited(tmp_path, edit), "--cluster", "demo-tiny"]) == 2
    assert said in capsys.readouterr().err


def test_describe_plan_without_its_model_says_what_it_left_unchecked(tmp_path, capsys):
    assert main(["describe", "plan", _edited(tmp_path, lambda p: None), "--cluster", "demo-tiny"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "checked without the model" in out and "not checked" in out and "memory" in out and "tiny-llama" in out
