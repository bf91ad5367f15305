"""``WorkerGroup``: the engine's worker processes — start them, wait for them, notice exits, end them.

One process per device of the plan (``worker.py``). Start-up is two rounds over the transport: every
worker loads its shard and answers ``ready`` with its address, then gets the address book of all
endpoints and answers ``peers_ack``. A worker that exits or reports an error during start-up turns
into one ``WorkerStartFailure`` naming it (replica, stage, TP rank) and its last error line.

``mp`` is the process-creation point: ``ray_backend`` swaps it for Ray actors during start-up.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Any

import torch.multiprocessing as mp

from hetserve.errors import WorkerStartFailure
from hetserve.runtime.layout import ReplicaSpec
from hetserve.runtime.workers.channel_pairs import channel_pairs
from hetserve.runtime.workers.rendezvous import BoundStore, needs_store
from hetserve.runtime.workers.transport import Priority, SocketTransport
from hetserve.runtime.workers.wire import ENGINE, Message
from hetserve.specs.cluster import machine_of
from hetserve.runtime.workers.worker import WorkerConfig
from hetserve.runtime.workers.worker_process import worker_main


class WorkerGroup:
    def __init__(self, layout: tuple[ReplicaSpec, ...], transport: SocketTransport, start_timeout_s: float,
                 device_channel: str = "off", port_range=None):
        # which worker pairs share a device channel (device_channel.py): "auto" those of GPUs (NCCL,
        # CUDA IPC), "on" CPU pairs too (gloo), "off" none; EngineConfig.device_channel says which
        self.device_channel = device_channel
        self.port_range = port_range  # rendezvous.PortRange the TP store's port comes from; None: the OS picks
        self.layout = layout
        self.transport = transport
        self.start_timeout_s = start_timeout_s
        self.procs: dict[str, Any] = {}
        self.pids: dict[str, int] = {}
        self.worker_errors: dict[str, str] = {}
        self.dead: set[str] = set()
        self._unreaped: set[str] = set()  # dead workers killed but not yet waited for (zombies until reaped)
        self.addresses: dict[str, Any] = {}  # worker name -> its transport address
        self.loads: dict[str, dict] = {}  # worker name -> its start-up (model.loader.LoadReport.as_dict)
        self._store = None
        self._rounds = itertools.count()  # start-up rounds: each one's channel groups have their own keys

    def start(self, make_config, start_method: str) -> None:
        """Start one process per worker (``make_config(spec, store_address, backend) -> WorkerConfig``)
        and wait until every one has loaded its shard and connected to its peers."""
        procs = self._spawn(self.layout, make_config, start_method)
        self.procs.update(procs)
        self.pids.update({n: p.pid for n, p in procs.items()})
        book = self._await_all("ready", "load its shard and capture its graphs", procs, self.transport.recv)
        self.addresses = {name: m["address"] for name, m in book.items()}
        self.loads.update({name: m["load"] for name, m in book.items() if "load" in m})
        self._connect(procs, self.addresses, None, self.transport.recv)

    def start_more(self, replicas: tuple[ReplicaSpec, ...], layout: tuple[ReplicaSpec, ...], make_config,
                   start_method: str, recv) -> dict[str, Any]:
        """Start the workers of ``replicas`` while the engine serves (elastic re-plan); returns their
        processes once loaded and connected. ``recv`` yields the start-up messages the coordinator
        forwards; the running workers get the new addresses and ``layout`` (hand-offs to new replicas).
        The caller adds the processes to the group (on the coordinator's thread)."""
        procs = self._spawn(replicas, make_config, start_method)
        try:
            got = self._await_all("ready", "load its shard and capture its graphs", procs, recv, replicas)
            fresh = {name: m["address"] for name, m in got.items()}
            self.loads.update({name: m["load"] for name, m in got.items() if "load" in m})
            for name, addr in fresh.items():
                self.transport.set_address(name, addr)
            running = [n for n in self.procs if n not in self.dead and n not in procs and self.procs[n].exitcode is None]
            update = Message("peers", {"addresses": fresh, "layout": layout})
            for name in running:
                self.transport.send(name, update, Priority.CONTROL)
            self._connect(procs, {**{n: self.addresses[n] for n in running if n in self.addresses}, **fresh},
                          layout, recv, replicas)
            self.addresses.update(fresh)
        except BaseException:
            kill_processes(procs)
            raise
        return procs

    def _spawn(self, replicas, make_config, start_method: str) -> dict[str, Any]:
        workers = [w for r in replicas for w in r.workers]
        pairs = self._channels(replicas)
        store_address = None
        if needs_store((w.tp_world for w in workers), bool(pairs)):
            # on the engine's own address: every worker's node reaches it there, and nothing else listens
            if self._store is None:  # a re-plan's new TP groups share it
                self._store = BoundStore(self.transport.address[0], self.port_range)
            store_address = self._store.address
        ctx = mp.get_context(start_method)
        if start_method == "forkserver":
            # what every worker imports, once in the server: torch, and the loader a CPU worker's C++
            # kernels go through (torch.utils.cpp_extension, which imports setuptools: 0.1 s a worker)
            ctx.set_forkserver_preload(["hetserve.runtime.workers.worker_process", "torch.utils.cpp_extension"])
        by_id = {r.id: r for r in replicas}
        procs: dict[str, Any] = {}
        for w in workers:
            stage = by_id[w.replica].stages[w.stage]
            gpus = [(machine_of(s.name), s.device) for s in stage]  # (machine, device): cuda:0 on two boxes
            # NCCL needs one GPU per rank; ranks sharing a GPU (more workers than GPUs) use gloo
            backend = "nccl" if gpus[0][1].startswith("cuda") and len(set(gpus)) == len(gpus) else "gloo"
            cfg: WorkerConfig = make_config(w, store_address, backend)
            if cfg.shaper is None and cfg.link_scheduler is None:  # emulated links stay on the sockets
                cfg = dataclasses.replace(cfg, channels=pairs.get(w.name, ()))
            p = ctx.Process(target=worker_main, args=(cfg,), name=f"hetserve-worker-{w.name}", daemon=True)
            p.start()
            procs[w.name] = p
        return procs

    def _channels(self, replicas) -> dict:
        """Device channels among the workers started together (a re-plan's new workers reach the
        running ones by socket: those never join a new group)."""
        if self.device_channel == "off":
            return {}
        kinds = ("gloo", "nccl", "ipc") if self.device_channel == "on" else ("nccl", "ipc")
        pairs = channel_pairs(replicas, tag=str(next(self._rounds)))
        pairs = {n: tuple(p for p in ps if p.kind in kinds) for n, ps in pairs.items()}
        return {n: ps for n, ps in pairs.items() if ps}

    def _connect(self, procs, addresses: dict[str, Any], layout, recv, among=None) -> None:
        book = {**addresses, ENGINE: self.transport.address}
        for name, addr in book.items():
            if name != ENGINE:
                self.transport.set_address(name, addr)
        meta = {"addresses": book} if layout is None else {"addresses": book, "layout": layout}
        for name in procs:
            self.transport.send(name, Message("peers", meta), Priority.CONTROL)
        self._await_all("peers_ack", "connect to its peers", procs, recv, among)

    def _await_all(self, kind: str, what: str, procs: dict[str, Any], recv, among=None) -> dict[str, dict]:
        """Each of ``procs``' ``kind`` message; a worker's error or exit meanwhile is a WorkerStartFailure
        naming it, looked up among ``among`` (a re-plan's new replicas, not yet in the layout) or the layout."""
        got: dict[str, dict] = {}
        deadline = time.monotonic() + self.start_timeout_s
        while len(got) < len(procs):
            msg = recv(timeout=0.05)
            if msg is not None and msg.meta.get("worker") in procs:
                if msg.kind == kind:
                    got[msg.meta["worker"]] = msg.meta
                elif msg.kind == "error":
                    raise self._startup_failure(msg.meta["worker"], what, msg.meta["error"], among=among)
            for name, p in procs.items():
                if p.exitcode is not None:
                    err = self._drain_error(name, recv=recv)
                    raise self._startup_failure(name, what, err, p.exitcode, among)
            if time.monotonic() > deadline:
                missing = ", ".join(sorted(set(procs) - set(got)))
                raise WorkerStartFailure(f"worker(s) {missing}: did not {what} within {self.start_timeout_s:.0f} s "
                                         f"(EngineConfig.start_timeout_s); a machine busy with other work, or a "
                                         f"model too big for the host's memory, can take longer",
                                         tuple(sorted(set(procs) - set(got))))
        return got

    def _drain_error(self, name: str, wait: float = 1.0, recv=None) -> str | None:
        """The error a worker reported just before exiting, if it did (waits briefly for it)."""
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            msg = (recv or self.transport.recv)(timeout=0.05)
            if msg is not None and msg.kind == "error":
                self.worker_errors[msg.meta["worker"]] = msg.meta["error"]
            if name in self.worker_errors:
                break
        return self.worker_errors.get(name)

    def _startup_failure(self, name: str, what: str, error: str | None, code: int | None = None,
                         among=None) -> WorkerStartFailure:
        """One line naming the worker and what failed. A worker's failure while it works (loading its
        shard, connecting) arrives as a Python traceback, and is worded as a failure to do ``what``.
        A report without a traceback is the worker's own account of why it could not start before
        any of that began (``worker_process`` sends one when its endpoint cannot listen, e.g. no
        free port left in --port-range): it already says what failed, and is given as it is."""
        w = self.worker(name, among)
        where = f"worker {name} (replica {w.replica}, stage {w.stage}, TP rank {w.tp_rank})"
        if error and not error.lstrip().startswith(TRACEBACK):
            return WorkerStartFailure(f"{where} could not start: " + " ".join(error.split()), (name,))
        detail = last_line(error) if error else f"exited with code {code}"
        exc = WorkerStartFailure(f"{where} failed to {what}: {detail}", (name,))
        if error:
            exc.add_note(error)
        return exc

    def worker(self, name: str, among=None):
        """The spec of worker ``name``, among ``among``'s replicas when given, else the layout's."""
        return next(w for r in (among or self.layout) for w in r.workers if w.name == name)

    def forget(self, replica: ReplicaSpec) -> None:
        """Drop a retired replica's (killed) workers, so their devices can host a re-planned replica."""
        for w in replica.workers:
            p = self.procs.pop(w.name, None)
            if p is not None and p.exitcode is None:
                p.kill()
                p.join(timeout=2.0)
            self.pids.pop(w.name, None)
            self.dead.discard(w.name)
            self._unreaped.discard(w.name)
            self.addresses.pop(w.name, None)
            self.worker_errors.pop(w.name, None)

    def add(self, procs: dict[str, Any], layout: tuple[ReplicaSpec, ...]) -> None:
        """Take over processes from ``start_more`` and the layout they are part of."""
        self.layout = layout
        self.procs.update(procs)
        self.pids.update({n: p.pid for n, p in procs.items()})

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
                self._unreaped.add(w.name)  # SIGKILL is not instant: reaped by a later ``reap``
        self.reap()

    def reap(self) -> None:
        """Wait for the dead workers that were killed, without blocking, so none lingers as a zombie
        process until shutdown (``exited`` skips the dead, so nothing else would poll them). Reading
        ``exitcode`` polls the process (waitpid with WNOHANG) and collects its status once it is gone."""
        for name in list(self._unreaped):
            if self.procs[name].exitcode is not None:
                self._unreaped.discard(name)

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
        self._rounds = itertools.count()  # start-up rounds: each one's channel groups have their own keys


def kill_processes(procs: dict[str, Any]) -> None:
    """SIGKILL every worker process still running (workers ignore SIGTERM: ``worker.py``), and reap it."""
    for p in procs.values():
        if p.exitcode is None:
            p.kill()
    for p in procs.values():
        p.join(timeout=2.0)


TRACEBACK = "Traceback (most recent call last):"  # how traceback.format_exc() begins


def last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else text
