"""Launch bundles (hetserve export): scripts that parse, start exactly the plan's processes on the
right machines with the right GPUs and parallel sizes (checked by a stand-in engine on PATH), and
refusals that name the replica and the rule."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hetserve.cli.main import main

HERE = Path(__file__).parent
LAYERS = 32  # llama-2-7b

CLUSTER = """\
name: two-boxes
machines:
  - {name: a0, gpu: A100-SXM-80G, count: 4, address: 10.0.0.5}
  - {name: b0, gpu: RTX-4090, count: 4, address: 10.0.0.6}
network:
  intra_site: {bandwidth_gbps: 25, latency_ms: 0.2}
"""


def stage(devices, lo, hi):
    return {"devices": devices, "layers": [lo, hi]}


# runnable by vLLM and SGLang: a prefill over two machines (PP 2, uneven), a pipelined prefill on one
# machine (TP 1 × PP 2, uneven), an unpipelined TP 2 decode
PD_PLAN = {"model": "llama-2-7b", "cluster": "two-boxes", "algorithm": "hand",
           "replicas": [{"id": "p0", "role": "prefill",
                         "stages": [stage(["a0:1", "a0:0"], 0, 12), stage(["b0:0", "b0:1"], 12, 32)]},
                        {"id": "p1", "role": "prefill", "stages": [stage(["b0:3"], 0, 20), stage(["b0:2"], 20, 32)]},
                        {"id": "d0", "role": "decode", "stages": [stage(["a0:2", "a0:3"], 0, 32)]}],
           "kv_routes": [{"from": "p0", "to": "d0", "weight": 1.0}, {"from": "p1", "to": "d0", "weight": 1.0}]}

# asymmetric TP inside one replica: hetserve runs it, vLLM and SGLang cannot
MIXED_PLAN = {"model": "llama-2-7b", "cluster": "two-boxes", "algorithm": "hand",
              "replicas": [{"id": "c0", "role": "colocated",
                            "stages": [stage(["a0:0", "a0:1"], 0, 20), stage(["b0:0"], 20, 32)]},
                           {"id": "c1", "role": "colocated", "stages": [stage(["b0:1", "b0:2"], 0, 32)]}]}

# two stages on a0 and one on b0: vLLM (over Ray) runs it, SGLang gives each node pp // nnodes stages
UNEVEN_NODES_PLAN = {"model": "llama-2-7b", "cluster": "two-boxes", "algorithm": "hand",
                     "replicas": [{"id": "c0", "role": "colocated",
                                   "stages": [stage(["a0:0"], 0, 10), stage(["a0:1"], 10, 20),
                                              stage(["b0:0"], 20, 32)]}]}

# a pipelined decode replica fed by a prefill one: vLLM's NIXL connector cannot
PIPELINED_DECODE_PLAN = {"model": "llama-2-7b", "cluster": "two-boxes", "algorithm": "hand",
                         "replicas": [{"id": "p0", "role": "prefill", "stages": [stage(["a0:0"], 0, 32)]},
                                      {"id": "d7", "role": "decode",
                                       "stages": [stage(["b0:0"], 0, 16), stage(["b0:1"], 16, 32)]}],
                         "kv_routes": [{"from": "p0", "to": "d7", "weight": 1.0}]}


@pytest.fixture()
def files(tmp_path):
    (tmp_path / "cluster.yaml").write_text(CLUSTER)

    def write(name, plan):
        p = tmp_path / name
        p.write_text(json.dumps(plan))
        return p
    return tmp_path, write


@pytest.fixture(scope="module")
def standin_bin(tmp_path_factory):
    """``python``, ``ray`` and ``hetserve`` on PATH, each the recorder under this interpreter."""
    folder = tmp_path_factory.mktemp("standin-bin")
    for prog in ("python", "ray", "hetserve"):
        p = folder / prog
        p.write_text(f"#!/bin/sh\nexec {sys.executable} {HERE / 'standin.py'} {prog} \"$@\"\n")
        p.chmod(0o755)
    return folder


def export(tmp, plan_path, engine):
    out = tmp / f"bundle-{engine}"
    rc = main(["export", "--plan", str(plan_path), "--cluster", str(tmp / "cluster.yaml"), "--to", engine,
               "--model", "/models/llama-2-7b", "-o", str(out)])
    return rc, out


def run_bundle(out, standin_bin, tmp):
    """Run every machine's script (ray phase everywhere, then serve) under the stand-in; its records."""
    deploy = json.loads((out / "deploy.json").read_text())
    records = tmp / f"records-{out.name}"
    records.mkdir()
    for phase in ("ray", "serve"):
        for m, info in deploy["machines"].items():
            launches = [x for r in deploy["replicas"] for x in r["launch"]] + deploy.get("shared", [])
            servers = sum(1 for x in launches if x["machine"] == m and x["kind"] == "server")
            env = {**{k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}, "PATH": f"{standin_bin}:{os.environ['PATH']}", "STANDIN_DIR": str(records),
                   "STANDIN_MACHINE": m, "STANDIN_LAYERS": str(LAYERS), "STANDIN_SERVERS": str(servers)}
            proc = subprocess.run(["bash", str(out / info["script"]), phase], env=env, capture_output=True,
                                  text=True, timeout=60)
            assert proc.returncode == 0, f"{m} {phase}: {proc.stderr}"
    return deploy, [json.loads(p.read_text()) for p in sorted(records.glob("*.json"))]


