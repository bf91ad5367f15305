"""What a private Ray's owner leaves when it is killed (its folder, Ray's processes that outlive it):
removed by the next private start or a clean close, and only what can be told to be that folder's."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

import pytest

import ray  # noqa: F401  (puts Ray's psutil on the path)
import psutil  # noqa: E402

from hetserve.runtime.workers import ray_leftovers, ray_session
from hetserve.runtime.workers.ray_leftovers import OWNER_FILE, sweep
from hetserve.runtime.workers.ray_session import RaySession

HOLDS_A_FILE = "import sys, time; f = open(sys.stdin.readline().strip(), 'a'); print('ok', flush=True); time.sleep(120)"
# a process naming the folder, and a child of it that names nothing (as raylet and its workers)
NAMES_IT = ("import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
            "print(c.pid, flush=True); time.sleep(120)")


@pytest.fixture
def procs():
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait()


def _folder(parent, name: str, owner: str) -> str:
    """A folder of ``parent`` as a private Ray's, with ``owner``: "dead" (a process that has ended),
    "alive" (this one), "reused" (this pid, another start time), "none" (no marker), "garbled"."""
    folder = os.path.join(parent, name)
    os.mkdir(folder)
    os.makedirs(os.path.join(folder, "session_x", "logs"))
    if owner == "dead":
        subprocess.run([sys.executable, "-c", "import sys; from hetserve.runtime.workers.ray_leftovers import "
                        "write_owner; write_owner(sys.argv[1])", folder], check=True)
    elif owner == "alive":
        ray_leftovers.write_owner(folder)
    elif owner == "reused":
        with open(os.path.join(folder, OWNER_FILE), "w") as f:
            json.dump({"pid": os.getpid(), "started": psutil.Process().create_time() - 100}, f)
    elif owner == "garbled":
        with open(os.path.join(folder, OWNER_FILE), "w") as f:
            f.write('{"pid": "1"')
    return folder


def _holding(procs, path: str) -> psutil.Process:
    """A process with ``path`` open for writing; its command line does not name it (as Ray's agents')."""
    p = subprocess.Popen([sys.executable, "-c", HOLDS_A_FILE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    procs.append(p)
    p.stdin.write(path + "\n")
    p.stdin.flush()
    assert p.stdout.readline().strip() == "ok"
    return psutil.Process(p.pid)


def _naming(procs, path: str) -> tuple[psutil.Process, psutil.Process]:
    p = subprocess.Popen([sys.executable, "-c", NAMES_IT, path], stdout=subprocess.PIPE, text=True)
    procs.append(p)
    return psutil.Process(p.pid), psutil.Process(int(p.stdout.readline()))


def _gone(p: psutil.Process) -> bool:
    try:
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_dead_owners_folder_goes_with_the_processes_that_name_it_or_write_into_it(tmp_path, procs, caplog):
    caplog.set_level(logging.INFO, logger="hetserve.runtime")
    dead = _folder(tmp_path, "ray-dead", "dead")
    agent = _holding(procs, os.path.join(dead, "session_x", "logs", "agent.out"))
    raylet, worker = _naming(procs, f"--socket={dead}/session_x/sockets/raylet")
    bystander = _naming(procs, f"--socket={dead}x/session_x")[0]  # another folder whose name starts the same
    assert sweep(str(tmp_path)) == [dead]
    assert not os.path.exists(dead)
    assert all(_gone(p) for p in (agent, raylet, worker)) and not _gone(bystander)
    lines = [r.getMessage() for r in caplog.records if dead in r.getMessage()]
    assert len(lines) == 1 and "stopped the 3 Ray process(es)" in lines[0], lines


def test_a_folder_is_left_where_its_owner_is_alive_or_it_has_no_owner_of_this_code(tmp_path, procs):
    kept = {owner: _folder(tmp_path, f"ray-{owner}", owner) for owner in ("alive", "none", "garbled")}
    linked = _folder(tmp_path, "elsewhere", "dead")
    os.symlink(linked, os.path.join(tmp_path, "ray-link"))  # a link to a dead owner's folder is not followed
    reused = _folder(tmp_path, "ray-reused", "reused")  # this pid, but another process's start: its owner is gone
    writers = [_holding(procs, os.path.join(f, "session_x", "logs", "x.out")) for f in (*kept.values(), linked)]
    assert sweep(str(tmp_path)) == [reused]
    assert all(os.path.isdir(f) for f in (*kept.values(), linked)) and not os.path.exists(reused)
    assert not any(_gone(p) for p in writers)


def test_a_private_start_and_a_clean_close_each_sweep(tmp_path, monkeypatch):
    """The start sweeps before ray.init (here refused at once); close() after removing its own folder."""
    monkeypatch.setattr(ray_session, "TMP_PARENT", str(tmp_path))
    monkeypatch.delenv("RAY_TMPDIR", raising=False)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    from hetserve.specs.cluster import load_cluster

    first = _folder(tmp_path, "ray-first", "dead")

    def ray_init(**kw):
        assert not os.path.exists(first), "not swept before ray.init"
        raise RuntimeError("no Ray here")

    monkeypatch.setattr(ray, "init", ray_init)
    with pytest.raises(RuntimeError, match="no Ray here"):
        RaySession.start(load_cluster("demo-cpu"))
    assert os.listdir(tmp_path) == []  # the dead owner's, and the start's own on its failure
    second, own = _folder(tmp_path, "ray-second", "dead"), _folder(tmp_path, "ray-own", "alive")
    RaySession(False, own, private=True, made_tmp_dir=True).close()
    assert not os.path.exists(second) and not os.path.exists(own)


@pytest.mark.slow  # a real private Ray: ~25 s wall, under 10 s of CPU
@pytest.mark.timeout(180)
def test_after_a_sigkill_of_a_private_rays_owner_the_next_start_stops_what_it_left(tmp_path):
    """A real private Ray whose driver is SIGKILLed: Ray's agents outlive it (reparented, their command
    lines rewritten), and its folder stays; a sweep stops the one and removes the other."""
    parent = ray_session_parent()
    try:
        env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
        env.pop("RAY_TMPDIR", None)
        driver = subprocess.Popen([sys.executable, "-c", KILLED_DRIVER, parent], stdout=subprocess.PIPE, text=True,
                                  env=env)
        try:
            folder = driver.stdout.readline().strip()
            assert folder.startswith(parent), folder
            ray_pids = {p.pid for p in psutil.Process(driver.pid).children(recursive=True)}
        finally:
            driver.kill()
            driver.wait()
        time.sleep(3)  # Ray's servers that share their driver's fate end
        left = [p for p in map(_process, ray_pids) if p is not None and not _gone(p)]
        assert left and os.path.isdir(folder), "nothing outlived the driver: nothing to sweep"
        assert sweep(parent) == [folder]
        assert not os.path.exists(folder) and all(_gone(p) for p in left), left
    finally:
        _stop_any_in(parent)


KILLED_DRIVER = """
import sys
from hetserve.runtime.workers import ray_session
from hetserve.specs.cluster import load_cluster
ray_session.TMP_PARENT = sys.argv[1]
session = ray_session.RaySession.start(load_cluster("demo-cpu"), num_cpus=1)
print(session.tmp_dir, flush=True)
import time
time.sleep(300)
"""


def ray_session_parent() -> str:
    """A short folder for a private Ray's own (Ray's socket paths must stay under 107 bytes)."""
    import tempfile

    return tempfile.mkdtemp(prefix="hsleft-", dir="/tmp")


def _process(pid: int):
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None


def _stop_any_in(parent: str) -> None:
    """Whatever a failed test left of its Ray: this user's processes naming or writing into ``parent``."""
    import shutil

    ray_leftovers.stop_processes(ray_leftovers.ray_processes(parent))
    shutil.rmtree(parent, ignore_errors=True)
