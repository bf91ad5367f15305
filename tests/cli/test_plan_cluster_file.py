"""A plan made on a cluster file records it (path relative to the plan, SHA-256), and ``simulate``
and ``describe plan`` find it without --cluster, warn when it changed, or say which file to pass."""

import hashlib
import json
import shutil

import pytest
import yaml

from hetserve.cli.main import main
from hetserve.planner.plan import ClusterFile, Plan

POOL = {"name": "my-pool", "machines": [{"name": "m0", "gpu": "A100-SXM-80G", "count": 2, "site": "s0"},
                                        {"name": "m1", "gpu": "A100-SXM-80G", "count": 2, "site": "s1"}],
        "network": {"inter_site": {"bandwidth_gbps": 100, "latency_ms": 1}}}
SIM = ["--workload", "azure-conv", "--limit", "20", "--no-progress", "--json"]


def one_line(capsys) -> str:
    """What was printed, rich's wrapping at 80 columns undone."""
    return " ".join(capsys.readouterr().out.split())


@pytest.fixture
def made(tmp_path, monkeypatch, capsys):
    """``hetserve plan`` on pools/my-pool.yaml, written to plans/plan.json (run from tmp_path)."""
    monkeypatch.chdir(tmp_path)
    for folder in ("pools", "plans"):
        (tmp_path / folder).mkdir()
    (tmp_path / "pools" / "my-pool.yaml").write_text(yaml.safe_dump(POOL))
    assert main(["plan", "--cluster", "pools/my-pool.yaml", "--model", "llama-2-7b", "--algorithm", "uniform",
                 "--quiet", "-o", "plans/plan.json"]) == 0
    capsys.readouterr()
    return tmp_path


def test_the_plan_records_its_cluster_file_relative_to_itself(made):
    data = json.loads((made / "plans" / "plan.json").read_text())
    digest = hashlib.sha256((made / "pools" / "my-pool.yaml").read_bytes()).hexdigest()
    assert data["cluster"] == "my-pool"  # docs/design.md's field, unchanged
    assert data["cluster_file"] == {"path": "../pools/my-pool.yaml", "sha256": digest}
    plan = Plan.load(made / "plans" / "plan.json")
    assert plan.cluster_file.path == (made / "pools" / "my-pool.yaml").resolve()


def test_a_plan_made_on_a_preset_records_no_file(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "--cluster", "demo-cpu", "--model", "llama-2-7b", "--algorithm", "uniform", "--quiet",
                 "-o", str(out)]) == 0
    assert "cluster_file" not in json.loads(out.read_text())


