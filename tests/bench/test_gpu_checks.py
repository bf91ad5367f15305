"""The GPU checks' parts that run without a GPU (bench/gpu/): the wheels carried to the GPU machine,
the time limits against the device session, the order of the serve check's stages."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _requirements(path: Path) -> dict[str, str]:
    """name (lower case, '_' as '-') -> pinned version, of a file of ``name==version`` lines."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[name.strip().lower().replace("_", "-")] = version.strip()
    return out


def test_gpu_wheels_are_pinned_to_the_tested_versions():
    """Every wheel carried to the GPU machine is the version the project is tested with, msgpack
    (the workers' wire format) among them."""
    wheels = _requirements(ROOT / "bench" / "gpu" / "wheels.txt")
    tested = _requirements(ROOT / "requirements" / "constraints.txt")
    assert "msgpack" in wheels
    off = {n: (v, tested.get(n)) for n, v in wheels.items() if tested.get(n) != v}
    assert not off, f"bench/gpu/wheels.txt (pinned, tested): {off}"


def test_make_gpu_wheels_reads_the_list():
    """The Makefile takes its list from bench/gpu/wheels.txt (one list for make and env.sh)."""
    make = (ROOT / "Makefile").read_text()
    assert "GPU_WHEELS := $(shell grep -v '^\\#' bench/gpu/wheels.txt)" in make
    assert "bench/gpu/wheels.txt" in (ROOT / "bench" / "gpu" / "env.sh").read_text()


def _default_limit(script: str, knob: str) -> int:
    """A check script's default time limit: ``${KNOB:-N}`` in bench/gpu/SCRIPT."""
    m = re.search(r"\$\{" + knob + r":-(\d+)\}", (ROOT / "bench" / "gpu" / script).read_text())
    assert m, f"bench/gpu/{script}: no ${{{knob}:-N}} default"
    return int(m.group(1))


def test_gpu_check_limits_fit_the_device_session():
    """The three checks' default limits (each + 10 s to stop) leave room in a 15-minute device session
    for the machine's start-up (up to 3 min) and the scripts' own set-up; each HTTP call and each
    deployment's start-up gives up well before serve.sh's limit, so later stages still run."""
    from bench.gpu import serve_check, serve_client

    step, dataflow, serve = (_default_limit("step.sh", "STEP_S"), _default_limit("dataflow.sh", "DATAFLOW_S"),
                             _default_limit("serve.sh", "SERVE_S"))
    assert step + dataflow + serve + 3 * 10 <= 15 * 60 - 180 - 120, (step, dataflow, serve)
    assert serve_client.HTTP_TIMEOUT_S <= serve / 3
    assert serve_check.GPU_SIZES["start_s"] <= serve / 2


def test_serve_check_measures_transformers_before_the_deployments(tmp_path, monkeypatch):
    """transformers' baseline runs first: a deployment that hangs until the time limit leaves it measured."""
    from bench.gpu import serve_check

    order = []

    def make_model(cmd, **kw):  # the model folder, without running make-model
        out = Path(cmd[cmd.index("-o") + 1])
        out.mkdir()
        (out / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "hidden_size": 8, "num_attention_heads": 2,
                                                     "intermediate_size": 16, "vocab_size": 32}))

    monkeypatch.setattr(serve_check.subprocess, "run", make_model)
    monkeypatch.setattr(serve_check, "transformers_baseline", lambda *a: order.append("transformers"))
    monkeypatch.setattr(serve_check, "deployment", lambda report, kind, *a: order.append(kind))
    monkeypatch.setattr(sys, "argv", ["serve_check.py", "--cpu", "--out", str(tmp_path)])
    monkeypatch.setattr(serve_check.signal, "signal", lambda *a: None)
    assert serve_check.main() == 0
    assert order == ["transformers", "colocated", "prefill->decode"]


def test_serve_check_finds_each_fallback_the_runtime_logs():
    """Each of the runtime's fallback log lines, as a worker prints it, is found once; other lines are not;
    and each entry of FALLBACK_LOG is still words the runtime logs (a changed log line fails here)."""
    from bench.gpu.serve_check import FALLBACK_LOG, fallbacks

    logged = [f"m0:1: {words} (bucket 8, RuntimeError: capture invalidated)" for words in FALLBACK_LOG]
    lines = ["INFO: up in 12.0 s", *logged, logged[0], "m0:0 pid 12, stage in 3.1 s", "channel: on"]
    assert fallbacks(lines) == logged
    runtime = "\n".join(p.read_text() for p in (ROOT / "hetserve" / "runtime").rglob("*.py"))
    assert [w for w in FALLBACK_LOG if w not in runtime] == []
    # and the other way: every log string the runtime marks as grepped by a GPU check is grepped
    marked = re.findall(r'^[A-Z_]+ = "([^"]+)"\s+#.*GPU check greps', runtime, re.MULTILINE)
    assert len(marked) >= 4 and [m for m in marked if not any(w in m for w in FALLBACK_LOG)] == []