def flag(argv, name):
    return argv[argv.index(name) + 1]


def test_scripts_parse(files, standin_bin):
    tmp, write = files
    plan = write("pd.json", PD_PLAN)
    for engine in ("vllm", "sglang", "hetserve"):
        rc, out = export(tmp, plan, engine)
        assert rc == 0
        scripts = sorted((out / "machines").glob("*.sh"))
        assert [s.stem for s in scripts] == ["a0", "b0"]
        for s in scripts:
            assert subprocess.run(["bash", "-n", str(s)]).returncode == 0
            if shutil.which("shellcheck"):
                assert subprocess.run(["shellcheck", str(s)]).returncode == 0
        deploy = json.loads((out / "deploy.json").read_text())
        assert set(deploy) >= {"engine", "engine_version", "plan", "replicas", "router"}
        assert deploy["engine"] == engine and deploy["plan"] == "plan.json" and (out / "plan.json").exists()
        assert "README.md" in os.listdir(out) and "router.json" in os.listdir(out)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_engine_bundle_launches_the_plan(files, standin_bin, engine):
    tmp, write = files
    rc, out = export(tmp, write("pd.json", PD_PLAN), engine)
    assert rc == 0
    deploy, recs = run_bundle(out, standin_bin, tmp)
    addresses = {"a0": "10.0.0.5", "b0": "10.0.0.6"}
    # every plan device launched exactly once, on its machine, with its GPU index: a server's own
    # CUDA_VISIBLE_DEVICES, or the Ray node's that a Ray-backed server runs on
    launched = []
    for r in recs:
        uses_ray = r["kind"] == "server" and "--distributed-executor-backend" in r["argv"]
        if not uses_ray and r["env"].get("CUDA_VISIBLE_DEVICES"):
            launched += [f"{r['machine']}:{i}" for i in r["env"]["CUDA_VISIBLE_DEVICES"].split(",")]
    plan_devices = [d for rep in PD_PLAN["replicas"] for s in rep["stages"] for d in s["devices"]]
    assert sorted(launched) == sorted(plan_devices)
    # each replica's server(s): its host and port are its endpoint, TP / PP / layer split are the plan's
    servers = [r for r in recs if r["kind"] == "server"]
    tp_flag, pp_flag, part = (("--tensor-parallel-size", "--pipeline-parallel-size", "VLLM_PP_LAYER_PARTITION")
                              if engine == "vllm" else ("--tp-size", "--pp-size", "SGLANG_PP_LAYER_PARTITION"))
    for rep in PD_PLAN["replicas"]:
        endpoint = next(x["endpoint"] for x in deploy["replicas"] if x["id"] == rep["id"])
        mine = [r for r in servers if f"http://{flag(r['argv'], '--host')}:{flag(r['argv'], '--port')}" == endpoint]
        machines = list(dict.fromkeys(d.split(":")[0] for s in rep["stages"] for d in s["devices"]))
        assert mine, rep["id"]
        assert flag(mine[0]["argv"], "--host") == addresses[machines[0]]
        for r in mine:
            assert int(flag(r["argv"], tp_flag)) == len(rep["stages"][0]["devices"])
            assert int(flag(r["argv"], pp_flag)) == len(rep["stages"])
            split = [s["layers"][1] - s["layers"][0] for s in rep["stages"]]
            assert r["env"].get(part) == (",".join(map(str, split)) if len(split) > 1 else None)
        if engine == "sglang":  # one server per machine, node ranks in stage order, GPUs in stage order
            assert [r["machine"] for r in sorted(mine, key=lambda r: int(flag(r["argv"], "--node-rank"))
                                                 if "--node-rank" in r["argv"] else 0)] == machines
            for r in mine:
                own = [d.split(":")[1] for s in rep["stages"] for d in s["devices"] if d.startswith(r["machine"] + ":")]
                assert r["env"]["CUDA_VISIBLE_DEVICES"] == ",".join(own)
            want = "prefill" if rep["role"] == "prefill" else "decode"
            assert all(flag(r["argv"], "--disaggregation-mode") == want for r in mine)
        else:
            assert len(mine) == 1 and mine[0]["machine"] == machines[0]
            assert json.loads(flag(mine[0]["argv"], "--kv-transfer-config"))["kv_connector"] == "NixlConnector"
            if len(machines) == 1:  # rank i gets the i-th visible GPU: the plan's devices in stage order
                own = [d.split(":")[1] for s in rep["stages"] for d in s["devices"]]
                assert mine[0]["env"]["CUDA_VISIBLE_DEVICES"] == ",".join(own)
            else:  # its Ray cluster: head on the first stage's machine, a node per other machine
                ray = [r for r in recs if r["kind"] == "ray" and r["env"].get("RAY_ADDRESS") is None
                       and (flag(r["argv"], "--port") if "--head" in r["argv"] else
                            flag(r["argv"], "--address").rsplit(":", 1)[1]) == mine[0]["env"]["RAY_ADDRESS"].rsplit(":", 1)[1]]
                assert sorted(r["machine"] for r in ray) == sorted(machines)
                assert next(r for r in ray if "--head" in r["argv"])["machine"] == machines[0]


