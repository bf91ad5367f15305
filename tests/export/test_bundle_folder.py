"""The folder a bundle goes into (new or empty; --force replaces only an earlier bundle's own files)
and the README's start-up steps, checked against what the bundle's scripts start."""

import json
import re
import shlex
from pathlib import Path

import pytest

from hetserve.cli.main import main
from tests.cli_errors import one_line_error

CLUSTER = """\
name: two-boxes
machines:
  - {name: a0, gpu: A100-SXM-80G, count: 4, address: 10.0.0.5}
  - {name: b0, gpu: A100-SXM-80G, count: 4, address: 10.0.0.6}
network:
  intra_site: {bandwidth_gbps: 25, latency_ms: 0.2}
"""


def stage(devices, lo, hi):
    return {"devices": devices, "layers": [lo, hi]}


def plan(*replicas, routes=()):
    return {"model": "llama-2-7b", "cluster": "two-boxes", "algorithm": "hand", "replicas": list(replicas),
            "kv_routes": [{"from": a, "to": b, "weight": 1.0} for a, b in routes]}


TWO_MACHINES = plan({"id": "c0", "role": "colocated", "stages": [stage(["a0:0"], 0, 16), stage(["b0:0"], 16, 32)]})
ONE_MACHINE = plan({"id": "c0", "role": "colocated", "stages": [stage(["a0:0"], 0, 32)]})
MIXED_TP = plan({"id": "c0", "role": "colocated", "stages": [stage(["a0:0", "a0:1"], 0, 16), stage(["b0:0"], 16, 32)]})
PD = plan({"id": "p0", "role": "prefill", "stages": [stage(["a0:0"], 0, 32)]},
          {"id": "d0", "role": "decode", "stages": [stage(["b0:0", "b0:1"], 0, 32)]}, routes=[("p0", "d0")])


@pytest.fixture()
def pool(tmp_path):
    (tmp_path / "cluster.yaml").write_text(CLUSTER)
    for name, p in (("two.json", TWO_MACHINES), ("one.json", ONE_MACHINE), ("mixed.json", MIXED_TP), ("pd.json", PD)):
        (tmp_path / name).write_text(json.dumps(p))
    return tmp_path


def export(pool, plan_name, engine, out, *extra, cluster=None):
    return main(["export", "--plan", str(pool / plan_name), "--cluster", str(cluster or pool / "cluster.yaml"),
                 "--to", engine, "--model", "/models/llama-2-7b", "-o", str(out), *extra])


def tree(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}


def test_a_plan_naming_its_cluster_file_takes_that_file_into_a_hetserve_bundle(pool, monkeypatch):
    """A plan written by hand names its pool by file ("cluster": "cluster.yaml") and records no
    cluster_file: the bundle carries the file and its scripts serve with it, not the pool's name."""
    monkeypatch.chdir(pool)
    (pool / "by_file.json").write_text(json.dumps({**TWO_MACHINES, "cluster": "cluster.yaml"}))
    out = pool / "bundle"
    assert main(["export", "--plan", "by_file.json", "--to", "hetserve", "--model", "/models/llama-2-7b",
                 "-o", str(out)]) == 0
    assert (out / "cluster.yaml").read_text() == CLUSTER
    serve = [line for line in (out / "machines" / "a0.sh").read_text().splitlines()
             if "serve" in line and "--cluster" in line]
    assert serve and all("--cluster two-boxes" not in line for line in serve), serve


def test_a_second_bundle_into_the_same_folder_is_refused_and_force_replaces_the_first(pool, capsys):
    out = pool / "x8"
    assert export(pool, "two.json", "hetserve", out) == 0
    first = tree(out)
    assert {"machines/a0.sh", "machines/b0.sh", "cluster.yaml", "bundle.json"} <= first
    # the manifest lists every file the bundle wrote
    assert set(json.loads((out / "bundle.json").read_text())["files"]) == first - {"bundle.json"}
    capsys.readouterr()
    assert export(pool, "one.json", "vllm", out) == 2
    err = one_line_error(capsys)
    assert f"{out}: field '--output': expected a new or empty folder" in err and "--force" in err
    assert "a folder holding" in err
    assert tree(out) == first  # nothing written, nothing removed
    assert export(pool, "one.json", "vllm", out, "--force") == 0
    assert "removed the earlier bundle's" in capsys.readouterr().out
    # only the new bundle's files: b0.sh of the first plan is gone, the manifest is the new one's
    now = tree(out)
    assert "machines/b0.sh" not in now and "machines/a0.sh" in now
    assert set(json.loads((out / "bundle.json").read_text())["files"]) == now - {"bundle.json"}
    assert json.loads((out / "deploy.json").read_text())["engine"] == "vllm"