def test_serve_check_records_a_fallback_under_errors(tmp_path, monkeypatch):
    """A deployment whose worker fell back ends with that line under errors (the run exits non-zero)."""
    from bench.gpu import serve_check
    from bench.gpu.results import StageReport

    report = StageReport(tmp_path, "serve", {"deployments": {}}, lambda d: "")

    class Server:  # what deployment() reads of a server that started and then logged a fallback
        port, lines = 0, ["m0:1: CUDA graph capture failed (bucket 8, RuntimeError: x); decode steps run eagerly"]

        def __init__(self, *a):
            pass

        def wait_ok(self, limit):
            raise TimeoutError("not up")

        def stop(self, quick):
            return {"clean": True}

    monkeypatch.setattr(serve_check, "Server", Server)
    serve_check.deployment(report, "colocated", tmp_path, {"num_hidden_layers": 2}, tmp_path,
                           serve_check.CPU_SIZES, "H200", 1.0)
    assert report.data["deployments"]["colocated"]["fallbacks"] == Server.lines
    assert {"stage": "colocated: a worker fell back", "error": Server.lines[0]} in report.data["errors"]


def _step_report(tmp_path):
    import torch

    from bench.gpu import step_check

    return step_check, step_check.Report(tmp_path, torch.device("cpu"), "tiny")


def test_step_check_launches_a_triton_kernel_first(tmp_path):
    """The launch check runs the real kernel (under Triton's interpreter here) and keeps its line."""
    import torch

    step_check, report = _step_report(tmp_path)
    step_check.triton_launch(report, torch.device("cpu"))
    assert report.data["errors"] == []
    assert report.data["triton_launch"]["ok"] and "result right" in report.data["triton_launch"]["output"][-1]


def test_step_check_records_a_triton_launch_that_fails_or_hangs(tmp_path, monkeypatch):
    """A launch that fails or gives no answer in time is an error naming why; the run goes on."""
    import subprocess

    import torch

    step_check, report = _step_report(tmp_path)
    monkeypatch.setattr(step_check.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(
        cmd, 1, "", "ImportError: cannot build the launcher: Python.h: No such file or directory"))
    step_check.triton_launch(report, torch.device("cuda"))

    def hang(cmd, **kw):
        raise subprocess.TimeoutExpired(cmd, kw["timeout"])

    monkeypatch.setattr(step_check.subprocess, "run", hang)
    step_check.triton_launch(report, torch.device("cuda"))
    errors = [e["error"].strip().splitlines()[-1] for e in report.data["errors"]]
    assert "Python.h: No such file or directory" in errors[0] and "exit 1" in errors[0]
    assert f"no answer within {step_check.TRITON_LAUNCH_S} s" in errors[1]
    assert report.data["triton_launch"]["ok"] is False
    assert "FAILED" in step_check.table(report.data)


def test_step_check_times_the_whole_step_apart_from_the_forward(tmp_path, monkeypatch):
    """step_ms runs what the engine's last stage runs each step (prepare, embedding, forward, LM head,
    sampling); forward_ms runs the forward alone."""
    import torch

    from hetserve.runtime.model.config import ArchConfig
    from hetserve.runtime.model.loader import build_stage
    from hetserve.runtime.model.make import make_model

    step_check, _ = _step_report(tmp_path)
    d = make_model(tmp_path / "m", "llama", layers=2, hidden=64, heads=4, kv_heads=2, seed=1)
    cfg = ArchConfig.from_dir(d)
    stage = build_stage(cfg, d, (0, cfg.num_layers), has_embed=True, has_head=True, device=torch.device("cpu"))
    pool = step_check.KVPool(cfg.num_layers, 64 * 64 * step_check.BLOCK, cfg.num_kv_heads, cfg.head_dim,
                             torch.float32, torch.device("cpu"))
    runner = step_check._runner(stage, cfg, pool, torch.device("cpu"), torch.float32, False)
    calls = {"prepare": 0, "sample": 0}
    real_prepare, real_sample = runner.prepare, step_check.sample

    def prepare(*a):
        calls["prepare"] += 1
        return real_prepare(*a)

    def sample(logits, keys):
        calls["sample"] += 1
        assert logits.shape == (2, cfg.vocab_size)
        return real_sample(logits, keys)

    monkeypatch.setattr(runner, "prepare", prepare)
    monkeypatch.setattr(step_check, "sample", sample)
    with torch.inference_mode():
        step_check.forward_ms(runner, 2, 32, cfg.hidden_size, torch.float32, torch.device("cpu"), reps=4)
        assert calls == {"prepare": 1, "sample": 0}
        step_check.step_ms(stage, runner, 2, 32, torch.device("cpu"), reps=4)
    assert calls == {"prepare": 1 + 3 + 4, "sample": 3 + 4}
