"""``WorkerGroup``: the engine's worker processes — start them, wait for them, notice exits, end them.

One process per device of the plan (``worker.py``). Start-up is two rounds over the transport: every
worker loads its shard and answers ``ready`` with its address, then gets the address book of all
endpoints and answers ``peers_ack``. A worker that exits or reports an error during start-up turns
into one ``RuntimeFailure`` naming it (replica, stage, TP rank) and its last error line.

``mp`` is the process-creation point: ``ray_backend`` swaps it for Ray actors during start-up.
"""

from __future__ import annotations

import time
from typing import Any

import torch.multiprocessing as mp

from hetserve.errors import RuntimeFailure
from hetserve.runtime.layout import ReplicaSpec
from hetserve.runtime.rendezvous import BoundStore
from hetserve.runtime.transport import Message, Priority, SocketTransport
from hetserve.runtime.worker import ENGINE, WorkerConfig, worker_main


class WorkerGroup:
    def __init__(self, layout: tuple[ReplicaSpec, ...], transport: SocketTransport, start_timeout_s: float):
        self.layout = layout
        self.transport = transport
        self.start_timeout_s = start_timeout_s
        self.procs: dict[str, Any] = {}
        self.pids: dict[str, int] = {}
        self.worker_errors: dict[str, str] = {}
        self.dead: set[str] = set()
        self._store = None

    def start(self, make_config, start_method: str) -> None:
        """Start one process per worker (``make_config(spec, store_address, backend) -> WorkerConfig``)
        and wait until every one has loaded its shard and connected to its peers."""
        workers = [w for r in self.layout for w in r.workers]
        store_address = None
        if any(w.tp_world > 1 for w in workers):
            # on the engine's own address: every worker's node reaches it there, and nothing else listens
            self._store = BoundStore(self.transport.address[0])
            store_address = self._store.address
        ctx = mp.get_context(start_method)
        if start_method == "forkserver":
            ctx.set_forkserver_preload(["hetserve.runtime.worker"])
        replicas = {r.id: r for r in self.layout}
        for w in workers:
            stage = replicas[w.replica].stages[w.stage]
            gpus = [(s.name.rpartition(":")[0], s.device) for s in stage]  # (machine, device): cuda:0 on two boxes
            # NCCL needs one GPU per rank; ranks sharing a GPU (more workers than GPUs) use gloo
            backend = "nccl" if gpus[0][1].startswith("cuda") and len(set(gpus)) == len(gpus) else "gloo"
            cfg: WorkerConfig = make_config(w, store_address, backend)
            p = ctx.Process(target=worker_main, args=(cfg,), name=f"hetserve-worker-{w.name}", daemon=True)
            p.start()
            self.procs[w.name] = p
            self.pids[w.name] = p.pid
        addresses = self._await_all("ready", "load its shard")
        book = {name: m["address"] for name, m in addresses.items()}
        book[ENGINE] = self.transport.address
        for name, addr in book.items():
            if name != ENGINE:
                self.transport.set_address(name, addr)
        for name in self.procs:
            self.transport.send(name, Message("peers", {"addresses": book}), Priority.CONTROL)
        self._await_all("peers_ack", "connect to its peers")

    def _await_all(self, kind: str, what: str) -> dict[str, dict]:
        got: dict[str, dict] = {}
        deadline = time.monotonic() + self.start_timeout_s
        while len(got) < len(self.procs):
            msg = self.transport.recv(timeout=0.05)
            if msg is not None:
                if msg.kind == kind:
                    got[msg.meta["worker"]] = msg.meta
                elif msg.kind == "error":
                    raise self._startup_failure(msg.meta["worker"], what, msg.meta["error"])
            for name, p in self.procs.items():
                if p.exitcode is not None:
                    err = self._drain_error(name)
                    raise self._startup_failure(name, what, err, p.exitcode)
            if time.monotonic() > deadline:
                missing = sorted(set(self.procs) - set(got))
                raise RuntimeFailure(f"workers {missing} did not {what} within {self.start_timeout_s:.0f} s")
        return got

    def _drain_error(self, name: str, wait: float = 1.0) -> str | None:
        """The error a worker reported just before exiting, if it did (waits briefly for it)."""
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            msg = self.transport.recv(timeout=0.05)
            if msg is not None and msg.kind == "error":
                self.worker_errors[msg.meta["worker"]] = msg.meta["error"]
            if name in self.worker_errors:
                break
        return self.worker_errors.get(name)

    def _startup_failure(self, name: str, what: str, error: str | None, code: int | None = None) -> RuntimeFailure:
        w = self.worker(name)
        where = f"worker {name} (replica {w.replica}, stage {w.stage}, TP rank {w.tp_rank})"
        detail = last_line(error) if error else f"exited with code {code}"
        exc = RuntimeFailure(f"{where} failed to {what}: {detail}")
        if error:
            exc.add_note(error)
        return exc

    def worker(self, name: str):
        return next(w for r in self.layout for w in r.workers if w.name == name)

    def exited(self) -> list[tuple[str, int]]:
        """(name, exit code) of each worker that exited and is not yet known dead."""
        return [(name, p.exitcode) for name, p in self.procs.items()
                if name not in self.dead and p.exitcode is not None]

    def exit_reason(self, name: str, code: int) -> str:
        """How worker ``name`` ended, for error messages: its exit code, and why where the process
        stand-in knows (a Ray worker whose node left the cluster)."""
        cause = getattr(self.procs[name], "cause", None)
        return f"died with exit code {code}" + (f" ({cause})" if cause else "")

    def stop_replica(self, replica: ReplicaSpec) -> None:
        """Mark every worker of ``replica`` dead and kill those still running (a replica cannot work
        with a worker missing)."""
        for w in replica.workers:
            self.dead.add(w.name)
            if self.procs[w.name].exitcode is None:
                self.procs[w.name].kill()

    def send_shutdown(self) -> None:
        """Ask every live replica's stages to exit (each stage's first rank tells its TP peers)."""
        for r in self.layout:
            if any(w.name in self.dead for w in r.workers):
                continue
            for stage in r.stages:
                try:
                    self.transport.send(stage[0].name, Message("shutdown"), Priority.CONTROL)
                except ConnectionError:
                    pass

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for p in self.procs.values():
            p.join(timeout=max(0.0, deadline - time.monotonic()))

    def kill_all(self) -> None:
        kill_processes(self.procs)

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None


def kill_processes(procs: dict[str, Any]) -> None:
    for p in procs.values():
        if p.exitcode is None:
            p.terminate()
    deadline = time.monotonic() + 3.0
    for p in procs.values():
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs.values():
        if p.exitcode is None:
            p.kill()
            p.join(timeout=2.0)


def last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else text
