"""A private Ray (``--backend ray`` without ``--ray-address``): it and hetserve's listeners with it stay
on loopback, a planned stop is not reported as a death, and its temporary folder goes with it."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile

import pytest

import ray  # noqa: E402  (make test installs the ray extra: a missing ray must fail, not skip)
import psutil  # noqa: E402  (Ray ships it, and puts it on the path when imported)

from hetserve.runtime.workers import ray_backend, ray_session
from hetserve.runtime.workers.ray_session import RaySession

PLAN = {"model": "tiny", "cluster": "demo-cpu", "replicas": [
    {"id": "c0", "role": "colocated", "stages": [{"devices": ["m0:0"], "layers": [0, 2]},
                                                 {"devices": ["m1:0"], "layers": [2, 4]}]}]}
LOOPBACK = {"127.0.0.1", "::ffff:127.0.0.1"}


@pytest.mark.long  # a private Ray per case: make test-long
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("ray_kept", [True, False], ids=["ray-on-loopback", "ray-beyond-loopback"])
def test_a_private_ray_listens_on_loopback_and_a_planned_stop_leaves_nothing(tmp_path, monkeypatch, capfd, caplog,
                                                                              ray_kept):
    """``ray-beyond-loopback``: were Ray not kept there (a Ray that stops honouring it), hetserve's own
    listeners would still be on the address the private Ray was started on, and a warning says so."""
    import contextlib

    from ray._private import ray_constants

    # without the hold Ray moves to the host's outward address; a host with none keeps it on loopback
    moves = not ray_kept and _outward_ip() is not None
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.delenv("RAY_TMPDIR", raising=False)  # the session makes its own folder, and so removes it
    # Ray as a Linux process that imported it without the variable has it: cluster mode on, which
    # moves a loopback node to the machine's outward address (this sandbox's eth0) unless held off
    monkeypatch.delenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", raising=False)
    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", True)
    # Ray's socket paths must stay under 107 bytes, which pytest's tmp_path can exceed: a short folder
    # of this test, for the session to make its own in
    parent = tempfile.mkdtemp(prefix="hsray-", dir="/tmp")
    monkeypatch.setattr(ray_session, "TMP_PARENT", parent)
    if not ray_kept:
        monkeypatch.setattr(ray_session, "_ray_keeps_loopback", contextlib.nullcontext)
    try:
        _private_session(tmp_path, parent, capfd, ray_kept, moves)
    finally:
        ray.shutdown()
        shutil.rmtree(parent, ignore_errors=True)
    assert ("listen beyond loopback" in caplog.text) == moves
    assert ray_constants.ENABLE_RAY_CLUSTER is True  # restored: a later session joining a pool is as before


def _outward_ip() -> str | None:
    """An IPv4 address of this host beyond loopback, where it has one (Ray's cluster mode moves there)."""
    import psutil

    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return a.address
    return None


def _private_session(tmp_path, parent, capfd, ray_kept, moves):
    from hetserve.planner.plan import Plan
    from hetserve.runtime.engine_config import EngineConfig
    from hetserve.runtime.model.make import make_model
    from hetserve.runtime.params import SamplingParams
    from hetserve.specs.cluster import load_cluster

    model = make_model(tmp_path / "tiny", "llama", layers=4, hidden=64, heads=4, kv_heads=2, max_positions=256)
    session = RaySession.start(load_cluster("demo-cpu"))
    assert session.private and os.path.dirname(session.tmp_dir) == parent
    assert RaySession.private_ip() == RaySession.node_ip() == "127.0.0.1"
    engine = ray_backend.start_ray_engine(Plan.from_dict(PLAN), load_cluster("demo-cpu"), str(model), EngineConfig())
    try:
        out = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0), timeout=120)
        assert len(out[0]) == 4
        # hetserve's own listeners: the engine's endpoint and each worker's, bound and advertised
        assert engine.transport.address[0] == "127.0.0.1"
        assert {a[0] for a in engine.workers.addresses.values()} == {"127.0.0.1"}
        assert {p.host for p in engine.procs.values()} == {"127.0.0.1"}
        # every socket this process and the processes it started listen on: Ray's servers, its
        # workers (hetserve's worker endpoints among them), the engine's endpoint
        listening = _listeners()
        bound = {(pid, ip, port) for pid, _, ip, port in listening}
        assert (os.getpid(), *engine.transport.address) in bound
        for name, p in engine.procs.items():
            assert (p.pid, *engine.workers.addresses[name]) in bound, (name, listening)
        assert {"gcs_server", "raylet"} <= {name for _, name, _, _ in listening}, listening
        beyond = sorted((name, ip, port) for _, name, ip, port in listening if ip not in LOOPBACK)
        assert bool(beyond) == moves, f"listening beyond loopback: {beyond}"
    finally:
        engine.shutdown()
    # a planned stop: each worker ended of its own accord, not killed, and Ray reports no death
    assert {name: (p.exitcode, p.cause) for name, p in engine.procs.items()} == {
        name: (0, None) for name in engine.procs}
    if not ray_kept:  # a private Ray shut down behind the session's back leaves no address behind
        ray.shutdown()
        assert RaySession.private_ip() is None
    session.close()
    assert RaySession.private_ip() is None
    assert not os.path.exists(session.tmp_dir) and os.listdir(parent) == []
    printed = capfd.readouterr()
    assert "worker died" not in printed.out + printed.err, printed