def test_hetserve_bundle_is_multinode_doc_as_scripts(files, standin_bin):
    tmp, write = files
    rc, out = export(tmp, write("pd.json", PD_PLAN), "hetserve")
    assert rc == 0
    deploy, recs = run_bundle(out, standin_bin, tmp)
    ray = {r["machine"]: r for r in recs if r["kind"] == "ray"}
    assert set(ray) == {"a0", "b0"}
    assert "--head" in ray["a0"]["argv"] and flag(ray["b0"]["argv"], "--address") == "10.0.0.5:6379"
    for m, addr in (("a0", "10.0.0.5"), ("b0", "10.0.0.6")):
        assert json.loads(flag(ray[m]["argv"], "--resources")) == {f"hetserve_machine_{m}": 1000}
        assert flag(ray[m]["argv"], "--node-ip-address") == addr
    serve = [r for r in recs if r["kind"] == "server"]
    assert len(serve) == 1 and serve[0]["machine"] == "a0"
    assert all(r["env"]["RAY_AUTH_MODE"] == "token" for r in recs)  # Ray's token auth unless told otherwise
    assert flag(serve[0]["argv"], "--backend") == "ray" and flag(serve[0]["argv"], "--ray-address") == "10.0.0.5:6379"
    # the bundle's plan and cluster are what serve reads, and they are the plan's
    assert (out / flag(serve[0]["argv"], "--cluster")).read_text() == CLUSTER
    assert json.loads((out / "plan.json").read_text())["replicas"] == PD_PLAN["replicas"]
    devices = [f"{x['machine']}:{i}" for r in deploy["replicas"] for x in r["launch"] for i in x["gpu_indices"]]
    assert sorted(devices) == sorted(d for rep in PD_PLAN["replicas"] for s in rep["stages"] for d in s["devices"])


@pytest.mark.parametrize("engine,plan,replica,rule", [
    ("vllm", MIXED_PLAN, "c0", "one TP degree per replica"),
    ("sglang", MIXED_PLAN, "c0", "one TP degree per replica"),
    ("sglang", UNEVEN_NODES_PLAN, "c0", "pp_size // nnodes"),
    ("vllm", PIPELINED_DECODE_PLAN, "d7", "unpipelined decode"),
])
def test_plan_the_engine_cannot_run_is_refused(files, capsys, engine, plan, replica, rule):
    tmp, write = files
    rc, out = export(tmp, write("p.json", plan), engine)
    err = capsys.readouterr().err
    assert rc == 2
    assert f"replica {replica}:" in err and rule in err and f"--engine {engine}" in err
    assert not out.exists()  # nothing written


def test_runnable_elsewhere(files):
    """The refusals are the engine's rules, not blanket ones: hetserve runs every plan above, vLLM the
    uneven-nodes one (over its Ray cluster)."""
    tmp, write = files
    for engine, plan in (("hetserve", MIXED_PLAN), ("vllm", UNEVEN_NODES_PLAN), ("sglang", PIPELINED_DECODE_PLAN)):
        assert export(tmp, write(f"{engine}.json", plan), engine)[0] == 0


def test_a_preset_name_left_as_the_model_is_pointed_out(files, capsys):
    """Without --model the scripts load the plan's model name; a preset's name is no checkpoint an
    engine can load, and the command says so (with --model it says nothing)."""
    tmp, write = files
    plan = write("pd.json", PD_PLAN)
    assert main(["export", "--plan", str(plan), "--cluster", str(tmp / "cluster.yaml"), "--to", "vllm",
                 "-o", str(tmp / "no-model")]) == 0
    assert "export again with --model PATH" in capsys.readouterr().out
    assert export(tmp, plan, "vllm")[0] == 0
    assert "--model PATH" not in capsys.readouterr().out


def test_a_checkpoint_folder_given_relative_is_written_absolute(files, monkeypatch):
    """The scripts run from their own folder (and on other machines): a local checkpoint given as a
    relative path goes into them as its absolute path; a path that is not here stays as given."""
    tmp, write = files
    plan = write("pd.json", PD_PLAN)
    monkeypatch.chdir(tmp)
    assert main(["make-model", "--like", "llama-2-7b", "--random-weights", "-o", "models/llama-2-7b"]) == 0
    assert main(["export", "--plan", str(plan), "--cluster", "cluster.yaml", "--to", "vllm", "--model",
                 "models/llama-2-7b", "-o", "bundle"]) == 0
    text = "".join(p.read_text() for p in (tmp / "bundle" / "machines").glob("*.sh"))
    absolute = str(tmp / "models" / "llama-2-7b")
    assert absolute in text and text.count("models/llama-2-7b") == text.count(absolute)
