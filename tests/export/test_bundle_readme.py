"""The bundle README's steps and what the bundle's scripts need: each step names only the machines
whose script does something in it, Ray steps only where the bundle starts Ray, hetserve installed
from source, the scripts run from any folder; and `--port-range` checked against the plan at export."""

import json
import os
import re
import subprocess
import sys

import pytest

from tests.cli_errors import one_line_error
from tests.export import test_bundle_folder as folder_tests
from tests.export.test_bundle_folder import export, plan, stage


@pytest.fixture()
def pool(tmp_path):
    """test_bundle_folder's cluster and plans (one.json, two.json, pd.json, mixed.json) in a folder."""
    (tmp_path / "cluster.yaml").write_text(folder_tests.CLUSTER)
    for name, p in (("two.json", folder_tests.TWO_MACHINES), ("one.json", folder_tests.ONE_MACHINE),
                    ("mixed.json", folder_tests.MIXED_TP), ("pd.json", folder_tests.PD)):
        (tmp_path / name).write_text(json.dumps(p))
    return tmp_path


def steps(out):
    text = (out / "README.md").read_text()
    return re.findall(r"^\d\. .*$", text.split("## Start, in this order", 1)[1], flags=re.M), text


def launches(out):
    deploy = json.loads((out / "deploy.json").read_text())
    return [x for r in deploy["replicas"] for x in r["launch"]] + deploy.get("shared", [])


@pytest.mark.parametrize("engine,plan_name", [("hetserve", "two.json"), ("hetserve", "pd.json"), ("vllm", "one.json"),
                                              ("vllm", "pd.json"), ("vllm", "two.json"), ("sglang", "two.json")])
def test_each_step_names_only_the_machines_where_it_does_something(pool, engine, plan_name):
    out = pool / f"b-{engine}-{plan_name}"
    assert export(pool, plan_name, engine, out) == 0
    lines, _ = steps(out)
    kinds = {"ray": "ray", "serve": "server"}
    named = [(m, phase) for line in lines for m, phase in re.findall(r"`bash machines/(\w+)\.sh (\w+)`", line)]
    assert named
    busy = {(x["machine"], kinds_phase) for x in launches(out)
            for kinds_phase, kind in kinds.items() if x["kind"] == kind}
    assert set(named) == busy, (named, busy)  # every step a script has, and no step it does nothing in


def test_a_bundle_without_ray_has_no_ray_step_and_no_ray_stop(pool):
    """vLLM and SGLang on one machine per replica start no Ray: no Ray step, no `ray stop`; a bundle that
    does start Ray says `ray stop` ends every Ray of the machine, not only the bundle's."""
    for engine, plan_name in (("vllm", "one.json"), ("vllm", "pd.json"), ("sglang", "two.json")):
        out = pool / f"b-{engine}-{plan_name}"
        assert export(pool, plan_name, engine, out) == 0
        assert not any(x["kind"] == "ray" for x in launches(out))
        lines, text = steps(out)
        assert "Ray" not in " ".join(lines) and "ray stop" not in text and "ray`" not in text, text
        assert [line[:2] for line in lines] == [f"{n}." for n in range(1, len(lines) + 1)]
    for engine, plan_name in (("hetserve", "one.json"), ("vllm", "two.json")):
        out = pool / f"b-{engine}-{plan_name}"
        assert export(pool, plan_name, engine, out) == 0
        text = " ".join((out / "README.md").read_text().split())
        assert "`ray stop`" in text and "not only this bundle's" in text and "other users'" in text


def test_hetserve_is_installed_from_source_at_the_same_version(pool):
    from hetserve import __version__

    out = pool / "h"
    assert export(pool, "two.json", "hetserve", out) == 0
    text = (out / "README.md").read_text()
    assert "pip install 'hetserve[" not in text  # not on a package registry
    assert "`pip install '/path/to/hetserve[runtime,ray]'`" in text and "same commit" in text
    assert f"hetserve {__version__}" in text and "`hetserve --version`" in text
    # a vLLM bundle behind hetserve route needs hetserve where the router runs
    assert export(pool, "one.json", "vllm", pool / "v") == 0
    text = (pool / "v" / "README.md").read_text()
    assert "pip install 'hetserve[" not in text and "`pip install '/path/to/hetserve[runtime]'`" in text


