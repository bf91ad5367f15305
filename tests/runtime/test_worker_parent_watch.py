"""A worker whose engine dies while the worker is still starting (importing torch) exits once its
watch starts, for both start methods the engine uses: it waits on the pipe its parent held, where
``os.getppid()`` would by then name the process that adopted it and the watch would never fire."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return True
    return state in ("Z", "X")  # exited, its adopter yet to reap it


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_worker_whose_parent_died_while_it_started_exits(tmp_path, method):
    pid_file = tmp_path / "child.pid"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    subprocess.run([sys.executable, "-m", "tests.runtime.parent_watch_child", method, str(pid_file)], cwd=ROOT,
                   env=env, check=True, timeout=60)
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 20
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    gone = _gone(pid)
    if not gone:
        os.kill(pid, signal.SIGKILL)  # the orphan this test made: ours to end
    assert gone, f"the worker ({method}) outlived its parent"
