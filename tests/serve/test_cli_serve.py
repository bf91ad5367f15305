"""``hetserve serve`` as a user runs it: a subprocess on the loopback port the OS picks (``--port 0``)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from hetserve.cli.main import main as cli

PLAN = {"model": "tiny", "cluster": "demo-cpu", "replicas": [
    {"id": "c0", "role": "colocated", "stages": [{"devices": ["m0:0"], "layers": [0, 2]}]}]}


def test_serve_is_registered_and_imports_nothing_heavy():
    code = ("import sys; from hetserve.cli.main import build_parser; build_parser(); "
            "print(sorted(m for m in ('torch', 'fastapi', 'uvicorn') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


def test_serve_reports_a_missing_plan_in_one_line(tmp_path, capsys):
    assert cli(["serve", "--plan", str(tmp_path / "nope.json"), "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nope.json" in err[0]


@pytest.mark.parametrize("option,names", [("--router", ["aladdin", "jsq", "lot", "po2", "rr"]),
                                          ("--route", ["aladdin", "flow", "load"]),
                                          ("--transmission", ["fair", "molink", "serial"])])
def test_serve_refuses_an_unknown_policy_before_any_worker_starts(tmp_path, capsys, monkeypatch, option, names):
    """A policy name outside the registry (``serve``, and ``compare`` for its options): one line naming
    the option, the value and the choices, exit code 2, and no worker started (``build`` is never
    reached)."""
    from hetserve.planner.plan import Plan
    from hetserve.runtime.model.make import make_model
    from hetserve.serve import launch

    def no_build(opts):
        raise AssertionError(f"workers started for {option} foo")

    monkeypatch.setattr(launch, "build", no_build)
    model = make_model(tmp_path / "tiny", "llama", layers=2, hidden=32, heads=2)
    plan = tmp_path / "plan.json"
    Plan.from_dict(PLAN).save(plan)
    commands = ["serve"] + (["compare"] if option != "--transmission" else [])  # compare has no --transmission
    for command in commands:
        assert cli([command, "--plan", str(plan), "--cluster", "demo-cpu", "--model", str(model), option, "foo"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and option in err[0] and "'foo'" in err[0] and command in err[0], err
        assert all(name in err[0] for name in names), err


def test_serve_hands_the_device_channel_to_the_engine(tmp_path, monkeypatch, capsys):
    """--device-channel becomes the engine's ``device_channel`` (off unless asked); a wrong one is
    refused by argparse naming the choices."""
    from hetserve.planner.plan import Plan
    from hetserve.runtime.engine_config import EngineConfig
    from hetserve.runtime.model.make import make_model
    from hetserve.serve import launch

    seen = []

    def no_build(opts):
        seen.append(opts)
        raise ValueError("stopped before any worker started")

    monkeypatch.setattr(launch, "build", no_build)
    model = make_model(tmp_path / "tiny", "llama", layers=2, hidden=32, heads=2)
    plan = tmp_path / "plan.json"
    Plan.from_dict(PLAN).save(plan)
    base = ["serve", "--plan", str(plan), "--cluster", "demo-cpu", "--model", str(model), "--port", "0"]
    for asked, want in (([], "off"), (["--device-channel", "on"], "on"), (["--device-channel", "auto"], "auto")):
        cli(base + asked)
        assert seen[-1].engine_options["device_channel"] == want
        assert EngineConfig(**seen[-1].engine_options).device_channel == want
    capsys.readouterr()
    assert cli(base + ["--device-channel", "nccl"]) == 2 and len(seen) == 3
    assert "invalid choice: 'nccl'" in capsys.readouterr().err


@pytest.mark.slow
def test_serve_as_a_user_runs_it_port_keys_drain_and_clean_exit(tmp_path):
    """``hetserve serve`` as a user runs it, one server for all of this:

    * ``--port 0``: the OS picks the port, and the URL printed at start-up is the one that answers;
      the start-up lines say the dtype and which process holds each device;
    * keys from the environment and an admin key file: the start-up lines say what needs a key (and
      print none); /v1 needs a key, the probes stay open, /admin takes only its own key; an OpenAI
      client with a key lists the model and completes;
    * SIGTERM during a stream that cannot finish in the 5 s drain: new requests get 503 +
      Retry-After, the stream ends with one error event and [DONE], and the process exits cleanly."""
    import openai

    from hetserve.planner.plan import Plan
    from hetserve.runtime.model.make import make_model

    # the drain is the window in which the test sees 503s, long enough for a loaded machine to look;
    # the stream (16,000 tokens, 8 ms each on CI) outlasts it on a machine many times faster
    model = make_model(tmp_path / "tiny", "llama", layers=2, hidden=32, heads=2, max_positions=16384)
    plan = tmp_path / "plan.json"
    Plan.from_dict(PLAN).save(plan)
    admin_file = tmp_path / "admin.txt"
    admin_file.write_text(ADMIN_KEY + "\n")
    admin_file.chmod(0o600)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "NO_PROXY": "127.0.0.1", "COLUMNS": "200",
           "HETSERVE_API_KEY": f"{KEY},{OTHER_KEY}"}
    proc = subprocess.Popen([sys.executable, "-m", "hetserve.cli.main", "serve", "--plan", str(plan),
                             "--cluster", "demo-cpu", "--model", str(model), "--port", "0", "--admin-key-file",
                             str(admin_file), "--log-level", "warning", "--drain-timeout", "5"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    printer = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)  # until the pipe closes
    printer.start()
    events: list[str] = []
    try:
        deadline = time.monotonic() + 90
        url = None
        while url is None and time.monotonic() < deadline and proc.poll() is None:
            said = "".join(lines)
            found = re.search(r"on (http://127\.0\.0\.1:(\d+))/v1", said)
            url = found.group(1) if found and "admin endpoints" in said else None  # the keys' lines come last
            time.sleep(0.05)
        assert url is not None, "".join(lines)
        assert not url.endswith(":0")
        said = "".join(lines)
        assert "(float32) on http" in said, said  # the dtype it computes in
        # which process holds the device, and what making its stage took (start-up per worker)
        pid = int(re.search(r"workers \(up in [\d.]+ s, measured\): m0:0 pid (\d+), stage in [\d.]+ s "
                            r"\([\d.]+ MB read\)", said).group(1))
        assert proc.pid in _ancestors(pid)
        health = None
        while time.monotonic() < deadline:  # the line is printed just before uvicorn starts accepting
            try:
                health = httpx.get(url + "/health", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        assert health is not None and health.status_code == 200 and health.json()["model"] == "tiny"  # open

        _assert_401(httpx.get(url + "/v1/models"))
        _assert_401(httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "hi"},
                               headers=_bearer("wrong-key")))
        c = openai.OpenAI(base_url=url + "/v1", api_key=OTHER_KEY, max_retries=0, timeout=30)
        assert [m.id for m in c.models.list().data] == ["tiny"]
        r = c.completions.create(model="tiny", prompt="hi", max_tokens=3, temperature=0)
        assert r.usage.completion_tokens >= 1
        _assert_401(httpx.post(url + "/admin/replan", json={}, headers=_bearer(KEY)))
        r = httpx.post(url + "/admin/replan", json={"bogus": 1}, headers=_bearer(ADMIN_KEY))
        assert r.status_code == 400 and r.json()["error"]["param"] == "bogus"  # past the key, refused by its body

        body = {"model": "tiny", "prompt": "hi", "max_tokens": 16000, "stream": True, "ignore_eos": True}

        def stream() -> None:
            with httpx.stream("POST", url + "/v1/completions", json=body, headers=_bearer(KEY), timeout=60) as resp:
                events.extend(line[6:] for line in resp.iter_lines() if line.startswith("data: "))

        reader = threading.Thread(target=stream)
        reader.start()
        while not events and reader.is_alive():
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        while (h := httpx.get(url + "/health", timeout=5)).status_code == 200:
            time.sleep(0.02)
        assert h.json()["status"] == "draining"
        refused = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x"}, headers=_bearer(KEY),
                             timeout=5)
        assert refused.status_code == 503 and refused.headers["retry-after"]
        reader.join(60)
        assert events[-1] == "[DONE]" and "shutting down" in json.loads(events[-2])["error"]["message"]
    finally:
        _stop(proc, signal_it=not events)  # once streaming began, the test's own SIGTERM is the one under test
    printer.join(5)
    assert proc.returncode == 0, "".join(lines)
    out = "".join(lines)
    assert "API keys required on /v1/* (2 keys accepted)" in out
    assert "/health and /metrics open" in out and "admin endpoints (/admin/*) on" in out
    assert KEY not in out and OTHER_KEY not in out and ADMIN_KEY not in out


KEY, OTHER_KEY, ADMIN_KEY = "sk-test-one", "sk-test-two", "adm-secret"

PD_PLAN = {"model": "tiny", "cluster": "demo-cpu", "replicas": [
    {"id": "p0", "role": "prefill", "stages": [{"devices": ["m0:0"], "layers": [0, 2]}]},
    {"id": "d0", "role": "decode", "stages": [{"devices": ["m1:0"], "layers": [0, 2]}]}],
    "kv_routes": [{"from": "p0", "to": "d0", "weight": 1.0}]}


@pytest.mark.slow
def test_a_second_signal_answers_requests_in_flight_and_stops_without_a_traceback(tmp_path):
    """Two SIGTERMs while a streamed and a plain request run (a P/D plan, a 30 s drain): the plain one
    gets a 503 in OpenAI's shape, the stream an error event and [DONE]; the server exits 0 with no
    traceback. The start-up lines name the policies (defaults marked), each KV pool and its source,
    and the threads per worker."""
    from hetserve.planner.plan import Plan
    from hetserve.runtime.model.make import make_model

    model = make_model(tmp_path / "tiny", "llama", layers=2, hidden=32, heads=2, max_positions=4096)
    plan = tmp_path / "plan.json"
    Plan.from_dict(PD_PLAN).save(plan)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "NO_PROXY": "127.0.0.1", "COLUMNS": "200"}
    proc = subprocess.Popen([sys.executable, "-m", "hetserve.cli.main", "serve", "--plan", str(plan), "--model",
                             str(model), "--port", "0", "--transmission", "serial", "--shape-links",
                             "--kv-capacity", "9000"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    lines: list[str] = []
    printer = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    printer.start()
    events: list[str] = []
    plain: list[httpx.Response] = []
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 4000, "ignore_eos": True}
    try:
        url = _url_once_up(proc, lines)
        said = "".join(lines)
        assert "placement eft (default), KV route flow (default), transmission serial," in said, said
        assert "KV pools (tokens): p0 (prefill) 8992, d0 (decode) 8992; sized by --kv-capacity 9000, in whole " \
               "blocks of 16" in said, said
        assert re.search(r"torch threads per worker: \d+ each \(default: \d+ cores", said), said
        assert httpx.get(url + "/v1/models").json()["data"][0]["max_model_len"] == 4096  # the context: the smaller

        def stream() -> None:
            with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as resp:
                events.extend(line[6:] for line in resp.iter_lines() if line.startswith("data: "))

        readers = [threading.Thread(target=stream),
                   threading.Thread(target=lambda: plain.append(httpx.post(url + "/v1/completions", json=body,
                                                                           timeout=60)))]
        for t in readers:
            t.start()
        deadline = time.monotonic() + 30
        while not (events and httpx.get(url + "/health").json()["in_flight"] == 2) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert events, "".join(lines)
        proc.send_signal(signal.SIGTERM)
        while httpx.get(url + "/health", timeout=5).status_code == 200:
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        for t in readers:
            t.join(60)
        proc.wait(60)
    finally:
        _stop(proc, signal_it=proc.poll() is None and not events)
    printer.join(5)
    out = "".join(lines)
    assert proc.returncode == 0, out
    assert plain and plain[0].status_code == 503, (plain, out)
    error = plain[0].json()["error"]
    assert error["code"] == "shutting_down" and "second signal" in error["message"], error
    assert events[-1] == "[DONE]" and "second signal" in json.loads(events[-2])["error"]["message"], events[-3:]
    assert json.loads(events[-2])["error"]["code"] == "shutting_down", events[-2]  # the same refusal as the plain one
    assert "Traceback" not in out and "ERROR" not in out and "Exception in ASGI application" not in out, out
    assert "second signal: ending 2 request(s)" in out, out


def _url_once_up(proc: subprocess.Popen, lines: list[str], timeout_s: float = 90) -> str:
    """The URL ``serve`` prints, once ``/health`` answers on it."""
    deadline = time.monotonic() + timeout_s
    url = None
    while url is None and time.monotonic() < deadline and proc.poll() is None:
        said = "".join(lines)
        found = re.search(r"on (http://127\.0\.0\.1:\d+)/v1", said)
        url = found.group(1) if found and "admin endpoints" in said else None
        time.sleep(0.05)
    assert url is not None, "".join(lines)
    while time.monotonic() < deadline:
        try:
            httpx.get(url + "/health", timeout=1)
            return url
        except httpx.HTTPError:
            time.sleep(0.1)
    raise AssertionError(f"{url} did not answer: {''.join(lines)}")


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _assert_401(r: httpx.Response) -> None:
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", (r.request.url, r.text)
    assert r.json()["error"]["code"] == "invalid_api_key"


def test_sigterm_while_the_workers_start_stops_them_too(tmp_path):
    """A SIGTERM before the server is up (an orchestrator giving up on a slow start) ends the workers
    started so far with ``serve``, not leaving them orphaned."""
    from hetserve.planner.plan import Plan
    from hetserve.runtime.engine_config import START_METHOD_ENV
    from hetserve.runtime.model.make import make_model

    model = make_model(tmp_path / "tiny", "llama", layers=2, hidden=32, heads=2)
    plan = tmp_path / "plan.json"
    Plan.from_dict(PLAN).save(plan)
    # spawned workers: up in seconds, where a fork server first imports torch
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "200", START_METHOD_ENV: "spawn"}
    proc = subprocess.Popen([sys.executable, "-m", "hetserve.cli.main", "serve", "--plan", str(plan), "--cluster",
                             "demo-cpu", "--model", str(model), "--port", "0"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while not workers and time.monotonic() < deadline and proc.poll() is None:
            workers = _workers_of(proc.pid)
            time.sleep(0.02)
        assert workers, "no worker process appeared"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        _stop(proc)
    assert proc.returncode == 130 and "stopped while starting" in out, out
    deadline = time.monotonic() + 10
    while any(b"multiprocessing" in _cmdline(p) for p in workers):
        assert time.monotonic() < deadline, f"workers {workers} outlived serve"
        time.sleep(0.1)


def _processes() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _workers_of(root: int) -> list[int]:
    """Worker processes below ``root``: spawned ones (``spawn_main``), or forked by a fork server
    (a multiprocessing process below another one)."""
    found = []
    for pid in _processes():
        try:
            up = _ancestors(pid)
        except OSError:  # gone meanwhile
            continue
        if root in up and b"multiprocessing" in _cmdline(pid):
            if b"spawn_main" in _cmdline(pid) or up.index(root) >= 1:
                found.append(pid)
    return found


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _ancestors(pid: int) -> list[int]:
    """The process ids above ``pid``, its parent first (Linux /proc)."""
    out = []
    while pid > 1:
        pid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
        out.append(pid)
    return out


def _stop(proc: subprocess.Popen, signal_it: bool = True) -> None:
    """SIGTERM a server this test started (``signal_it``) and wait for it; kill it after 30 s."""
    if signal_it and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("level,shown", [("info", True), ("warning", False)])
def test_log_to_stderr_shows_hetserve_info_lines_at_level_info(capsys, level, shown):
    """What ``serve`` sets up for its ``--log-level``: a re-plan is logged at info on ``hetserve.serve``;
    at info (the default) it reaches stderr, at warning it does not; warnings show at both."""
    import logging

    from hetserve.cli.commands.serve import log_to_stderr

    handler = log_to_stderr(level)
    try:
        logging.getLogger("hetserve.serve").info("re-plan (failure): kept ['c0']")
        logging.getLogger("hetserve.runtime.recovery").warning("replica c1 out of service")
    finally:
        logging.getLogger("hetserve").removeHandler(handler)
        logging.getLogger("hetserve").setLevel(logging.NOTSET)
    err = capsys.readouterr().err
    assert ("INFO: re-plan (failure)" in err) == shown and "WARNING: replica c1 out of service" in err
