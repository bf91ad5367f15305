"""``hetserve export`` without ``--model``, of a plan whose model is a checkpoint folder here: the
scripts name that folder by its absolute path, as they do when ``--model`` names it. They run from
the bundle's folder, where the plan's bare name ("m") would be another, missing folder."""

import json

import pytest

from hetserve.cli.main import main

from .bad_input_runner import CONFIG, TINY_PLAN


@pytest.fixture
def here(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(CONFIG))
    (tmp_path / "tiny.json").write_text(json.dumps(TINY_PLAN))
    (tmp_path / "elsewhere").mkdir()
    return tmp_path


@pytest.mark.parametrize("cwd", [".", "elsewhere"])  # the folder found from here, or beside the plan
@pytest.mark.parametrize("to", ["hetserve", "vllm", "sglang"])
def test_the_plans_checkpoint_is_named_by_its_absolute_path(here, monkeypatch, capsys, cwd, to):
    monkeypatch.chdir(here / cwd)
    assert main(["export", "--plan", str(here / "tiny.json"), "--to", to, "-o", str(here / "out")]) == 0
    script = (here / "out" / "machines" / "m0.sh").read_text()
    flag = "--model-path" if to == "sglang" else "--model"
    assert f"{flag} {(here / 'm').resolve()} " in script, script
    # this machine's path in every script: the user is told each machine must hold the checkpoint there
    told = f"the scripts load the checkpoint from {(here / 'm').resolve()}, its path on this machine: m0 must hold it"
    assert told in capsys.readouterr().out
    assert told in (here / "out" / "README.md").read_text()


def test_a_presets_name_stays_as_given_and_is_noted(here, capsys):
    plan = here / "p.json"
    plan.write_text(json.dumps({"model": "llama-2-7b", "cluster": "hexgen2-homo", "replicas": [
        {"id": "c0", "role": "colocated", "stages": [{"devices": ["h100-0:0"], "layers": [0, 32]}]}]}))
    assert main(["export", "--plan", str(plan), "--to", "vllm", "-o", str(here / "out")]) == 0
    assert "--model llama-2-7b " in (here / "out" / "machines" / "h100-0.sh").read_text()
    out = capsys.readouterr().out
    assert "export again with --model PATH" in out and "its path on this machine" not in out