def test_force_never_removes_a_file_the_bundle_did_not_write(pool, capsys):
    out = pool / "x8"
    assert export(pool, "two.json", "hetserve", out) == 0
    (out / "notes.txt").write_text("mine")
    (out / "machines" / "extra.sh").write_text("mine")
    before = tree(out)
    capsys.readouterr()
    assert export(pool, "one.json", "vllm", out, "--force") == 2
    err = one_line_error(capsys)
    assert "--force" in err and "machines/extra.sh" in err and "notes.txt" in err
    assert tree(out) == before


def test_a_folder_of_other_files_is_refused_with_or_without_force(pool, capsys):
    out = pool / "mine"
    out.mkdir()
    (out / "a.sh").write_text("echo mine")
    for extra in ((), ("--force",)):
        assert export(pool, "one.json", "vllm", out, *extra) == 2
        err = one_line_error(capsys)
        assert f"{out}: field '--output'" in err and "a folder holding a.sh" in err
        assert ("no bundle.json" in err) == bool(extra)
    assert tree(out) == {"a.sh"}


def test_a_manifest_naming_files_elsewhere_removes_nothing(pool, capsys):
    """Only the names a bundle writes are removed: a manifest edited to name another file is no bundle's."""
    out = pool / "x8"
    assert export(pool, "one.json", "vllm", out) == 0
    victim = pool / "victim.txt"
    victim.write_text("keep")
    manifest = json.loads((out / "bundle.json").read_text())
    manifest["files"].append("../victim.txt")
    (out / "bundle.json").write_text(json.dumps(manifest))
    capsys.readouterr()
    assert export(pool, "one.json", "vllm", out, "--force") == 2
    assert "no bundle.json" in one_line_error(capsys)
    assert victim.read_text() == "keep" and (out / "deploy.json").exists()


def test_a_refused_plan_leaves_the_earlier_bundle_whole(pool, capsys):
    out = pool / "x8"
    assert export(pool, "two.json", "hetserve", out) == 0
    before = {p: (out / p).read_text() for p in tree(out)}
    assert export(pool, "mixed.json", "vllm", out, "--force") == 2  # vLLM runs one TP degree per replica
    assert {p: (out / p).read_text() for p in tree(out)} == before


def test_force_with_the_bundles_own_cluster_file(pool):
    """Re-exporting from the bundle's own copy of the cluster file: read before the old bundle goes."""
    out = pool / "x8"
    assert export(pool, "two.json", "hetserve", out) == 0
    assert export(pool, "two.json", "hetserve", out, "--force", cluster=out / "cluster.yaml") == 0
    assert (out / "cluster.yaml").read_text() == CLUSTER


# ---------------------------------------------------------------- the README against the scripts

SHELL_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=.*")  # `env NAME=value … cmd`: the NAME=value words


def script_servers(out: Path) -> list[list[str]]:
    """Each server a machine's script starts in its serve phase (argv, the environment dropped)."""
    servers = []
    for script in sorted((out / "machines").glob("*.sh")):
        for line in script.read_text().splitlines():
            if line.rstrip().endswith(" &"):
                argv = shlex.split(line.rstrip()[:-1])
                if argv and argv[0] == "env":
                    argv = argv[1:]
                    while argv and SHELL_ASSIGNMENT.fullmatch(argv[0]):
                        argv = argv[1:]
                servers.append(argv)
    return servers


def bind(argv: list[str]) -> str:
    return f"{argv[argv.index('--host') + 1]}:{argv[argv.index('--port') + 1]}"


@pytest.mark.parametrize("engine,plan_name", [("hetserve", "two.json"), ("hetserve", "pd.json"), ("vllm", "one.json"),
                                              ("vllm", "pd.json"), ("sglang", "one.json"), ("sglang", "pd.json")])
