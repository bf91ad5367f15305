"""What `hetserve export` writes where the cluster file leaves a machine's address out (its name, and a
note saying so), and the hetserve bundle's `hetserve serve --port-range`."""

import json

import pytest
import yaml

from hetserve.cli.main import main
from tests.export.test_bundles import CLUSTER, PD_PLAN


def export(tmp_path, cluster_text, engine="hetserve", extra=(), out="bundle"):
    (tmp_path / "cluster.yaml").write_text(cluster_text)
    (tmp_path / "plan.json").write_text(json.dumps(PD_PLAN))
    out = tmp_path / out
    rc = main(["export", "--plan", str(tmp_path / "plan.json"), "--cluster", str(tmp_path / "cluster.yaml"),
               "--to", engine, "--model", "/models/llama-2-7b", "-o", str(out), *extra])
    return rc, out


@pytest.mark.parametrize("engine", ["hetserve", "vllm", "sglang"])
def test_machines_without_an_address_are_named_in_one_note(tmp_path, capsys, engine):
    """Without `address` the scripts use the machine's name as its host name: said once, naming the
    machines it concerns and the fix; a cluster file with every address gets no note."""
    no_b0 = CLUSTER.replace(", address: 10.0.0.6", "")
    rc, out = export(tmp_path, no_b0, engine)
    printed = capsys.readouterr().out
    assert rc == 0
    notes = [line for line in printed.splitlines() if line.startswith("note:")]
    assert len(notes) == 1, printed
    assert "no `address` for machine b0:" in notes[0] and "a0" not in notes[0].split(":")[1]
    assert "add `address: IP`" in notes[0] and "cluster file" in notes[0]
    assert "b0" in json.loads((out / "deploy.json").read_text())["machines"]["b0"]["address"]

    rc, _ = export(tmp_path, CLUSTER, engine, out="every-address")
    assert rc == 0 and "note:" not in capsys.readouterr().out


def test_the_note_names_every_machine_without_an_address(tmp_path, capsys):
    none = CLUSTER.replace(", address: 10.0.0.5", "").replace(", address: 10.0.0.6", "")
    assert export(tmp_path, none)[0] == 0
    note = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("note:"))
    assert "for machines a0, b0:" in note and "`--host a0`" in note


def test_the_hetserve_bundles_serve_command_carries_the_port_range():
    """ExportContext.port_range reaches `hetserve serve --port-range` in the bundle (no range: no option)."""
    from hetserve.export import native
    from hetserve.export.common import ExportContext
    from hetserve.planner.plan import Plan
    from hetserve.runtime.workers.rendezvous import PortRange
    from hetserve.specs.cluster import cluster_from_dict

    plan = Plan.from_dict(PD_PLAN)
    cluster = cluster_from_dict(yaml.safe_load(CLUSTER))
    with_range = native.build(ExportContext(plan, cluster, "/m", 32, port_range=PortRange(20000, 20099)), "c.yaml")
    argv = with_range.router["argv"]
    assert argv[argv.index("--port-range") + 1] == "20000-20099"
    assert all(x.argv == argv for x in with_range.launches() if x.argv[:2] == ["hetserve", "serve"])
    without = native.build(ExportContext(plan, cluster, "/m", 32), "c.yaml")
    assert "--port-range" not in without.router["argv"]


def test_export_port_range_reaches_the_bundles_serve_command(tmp_path):
    rc, out = export(tmp_path, CLUSTER, extra=("--port-range", "20000-20099"))
    assert rc == 0
    deploy = json.loads((out / "deploy.json").read_text())
    argv = next(x["argv"] for x in deploy["shared"] if x["kind"] == "server")
    assert argv[:2] == ["hetserve", "serve"] and argv[argv.index("--port-range") + 1] == "20000-20099"
    assert "--port-range 20000-20099" in (out / "machines" / "a0.sh").read_text()


