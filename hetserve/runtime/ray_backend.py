"""``--backend ray``: the engine's workers as Ray actors, each on the node of the machine the plan names.

Placement uses Ray custom resources, one per machine of the cluster file: the node that hosts
machine ``a0`` advertises ``hetserve_machine_a0``, and the worker of device ``a0:3`` asks for a
sliver of it (plus zero CPUs, so a node's CPU count does not cap its workers). On a real pool
start each node with its machine's resource::

    ray start --address HEAD:6379 --resources '{"hetserve_machine_a0": 1000}'

and pass ``--ray-address``. Without an address, ``RaySession.start`` starts a private one-node
Ray on this machine that advertises every machine of the cluster (tests, demos).

The engine itself is unchanged: it starts worker *processes* through
``mp.get_context("spawn").Process(target=worker_main, args=(cfg,))`` and manages them through
``start / pid / exitcode / join / terminate / kill``. ``RayWorkerProcess`` offers that interface
over an actor running the same ``worker_main``, and ``start_ray_engine`` hands the engine a
spawn context that makes those instead of local processes. Everything else — the transport,
link shaping, the coordinator — is the local backend's.

Limits: the workers' sockets bind 127.0.0.1 (``SocketTransport``'s default host), so a pool that
really spans machines also needs the engine to bind each worker's node address; on one machine
(the tested case) this does not matter.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Any, Callable

RESOURCE_PREFIX = "hetserve_machine_"
_NODE_SHARE = 0.001  # of a machine resource per worker: many workers fit one machine's node


def machine_resource(machine: str) -> str:
    return RESOURCE_PREFIX + machine


class RaySession:
    """A Ray connection for serving: joins ``address`` or starts a private local Ray.

    The local Ray listens on loopback only, keeps its files under ``tmp_dir`` (default
    ``$RAY_TMPDIR`` or a fresh temporary folder) and advertises one custom resource per machine.
    ``close()`` shuts down what this session started.
    """

    def __init__(self, started: bool, tmp_dir: str | None):
        self.started, self.tmp_dir = started, tmp_dir

    @staticmethod
    def start(cluster, address: str | None = None, num_cpus: int = 2, tmp_dir: str | None = None) -> "RaySession":
        import ray

        if ray.is_initialized():
            return RaySession(False, None)
        if address:
            ray.init(address=address, include_dashboard=False, log_to_driver=False)
            return RaySession(True, None)
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        tmp_dir = tmp_dir or os.environ.get("RAY_TMPDIR")
        if tmp_dir is None:
            import tempfile

            tmp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # Ray's socket paths must stay short
        resources = {machine_resource(m): 1000.0 for m in cluster.machines}
        ray.init(num_cpus=num_cpus, resources=resources, include_dashboard=False, _temp_dir=tmp_dir,
                 log_to_driver=False, _node_ip_address="127.0.0.1")
        return RaySession(True, tmp_dir)

    def close(self) -> None:
        if self.started:
            import ray

            ray.shutdown()
            self.started = False


def _actor_class():
    import ray

    @ray.remote(num_cpus=0, max_concurrency=2)
    class WorkerActor:
        """Runs one engine worker (``worker_main``) in its own process; ``pid`` answers meanwhile."""

        def pid(self) -> int:
            return os.getpid()

        def run(self, target: Callable[[Any], None], cfg: Any) -> None:
            target(cfg)  # the worker watches its own parent (here Ray's), see worker_main

    return WorkerActor


class RayWorkerProcess:
    """The subset of ``multiprocessing.Process`` the engine uses, over a Ray actor on ``machine``'s node."""

    def __init__(self, target: Callable[[Any], None], args: tuple, machine: str, name: str = ""):
        self._target, self._args, self.machine, self.name = target, args, machine, name
        self.daemon = True
        self._actor = None
        self._ref = None
        self.pid: int | None = None
        self._exitcode: int | None = None

    def start(self) -> None:
        import ray

        self._actor = _actor_class().options(resources={machine_resource(self.machine): _NODE_SHARE},
                                             name=None, lifetime=None).remote()
        self.pid = ray.get(self._actor.pid.remote(), timeout=120)
        self._ref = self._actor.run.remote(self._target, *self._args)

    @property
    def exitcode(self) -> int | None:
        if self._exitcode is not None or self._ref is None:
            return self._exitcode
        import ray

        ready, _ = ray.wait([self._ref], timeout=0)
        if ready:
            try:
                ray.get(ready[0])
                self._exitcode = 0
            except Exception:  # noqa: BLE001 - the actor died (os._exit) or the worker raised
                self._exitcode = 1
        return self._exitcode

    def join(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.exitcode is None:
            if deadline is not None and time.monotonic() >= deadline:
                return
            time.sleep(0.05)

    def is_alive(self) -> bool:
        return self._ref is not None and self.exitcode is None

    def terminate(self) -> None:
        self.kill()

    def kill(self) -> None:
        if self._actor is None:
            return
        import ray

        with contextlib.suppress(Exception):
            ray.kill(self._actor, no_restart=True)
        if self._exitcode is None:
            self._exitcode = -9


class _RayContext:
    """Stands in for ``mp.get_context("spawn")``: ``Process`` makes ``RayWorkerProcess``es."""

    def __init__(self, machine_of: Callable[[str], str]):
        self.machine_of = machine_of

    def Process(self, target, args=(), name: str = "", daemon: bool = True, **_):  # noqa: N802 - mp's name
        cfg = args[0]
        return RayWorkerProcess(target, args, self.machine_of(cfg.spec.name), name)


class _RayMP:
    def __init__(self, ctx: _RayContext, real):
        self._ctx, self._real = ctx, real

    def get_context(self, method: str | None = None):
        return self._ctx

    def __getattr__(self, name):
        return getattr(self._real, name)


_SWAP_LOCK = threading.Lock()


def start_ray_engine(plan, cluster, model_dir, config=None, **engine_kwargs):
    """``Engine.from_plan`` with every worker a Ray actor on its machine's node (Ray must be initialised,
    e.g. by ``RaySession.start``)."""
    import ray

    from hetserve.errors import RuntimeFailure
    from hetserve.runtime import engine as engine_module
    from hetserve.runtime import worker_group

    if not ray.is_initialized():
        raise RuntimeFailure("the Ray backend needs a Ray session (RaySession.start) before the engine starts")
    machines = {d.name: d.machine for d in cluster.devices}
    missing = sorted({machine_resource(m) for m in cluster.machines} - set(ray.cluster_resources()))
    if missing:
        raise RuntimeFailure("no Ray node advertises " + ", ".join(missing) + "; start each machine's node with "
                             "`ray start --resources '{\"" + missing[0] + "\": 1000}'`")
    ctx = _RayContext(lambda device: machines[device])
    # The engine's spawn context is its only process-creation point; swap it for the duration of start-up.
    with _SWAP_LOCK:
        real = worker_group.mp
        worker_group.mp = _RayMP(ctx, real)
        try:
            return engine_module.Engine.from_plan(plan, cluster, model_dir, config, **engine_kwargs)
        finally:
            worker_group.mp = real
