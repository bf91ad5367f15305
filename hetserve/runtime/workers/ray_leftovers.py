"""What a private Ray (``RaySession``) leaves when its owner dies without closing it: its folder, and
those of Ray's processes that outlive their driver; found and removed by the next session's start
or close.

A folder is this code's only with an owner marker in it (``OWNER_FILE``: the owning process's pid
and start time, so that a reused pid is not taken for the owner), owned by this user; it is swept
only when that process is gone. Ray's processes are stopped with it only where they can be told to
be that folder's: this user's processes whose command line names a path in the folder (GCS, raylet,
monitor, dashboard) or that hold a file in it open (the agents, whose command line Ray rewrites to
``ray::...``), and their descendants. Nothing else is signalled.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import stat

from hetserve.output_path import write_whole

OWNER_FILE = "hetserve-owner.json"
FOLDER_PREFIX = "ray-"  # tempfile.mkdtemp's prefix for a private Ray's folder
STOP_WAIT_S = 2.0  # a Ray process's grace after SIGTERM before SIGKILL

log = logging.getLogger("hetserve.runtime")


def _psutil():
    import ray  # noqa: F401  (Ray ships psutil, and puts it on the path when imported)
    import psutil

    return psutil


def write_owner(folder: str) -> None:
    """Mark ``folder`` as this process's private Ray folder (written whole: a partial marker is never read)."""
    write_whole(os.path.join(folder, OWNER_FILE),
                json.dumps({"pid": os.getpid(), "started": _psutil().Process().create_time()}))


def _owner(folder: str) -> tuple[int, float] | None:
    """(pid, start time) the folder's marker names; None where the folder or marker is not this user's
    own plain file, or the marker is not a well-formed one (such a folder is never touched)."""
    me = os.getuid()
    try:
        st = os.lstat(folder)
        if st.st_uid != me or not stat.S_ISDIR(st.st_mode):  # a link is not followed
            return None
        fd = os.open(os.path.join(folder, OWNER_FILE), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(fd) as f:
            st = os.fstat(f.fileno())
            if st.st_uid != me or not stat.S_ISREG(st.st_mode):
                return None
            owner = json.loads(f.read(4096))
    except (OSError, ValueError):
        return None
    if not isinstance(owner, dict):
        return None
    pid, started = owner.get("pid"), owner.get("started")
    if type(pid) is not int or pid <= 0 or type(started) not in (int, float):
        return None
    return pid, float(started)


def owner_gone(pid: int, started: float) -> bool:
    """Whether the process that wrote a marker has ended: no process ``pid``, or one that started at another
    time (the pid reused). Start times are kept in clock ticks (1/100 s): within 0.05 s is the same start."""
    psutil = _psutil()
    try:
        return abs(psutil.Process(pid).create_time() - started) > 0.05
    except psutil.NoSuchProcess:
        return True
    except psutil.AccessDenied:  # unknown: taken for alive
        return False


def _names(folder: str, arg: str) -> bool:
    return re.search(re.escape(folder) + r"(/|$)", arg) is not None


def ray_processes(folder: str, among=None) -> list:
    """This user's processes (``among`` them, default all) that name a path in ``folder`` in their command
    line or hold a file in it open, and every descendant of those."""
    psutil = _psutil()
    me, found = os.getuid(), {}
    for p in (psutil.process_iter() if among is None else among):
        try:
            if p.pid == os.getpid() or p.uids().real != me:
                continue
            if any(_names(folder, a) for a in p.cmdline()) or any(_names(folder, f.path) for f in p.open_files()):
                found[p.pid] = p
                found.update((c.pid, c) for c in p.children(recursive=True))
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    found.pop(os.getpid(), None)
    return list(found.values())


def stop_processes(procs: list) -> int:
    """SIGTERM ``procs``, SIGKILL those left after ``STOP_WAIT_S``; how many were running."""
    psutil = _psutil()
    running = []
    for p in procs:
        try:
            p.terminate()
            running.append(p)
        except psutil.NoSuchProcess:
            pass
    _, left = psutil.wait_procs(running, timeout=STOP_WAIT_S)
    for p in left:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(left, timeout=STOP_WAIT_S)
    return len(running)


def sweep(parent: str) -> list[str]:
    """Remove the private Ray folders in ``parent`` whose marked owner is gone, stopping
    the Ray processes of each first; one log line per folder. The folders removed."""
    try:
        names = sorted(n for n in os.listdir(parent) if n.startswith(FOLDER_PREFIX))
    except OSError:
        return []
    swept = []
    for name in names:
        folder = os.path.join(parent, name)
        owner = _owner(folder)
        if owner is None or not owner_gone(*owner):
            continue
        stopped = stop_processes(ray_processes(folder))
        shutil.rmtree(folder, ignore_errors=True)
        swept.append(folder)
        log.info("removed %s, the private Ray folder of process %d, which ended without closing it%s", folder,
                 owner[0], f" (and stopped the {stopped} Ray process(es) it left running)" if stopped else "")
    return swept
