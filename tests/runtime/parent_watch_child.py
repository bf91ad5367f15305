"""The processes of ``test_worker_parent_watch``: a parent that starts a worker-like child with
multiprocessing and exits at once, and the child, which is still "importing" when its parent goes."""

import multiprocessing
import os
import sys
import time


def child(pid_file: str) -> None:
    # written whole, then renamed into place: the parent and the test see no file or the whole pid
    with open(pid_file + ".part", "w") as f:
        f.write(str(os.getpid()))
    os.replace(pid_file + ".part", pid_file)
    time.sleep(1.0)  # the window a worker spends importing torch: its parent is gone by its end
    from hetserve.runtime.workers.worker_process import watch_parent

    watch_parent()  # exits the process once it sees its parent gone


if __name__ == "__main__":
    method, pid_file = sys.argv[1], sys.argv[2]
    multiprocessing.get_context(method).Process(target=child, args=(pid_file,)).start()
    while not os.path.exists(pid_file):
        time.sleep(0.01)
    os._exit(0)  # at once: no atexit join of the child, as a SIGKILLed engine
