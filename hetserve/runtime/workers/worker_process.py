"""The process around a ``Worker``: its entry point, its heartbeat and what ends it.

``worker_main`` is what the engine starts (a ``multiprocessing`` spawn or forkserver target, or a
Ray actor's method): it sets the process up, runs the ``Worker`` (worker.py) until it is told to
shut down, and reports any exception to the coordinator as ``error`` before exiting. Beside it, a
heartbeat thread tells the coordinator this process is alive, and a watch thread ends it once its
parent is gone.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import traceback

import torch

from hetserve.errors import RuntimeFailure
from hetserve.runtime.links.reports import link_report
from hetserve.runtime.workers.host_memory import keep_freed_memory
from hetserve.runtime.workers.transport import Priority, SocketTransport
from hetserve.runtime.workers.wire import ENGINE, Message
from hetserve.runtime.workers.worker import Worker, WorkerConfig

log = logging.getLogger("hetserve.runtime.workers.worker_process")


def worker_main(cfg: WorkerConfig) -> None:
    """Process entry point (``torch.multiprocessing`` spawn target)."""
    _leave_stop_signals_to_the_engine()
    torch.set_num_threads(max(1, cfg.threads))
    keep_freed_memory()
    try:
        transport = SocketTransport(cfg.spec.name, cfg.security, host=cfg.host, scheduler_factory=cfg.link_scheduler,
                                    shaper=cfg.shaper, ports=cfg.port_range)
    except RuntimeFailure as exc:  # no port to listen on (--port-range): the engine hears why, in one line
        _report_and_exit(cfg, str(exc))
    transport.set_address(ENGINE, cfg.engine_address)
    threading.Thread(target=watch_parent, daemon=True).start()
    try:
        worker = Worker(cfg, transport)
        if cfg.heartbeat_s > 0:
            threading.Thread(target=_heartbeat, args=(transport, cfg.spec.name, cfg.heartbeat_s, worker,
                                                      cfg.link_scheduler), daemon=True).start()
        worker.run()
    except BaseException:  # noqa: BLE001 - everything is reported, then the process ends
        transport.send(ENGINE, Message("error", {"worker": cfg.spec.name, "error": traceback.format_exc()}))
        transport.flush(5.0)
        os._exit(1)
    transport.flush(5.0)
    # skip interpreter teardown: gloo's and torch's static destructors can abort or stall here
    os._exit(0)


def _report_and_exit(cfg: WorkerConfig, error: str) -> None:
    """Tell the engine ``error`` from an endpoint that only sends, and end the process."""
    try:
        transport = SocketTransport(cfg.spec.name, cfg.security, host=cfg.host, listen=False)
        transport.set_address(ENGINE, cfg.engine_address)
        transport.send(ENGINE, Message("error", {"worker": cfg.spec.name, "error": error}))
        transport.flush(5.0)
    finally:
        os._exit(1)


def _heartbeat(transport: SocketTransport, name: str, every_s: float, worker: "Worker | None" = None,
               link_scheduler=None) -> None:
    """Tell the coordinator this process is alive. On its own thread, so a long step does not silence
    it; a frozen (SIGSTOPped) or wedged process stops beating and the coordinator declares it dead.
    Each beat carries the connections this worker's endpoint refused so far (reason -> count) and,
    with device channels, which path its transfers took (``DeviceChannel.stats``) and the KV pieces
    it dropped as already received (``kv_duplicates``, where any), and the pieces of abandoned
    hand-offs it dropped (``kv_fenced``, where any). Beside each beat goes this process's link
    counters (``links``, runtime/links/reports.py), once it has sent anything through the links; a
    report that cannot be built is left out (logged the first time) and the beats go on."""
    report_failed = False
    while not transport.closed:
        meta = {"worker": name, "rejected": dict(transport.rejected)}
        if worker is not None and worker.kv.fenced:
            meta["kv_fenced"] = worker.kv.fenced
        if worker is not None and worker.channel is not None:
            meta["channel"] = worker.channel.stats()
            if worker.kv.duplicates:
                meta["channel"]["kv_duplicates"] = worker.kv.duplicates
        try:
            transport.send(ENGINE, Message("heartbeat", meta), Priority.CONTROL)
        except ConnectionError:
            return
        # the link report is extra: whatever building it raises, the next beat still goes out
        try:
            report = link_report(link_scheduler, os.getpid())
            if report is not None:
                transport.send(ENGINE, report, Priority.CONTROL)
        except ConnectionError:
            return
        except Exception as exc:  # noqa: BLE001 - a link scheduler hook's own failure
            if not report_failed:
                report_failed = True
                log.warning("%s: its link report failed (%s: %s); heartbeats go on without it, later "
                            "failures are not logged", name, type(exc).__name__, exc, exc_info=True)
        time.sleep(every_s)


def _leave_stop_signals_to_the_engine() -> None:
    """Ignore SIGINT and SIGTERM. A stop signal sent to the server's whole process group (Ctrl-C in
    its terminal, ``kill -- -PGID``, a service manager stopping its cgroup) is the server's to act
    on: it drains its requests, then ends its workers with a shutdown message (SIGKILL for a
    straggler). A worker that died of the signal would fail the very requests being drained.
    Only the main thread may set handlers (a Ray actor's method may run on another)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def watch_parent() -> None:
    """Exit once the process that started this one is gone (so a killed engine leaves no worker
    behind): the engine (spawn), the fork server (forkserver, which exits with the engine) or Ray's
    worker process (ray backend). A multiprocessing child waits on the pipe its parent holds open for
    it (``parent_process().join()``: the parent's end closes when it dies), which also sees a parent
    that died while this process was still importing; ``os.getppid()`` would by then name whoever
    adopted it, and the watch would never see the parent go."""
    import multiprocessing

    parent = multiprocessing.parent_process()
    if parent is not None and parent.sentinel is not None:
        parent.join()
        os._exit(3)
    start = os.getppid()
    while True:
        time.sleep(0.5)
        if os.getppid() != start:
            os._exit(3)