def test_simulate_and_describe_find_the_file_without_cluster(made, capsys):
    assert main(["simulate", "--plan", "plans/plan.json", *SIM]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["run"]["cluster"] == "my-pool" and "cluster file" not in out.err
    assert main(["describe", "plan", "plans/plan.json"]) == 0
    text = one_line(capsys)
    assert "made on the cluster file pools/my-pool.yaml (unchanged" in text and "checked: the plan fits my-pool" in text


def test_plan_and_pool_move_together(made, capsys):
    shutil.move(made / "plans", made / "elsewhere" / "plans")
    shutil.move(made / "pools", made / "elsewhere" / "pools")
    assert main(["simulate", "--plan", "elsewhere/plans/plan.json", *SIM]) == 0


def test_a_changed_file_is_used_with_a_warning_naming_it(made, capsys):
    with (made / "pools" / "my-pool.yaml").open("a") as fh:
        fh.write("# edited after planning\n")
    assert main(["simulate", "--plan", "plans/plan.json", *SIM]) == 0
    err = capsys.readouterr().err
    assert "warning: pools/my-pool.yaml, the cluster file plans/plan.json was made on, has changed since" in err
    assert main(["describe", "plan", "plans/plan.json"]) == 0
    assert "my-pool.yaml, the cluster file plans/plan.json was made on, has changed since" in one_line(capsys)


def test_a_missing_file_says_which_file_to_pass(made, capsys):
    (made / "pools" / "my-pool.yaml").rename(made / "pools" / "moved.yaml")
    assert main(["simulate", "--plan", "plans/plan.json", *SIM]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "plans/plan.json: field 'cluster_file.path'" in err
    assert "pools/my-pool.yaml (no such file)" in err and "--cluster" in err and "'my-pool'" in err
    assert main(["describe", "plan", "plans/plan.json"]) == 0
    assert "not checked" in capsys.readouterr().out
    # the user names the file: it is used
    assert main(["simulate", "--plan", "plans/plan.json", "--cluster", "pools/moved.yaml", *SIM]) == 0


def test_a_plan_without_a_recorded_file_names_its_cluster_and_the_fix(made, capsys):
    data = json.loads((made / "plans" / "plan.json").read_text())
    del data["cluster_file"]
    (made / "old.json").write_text(json.dumps(data))
    assert main(["simulate", "--plan", "old.json", *SIM]) == 2
    err = capsys.readouterr().err
    assert "old.json: field 'cluster'" in err and "pass --cluster with the file it was made on" in err
    assert "got 'my-pool'" in err


def test_a_malformed_record_is_one_line(made, capsys):
    data = json.loads((made / "plans" / "plan.json").read_text())
    data["cluster_file"]["sha256"] = "abc"
    (made / "bad.json").write_text(json.dumps(data))
    assert main(["simulate", "--plan", "bad.json", *SIM]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cluster_file.sha256" in err


def test_cluster_file_leaves_plan_equality_alone(made):
    plan = Plan.load(made / "plans" / "plan.json")
    assert plan.cluster_file == ClusterFile.of(made / "pools" / "my-pool.yaml")
    assert plan == Plan.from_dict({k: v for k, v in plan.to_dict().items() if k != "cluster_file"})


def test_serve_finds_the_file_without_cluster(made):
    """``hetserve serve`` loads its inputs with the same rule (``serve.launch._load``)."""
    from types import SimpleNamespace

    from hetserve.serve.launch import _load

    plan, cluster = _load(SimpleNamespace(plan=str(made / "plans" / "plan.json"), cluster=None))
    assert cluster.name == "my-pool" and plan.cluster == "my-pool"


def test_a_plan_finds_the_checkpoint_folder_beside_it_from_anywhere(tmp_path, monkeypatch):
    """`make demo` writes the plan and the checkpoint it names side by side: commands run from
    another folder find it there (a bare name from here would not)."""
    from hetserve.cli.model_dir import plan_model
    from hetserve.errors import SpecError
    from hetserve.runtime.model.make import make_model

    make_model(tmp_path / "tiny-ckpt", "llama", layers=2, hidden=32, heads=2, kv_heads=1, seed=0)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert plan_model(str(tmp_path / "plan.json"), "tiny-ckpt").num_layers == 2
    with pytest.raises(SpecError, match="make-model"):
        plan_model(str(elsewhere / "plan.json"), "tiny-ckpt")


@pytest.fixture
def by_hand(tmp_path, monkeypatch, capsys):
    """A plan written by hand whose ``cluster`` names its pool's file beside it (``"lo.yaml"``),
    read from another folder (the working directory ``elsewhere``)."""
    (tmp_path / "plans").mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "plans" / "lo.yaml").write_text(yaml.safe_dump(POOL))
    (tmp_path / "plans" / "plan.json").write_text(json.dumps({"model": "llama-2-7b", "cluster": "lo.yaml", "replicas": [
        {"id": "c0", "role": "colocated", "stages": [{"devices": ["m0:0"], "layers": [0, 32]}]}]}))
    monkeypatch.chdir(tmp_path / "elsewhere")
    return tmp_path


def test_a_relative_cluster_path_is_read_beside_the_plan(by_hand, capsys):
    """Every command takes it by one rule (load_plan_cluster), and export's bundle carries that file."""
    from types import SimpleNamespace

    from hetserve.serve.launch import _load

    plan = "../plans/plan.json"
    assert main(["simulate", "--plan", plan, *SIM]) == 0
    assert json.loads(capsys.readouterr().out)["run"]["cluster"] == "my-pool"
    assert main(["describe", "plan", plan]) == 0
    assert "checked: the plan fits my-pool" in one_line(capsys)
    assert _load(SimpleNamespace(plan=plan, cluster=None))[1].name == "my-pool"
    assert main(["export", "--plan", plan, "--to", "hetserve", "-o", "bundle"]) == 0
    assert (by_hand / "elsewhere" / "bundle" / "cluster.yaml").read_bytes() == (by_hand / "plans" / "lo.yaml").read_bytes()


def test_the_working_directory_comes_first_as_for_the_model_and_beside_the_plan_serves_too(by_hand, capsys):
    plan = "../plans/plan.json"
    (by_hand / "elsewhere" / "lo.yaml").write_text(yaml.safe_dump({**POOL, "name": "here-pool"}))
    assert main(["simulate", "--plan", plan, *SIM]) == 0
    assert json.loads(capsys.readouterr().out)["run"]["cluster"] == "here-pool"  # read here, as it always was
    (by_hand / "elsewhere" / "lo.yaml").unlink()
    assert main(["simulate", "--plan", plan, *SIM]) == 0
    assert json.loads(capsys.readouterr().out)["run"]["cluster"] == "my-pool"


def test_a_relative_cluster_path_found_nowhere_names_both_places(by_hand, capsys):
    (by_hand / "plans" / "lo.yaml").unlink()
    assert main(["simulate", "--plan", "../plans/plan.json", *SIM]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "../plans/plan.json: field 'cluster'" in err and "got 'lo.yaml'" in err
    assert f"in the working directory, {by_hand / 'elsewhere'}, and beside the plan, at ../plans/lo.yaml" in err