@pytest.mark.parametrize("engine,value,expected", [
    ("hetserve", "9-3", "argument --port-range: expected LO-HI with 1 <= LO <= HI <= 65535"),
    ("hetserve", "70000-70001", "argument --port-range: expected LO-HI"),
    ("vllm", "20000-20099", "--port-range: expected --to hetserve (a vllm bundle's ports are fixed"),
    ("sglang", "20000-20099", "--port-range: expected --to hetserve (a sglang bundle's ports are fixed"),
])
def test_a_bad_port_range_is_one_line(tmp_path, capsys, engine, value, expected):
    try:
        rc, out = export(tmp_path, CLUSTER, engine, extra=("--port-range", value))
    except SystemExit as exc:  # argparse's own refusal
        rc, out = exc.code, tmp_path / "bundle"
    err = capsys.readouterr().err.strip()
    assert rc == 2 and expected in err and len(err.splitlines()) == 1, err
    assert not out.exists()


def test_the_readme_carries_the_address_note(tmp_path, capsys):
    rc, out = export(tmp_path, CLUSTER.replace(", address: 10.0.0.6", ""))
    printed = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("note:"))
    assert rc == 0 and f"Note: {printed[len('note: '):]}." in (out / "README.md").read_text()
    assert "Note:" not in export(tmp_path, CLUSTER, out="every-address")[1].joinpath("README.md").read_text()


def test_ray_nodes_sharing_a_machine_each_get_ports_of_their_own_where_rays_are_fixed(tmp_path):
    """Two vLLM replicas over both machines run two Ray clusters with a node of each on a0 and b0: the
    second node of a machine gets its own dashboard agent port, and the second head its own client
    server port (Ray's defaults, 52365 and 10001, are fixed: the second to take one would fail); the
    first keeps Ray's defaults. The bundle's port check passes."""
    from tests.export.test_bundles import stage

    plan = {"model": "llama-2-7b", "cluster": "two-boxes", "algorithm": "hand", "replicas": [
        {"id": f"c{i}", "role": "colocated", "stages": [stage([f"a0:{i}"], 0, 16), stage([f"b0:{i}"], 16, 32)]}
        for i in range(2)]}
    (tmp_path / "cluster.yaml").write_text(CLUSTER)
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    assert main(["export", "--plan", str(tmp_path / "plan.json"), "--cluster", str(tmp_path / "cluster.yaml"),
                 "--to", "vllm", "--model", "/models/llama-2-7b", "-o", str(tmp_path / "out")]) == 0
    deploy = json.loads((tmp_path / "out" / "deploy.json").read_text())
    starts = {}
    for r in deploy["replicas"]:
        for x in r["launch"]:
            if x["kind"] == "ray":
                starts.setdefault(x["machine"], []).append(x["argv"])
    for m, argvs in starts.items():
        assert len(argvs) == 2, starts
        agents = [a[a.index("--dashboard-agent-listen-port") + 1] if "--dashboard-agent-listen-port" in a else "52365"
                  for a in argvs]
        assert agents == ["52365", "52366"], (m, argvs)
    heads = starts["a0"]
    assert "--ray-client-server-port" not in heads[0]
    assert heads[1][heads[1].index("--ray-client-server-port") + 1] == "10000"  # below Ray's worker ports
    assert all("--ray-client-server-port" not in a for a in starts["b0"])  # no client server on a worker node


def test_a_fleets_notes_name_a_few_machines_and_count_the_rest(tmp_path):
    """171 machines without an address (or each to hold the checkpoint) make one readable sentence:
    the first eight by name and the count of the rest, not every name."""
    from types import SimpleNamespace

    from hetserve.export.common import address_note, checkpoint_note

    plan = SimpleNamespace(devices=[f"m{i}:{g}" for i in range(171) for g in range(2)])
    note = address_note(plan, SimpleNamespace(name="fleet", machine_addresses={"m3": "10.0.0.3"}))
    assert "machines m0, m1, m2, m4, m5, m6, m7, m8 and 162 more: " in note and "m9" not in note, note
    held = checkpoint_note(plan, str(tmp_path))
    assert "each of m0, m1, m2, m3, m4, m5, m6, m7 and 163 more must hold it" in held and "m8" not in held, held
    few = address_note(SimpleNamespace(devices=["a:0", "b:0"]), SimpleNamespace(name="two", machine_addresses={}))
    assert "machines a, b: " in few