def test_readme_steps_start_each_process_once(pool, engine, plan_name):
    """Every command the README's steps name is one the scripts do not already run: together they
    bind each address once, and the address clients are told to use is one of them."""
    out = pool / f"b-{engine}-{plan_name}"
    assert export(pool, plan_name, engine, out) == 0
    steps = (out / "README.md").read_text().split("## Start, in this order", 1)[1].split("\n\n")[1]
    servers = script_servers(out)
    assert servers
    commands = []
    for n, step in enumerate(re.findall(r"^\d\. .*$", steps, flags=re.M), start=1):
        for cmd in re.findall(r"`([^`]+)`", step):
            argv = shlex.split(cmd)
            script = re.fullmatch(r"machines/(\w+)\.sh", argv[1]) if argv[:1] == ["bash"] else None
            if script:
                assert (out / argv[1]).is_file() and argv[2] in ("ray", "serve"), cmd
            elif n > 1 and "--port" in argv:  # a process the user starts beside the scripts'
                assert argv not in servers, f"step {n} runs a script's server again: {cmd}"
                commands.append(argv)
    binds = [bind(a) for a in servers + commands]
    assert len(binds) == len(set(binds)), binds
    clients = re.search(r"[Cc]lients use (http://\S+?)\.?(\s|$)", steps).group(1)
    assert clients.removeprefix("http://") in binds


@pytest.mark.parametrize("extra, port", [(["--ray-port", "8000"], 8000),
                                         (["--ray-port", "9100", "--port-range", "9000-9200"], 9100)])
def test_a_ray_port_another_process_of_the_machine_takes_is_refused_naming_both(pool, capsys, extra, port):
    out = pool / "clash"
    assert export(pool, "two.json", "hetserve", out, *extra) == 2
    err = one_line_error(capsys)
    assert f"port {port} on 10.0.0.5" in err and "ray start --head" in err and "hetserve serve" in err, err
    assert not out.exists() or tree(out) == set()  # nothing written
    assert export(pool, "two.json", "hetserve", out, "--ray-port", "9300", "--port-range", "9000-9200") == 0


def test_a_model_path_for_the_machines_that_is_not_here_says_export_needs_the_shape(pool, capsys):
    (pool / "own.json").write_text(json.dumps({**ONE_MACHINE, "model": "tiny-opt"}))
    code = main(["export", "--plan", str(pool / "own.json"), "--cluster", str(pool / "cluster.yaml"),
                 "--to", "vllm", "--model", "/nowhere/tiny-opt", "-o", str(pool / "out")])
    err = one_line_error(capsys)
    assert code == 2 and "--model /nowhere/tiny-opt is no folder on this machine" in err, err
    assert "pass --model" not in err  # it was passed


def test_a_fleets_export_names_its_machine_scripts_by_count_not_one_by_one(tmp_path, capsys):
    """Twelve machines, a one-GPU replica on each: the line of files written says how many scripts
    and names a few; the bundle still holds every one."""
    machines = "".join(f"  - {{name: m{i}, gpu: A100-SXM-80G, count: 1, address: 10.0.0.{i + 1}}}\n" for i in range(12))
    (tmp_path / "fleet.yaml").write_text(f"name: fleet\nmachines:\n{machines}network:\n"
                                         "  intra_site: {bandwidth_gbps: 25, latency_ms: 0.2}\n")
    (tmp_path / "plan.json").write_text(json.dumps({**plan(*({"id": f"c{i}", "role": "colocated",
                                                              "stages": [stage([f"m{i}:0"], 0, 32)]}
                                                             for i in range(12))), "cluster": "fleet"}))
    out = tmp_path / "bundle"
    assert main(["export", "--plan", str(tmp_path / "plan.json"), "--cluster", str(tmp_path / "fleet.yaml"),
                 "--to", "vllm", "--model", "/models/llama-2-7b", "-o", str(out)]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("wrote "))
    assert "machine scripts 12: machines/m0.sh, machines/m1.sh, machines/m2.sh, …" in line
    assert "machines/m11.sh" not in line and "README.md" in line
    assert {f"machines/m{i}.sh" for i in range(12)} <= tree(out)