def _listeners() -> list[tuple[int, str, str, int]]:
    """(pid, process name, address, port) of each TCP socket this process and its descendants listen on."""
    found = []
    me = psutil.Process()
    for proc in [me, *me.children(recursive=True)]:
        try:
            name = proc.name()
            conns = proc.net_connections(kind="tcp")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        found += [(proc.pid, name, c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN]
    return found


def test_close_keeps_a_folder_the_session_did_not_make(tmp_path):
    """``tmp_dir`` given (or ``$RAY_TMPDIR``) is the caller's: close() leaves it; its own it removes."""
    given, made = tmp_path / "given", tmp_path / "made"
    given.mkdir()
    made.mkdir()
    RaySession(False, str(given), private=True, made_tmp_dir=False).close()
    RaySession(False, str(made), private=True, made_tmp_dir=True).close()
    assert given.is_dir() and not made.exists()


EXITS = """
import os, sys, threading, time
from hetserve.runtime.workers.ray_backend import _exit_code_of
assert _exit_code_of(lambda cfg: os._exit(cfg), 7) == 7
assert _exit_code_of(lambda cfg: None, None) == 0
def other_thread(cfg):
    threading.Thread(target=os._exit, args=(cfg,)).start()
    time.sleep(60)
_exit_code_of(other_thread, 5)
sys.exit(1)
"""


def test_a_workers_exit_returns_from_its_actor_task_but_its_parent_watch_still_ends_the_process():
    """``os._exit`` on the thread running the worker is its task's return value (no death for Ray to
    report); on another thread, the worker's parent watch, it ends the process at once, as ever."""
    done = subprocess.run([sys.executable, "-c", EXITS], capture_output=True, text=True, timeout=120)
    assert done.returncode == 5, done.stderr


def _closed_port() -> socket.socket:
    """A loopback port bound but not listening: a connect there is refused at once."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock


@pytest.mark.parametrize("form", ["{port}", "ray://{port}"])
def test_joining_a_ray_address_where_nothing_answers_is_one_line_before_ray_init(form, monkeypatch):
    """Ray retries an absent head for minutes: hetserve connects first and names --ray-address."""
    from hetserve.errors import RuntimeFailure
    from hetserve.specs.cluster import load_cluster

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("ray.init asked to join an address nobody answers"))
    with _closed_port() as sock:
        port = sock.getsockname()[1]
        address = form.format(port=f"127.0.0.1:{port}")
        with pytest.raises(RuntimeFailure) as info:
            RaySession.start(load_cluster("demo-cpu"), address=address)
    message = str(info.value)
    assert message.startswith(f"--ray-address {address}: nothing answers at 127.0.0.1:{port} (")
    assert "start the Ray head there" in message and "drop --ray-address" in message
    assert "\n" not in message


def test_a_ray_address_that_answers_or_names_no_port_is_left_to_ray():
    with socket.create_server(("127.0.0.1", 0)) as listener:
        ray_session.check_ray_address(f"127.0.0.1:{listener.getsockname()[1]}")
        ray_session.check_ray_address(f"ray://127.0.0.1:{listener.getsockname()[1]}")
    for address in ("auto", "local", "127.0.0.1", "127.0.0.1:notaport"):
        ray_session.check_ray_address(address)


# what the engine's error gives as why a Ray worker died: the machine named, Ray's text cut at a word
UNAVAILABLE = ("Failed to connect to the actor's worker 127.0.0.3:41234 after its raylet went away, while "
               "submitting task run of actor WorkerActor from the driver at 127.0.0.2 (the GCS reports it "
               "pending): Socket closed rpc_code: 14")


def test_an_actor_ray_cannot_reach_names_the_machine_whose_node_stopped_answering():
    from ray.exceptions import ActorUnavailableError

    cause = ray_backend._death_cause(ActorUnavailableError(UNAVAILABLE, b"\x01" * 16), "m2", "127.0.0.3")
    head = "the Ray node of machine m2 at 127.0.0.3 stopped answering: it left the cluster or the network to it dropped"
    assert cause.startswith(head + " (Ray: The actor 0101")
    ray_text = cause[len(head) + len(" (Ray: "):-1]
    assert ray_text.endswith(" ...") and len(ray_text) <= 250
    full = f"The actor {'01' * 16} is unavailable: {UNAVAILABLE}. The task may or may not have been executed"
    kept = ray_text[:-len(" ...")]
    assert full.startswith(kept) and full[len(kept)] in " ,;:", f"cut mid-word: {kept[-20:]!r}"


def test_an_actor_whose_node_died_names_the_machine_that_left():
    from ray.core.generated.common_pb2 import ActorDiedErrorContext
    from ray.exceptions import ActorDiedError

    context = ActorDiedErrorContext(error_message="The actor is dead because its node has died. Node Id: 5e1f",
                                    actor_id=b"\x01" * 16, class_name="WorkerActor", node_ip_address="127.0.0.3")
    cause = ray_backend._death_cause(ActorDiedError(context), "m2", "127.0.0.3")
    assert cause.startswith("the Ray node of machine m2 at 127.0.0.3 left the cluster (Ray: ")
    assert "its node has died" in cause and "class_name" not in cause and "\n" not in cause


def test_an_actor_whose_process_died_on_a_live_node_is_not_a_node_that_left():
    """Ray's text for a killed worker process names the node too ("Node ID"): no node left."""
    from ray.core.generated.common_pb2 import ActorDiedErrorContext
    from ray.exceptions import ActorDiedError

    text = ("The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR "
            "Worker exit detail: Worker unexpectedly exits with a connection error code 2. Node ID: 5e1f")
    context = ActorDiedErrorContext(error_message=text, actor_id=b"\x01" * 16, class_name="WorkerActor",
                                    node_ip_address="127.0.0.3")
    cause = ray_backend._death_cause(ActorDiedError(context), "m2", "127.0.0.3")
    assert cause.startswith("on machine m2: ") and "its worker process has died" in cause, cause