def test_a_script_runs_from_any_folder(pool, tmp_path):
    """The hetserve bundle's serve command names plan.json and cluster.yaml relative to the bundle: run
    from another folder, the script still hands the server files that are there."""
    out = pool / "h"
    assert export(pool, "two.json", "hetserve", out) == 0
    standin = tmp_path / "bin"
    standin.mkdir()
    record = tmp_path / "record.json"
    (standin / "hetserve").write_text(
        f"#!{sys.executable}\nimport json, os, sys\na = sys.argv\n"
        "f = lambda n: a[a.index(n) + 1]\n"
        f"json.dump({{'plan': os.path.isfile(f('--plan')), 'cluster': os.path.isfile(f('--cluster')), "
        f"'cwd': os.getcwd()}}, open({str(record)!r}, 'w'))\n")
    (standin / "hetserve").chmod(0o755)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PATH": f"{standin}:{os.environ['PATH']}"}
    proc = subprocess.run(["bash", str(out / "machines" / "a0.sh"), "serve"], cwd=elsewhere, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(record.read_text())
    assert got["plan"] and got["cluster"], got
    # and run as `bash machines/a0.sh` from the bundle folder, as before
    record.unlink()
    proc = subprocess.run(["bash", "machines/a0.sh", "serve"], cwd=out, env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and json.loads(record.read_text())["plan"], proc.stderr


def test_the_refusal_of_a_folder_holding_a_bundle_names_the_exporter(pool, capsys):
    out = pool / "x"
    assert export(pool, "one.json", "vllm", out) == 0
    capsys.readouterr()
    assert export(pool, "one.json", "hetserve", out) == 2
    err = one_line_error(capsys)
    assert "an earlier bundle written by hetserve export (vllm)" in err and "hetserve bundle" not in err
    (out / "notes.txt").write_text("mine")
    assert export(pool, "one.json", "hetserve", out, "--force") == 2
    assert "only an earlier bundle written by hetserve export (vllm)" in one_line_error(capsys)


# ---------------------------------------------------------------- --port-range against the plan

# m0 (a0) serves: one worker, the engine's endpoint and, for b0's TP group, the rendezvous store
TP_ELSEWHERE = plan({"id": "c0", "role": "colocated",
                     "stages": [stage(["a0:0"], 0, 16), stage(["b0:0", "b0:1"], 16, 32)]})
NO_TP = plan({"id": "c0", "role": "colocated", "stages": [stage(["a0:0"], 0, 16), stage(["b0:0"], 16, 32)]},
             {"id": "c1", "role": "colocated", "stages": [stage(["b0:1"], 0, 32)]},
             {"id": "c2", "role": "colocated", "stages": [stage(["b0:2"], 0, 32)]})


def test_the_listeners_counted_per_machine_follow_the_runtime_rule():
    from hetserve.export.ports import listeners_per_machine
    from hetserve.planner.plan import Plan

    got = {m: (x.workers, x.engine, x.store) for m, x in listeners_per_machine(Plan.from_dict(TP_ELSEWHERE), "a0").items()}
    assert got == {"a0": (1, 1, 1), "b0": (2, 0, 0)}
    got = {m: x.ports for m, x in listeners_per_machine(Plan.from_dict(NO_TP), "a0").items()}
    assert got == {"a0": 2, "b0": 3}  # no TP group: no store; b0 has three workers
    assert listeners_per_machine(Plan.from_dict(NO_TP), "a0", device_channels=True)["a0"].ports == 3


@pytest.mark.parametrize("plan_dict,too_small,machine,need", [
    (TP_ELSEWHERE, "20000-20001", "a0", 3), (NO_TP, "20000-20001", "b0", 3)])
def test_a_port_range_too_small_for_a_machine_is_refused_at_export(pool, capsys, plan_dict, too_small, machine, need):
    (pool / "p.json").write_text(json.dumps(plan_dict))
    out = pool / "h"
    assert export(pool, "p.json", "hetserve", out, "--port-range", too_small) == 2
    err = one_line_error(capsys)
    assert err.startswith("hetserve export: error: --port-range: expected at least") and too_small in err
    assert f"machine {machine} listens on {need}" in err and f"at least {need} ports" in err, err
    assert not out.exists()
    lo = int(too_small.split("-")[0])
    assert export(pool, "p.json", "hetserve", out, "--port-range", f"{lo}-{lo + need - 1}") == 0


def test_machines_sharing_an_address_share_the_range(pool, capsys):
    shared = (pool / "cluster.yaml").read_text().replace("10.0.0.6", "10.0.0.5")
    (pool / "shared.yaml").write_text(shared)
    (pool / "p.json").write_text(json.dumps(NO_TP))
    assert export(pool, "p.json", "hetserve", pool / "h", "--port-range", "20000-20003",
                  cluster=pool / "shared.yaml") == 2
    err = one_line_error(capsys)
    assert "at least 5 ports: machines a0 and b0 (one address, 10.0.0.5)" in err, err
