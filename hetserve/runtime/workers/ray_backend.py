"""``--backend ray``: the engine's workers as Ray actors, each on the node of the machine the plan names.

Placement uses Ray custom resources, one per machine of the cluster file: the node that hosts
machine ``a0`` advertises ``hetserve_machine_a0``, and the worker of device ``a0:3`` asks for a
sliver of it (plus zero CPUs, so a node's CPU count does not cap its workers). On a real pool
start each node with its machine's resource (``docs/multinode.md`` walks through it)::

    ray start --address HEAD:6379 --node-ip-address 10.0.0.6 --resources '{"hetserve_machine_a0": 1000}'

and pass ``--ray-address``. Without an address, ``RaySession.start`` starts a private one-node
Ray on this machine that advertises every machine of the cluster (tests, demos). That Ray is a node
on 127.0.0.1, and so are hetserve's own listeners with it (see ``RaySession``).

Addresses: each worker binds and advertises its own node's address — the cluster file's
``address`` for its machine if it gives one, else the IP Ray knows the node by — for its endpoint
and its gloo device (``rendezvous.py``). The engine (the driver) binds its endpoint and the TP
rendezvous store to ``EngineConfig.host``; left unset, that is the driver's own Ray node IP (with a
private Ray: 127.0.0.1, the address it was started on, and every worker binds that too). Ports
come from ``EngineConfig.port_range`` where it is set (each worker takes the first free one on its
own node; the worker's config carries the range), else the OS picks them. A worker on a GPU node
asks Ray for one GPU (``num_gpus=1``) and uses the one Ray gives it; CPU worker slots ask for none.

The engine itself is unchanged: it starts worker *processes* through
``mp.get_context("spawn").Process(target=worker_main, args=(cfg,))`` and manages them through
``start / pid / exitcode / join / terminate / kill``. ``RayWorkerProcess`` offers that interface
over an actor running the same ``worker_main``, and ``start_ray_engine`` hands the engine a
spawn context that makes those instead of local processes. Everything else — the transport,
link shaping, the coordinator — is the local backend's.

Ray runs with token authentication unless the environment says otherwise (``ray_session.ray_auth_env``):
whoever reaches an unauthenticated Ray's ports can run code on every node. A private Ray gets a
fresh token of its own; joining a pool, the driver uses the token its nodes were started with
(``RAY_AUTH_TOKEN`` / ``RAY_AUTH_TOKEN_PATH``, ``docs/multinode.md``). Only tests set
``RAY_AUTH_MODE=disabled``.

A node that leaves (its raylet dies, the machine goes away) is a worker exit like any other: the
worker process ends with its raylet (it watches its parent), Ray marks the node's actors dead once
its health checks fail, ``exitcode`` turns non-zero with ``cause`` naming the machine whose node
left (or stopped answering, when Ray cannot reach the actor before that), and the engine's
worker-failure path takes over.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import threading
import time
from typing import Any, Callable

from hetserve.runtime.workers.ray_session import RaySession, machine_resource

_NODE_SHARE = 0.001  # of a machine resource per worker: many workers fit one machine's node


def _actor_class():
    import ray

    @ray.remote(num_cpus=0, max_concurrency=2)
    class WorkerActor:
        """Runs one engine worker (``worker_main``) in its own process; ``where`` answers meanwhile."""

        def where(self, address: str | None) -> tuple[int, str]:
            """(pid, the address the worker will bind): ``address`` if given, else this node's IP."""
            return os.getpid(), address or ray.util.get_node_ip_address()

        def run(self, target: Callable[[Any], None], cfg: Any, host: str) -> int:
            """The worker's exit code. A planned stop is no death for Ray to report: the worker's
            closing ``os._exit`` returns here, and the driver then ends the idle actor (``ray.kill``)."""
            spec = cfg.spec
            if spec.device.startswith("cuda"):  # Ray made only the GPU it granted visible: cuda:0 here
                spec = dataclasses.replace(spec, device="cuda:0")
            # the worker watches its own parent (here the node's raylet): worker_process.watch_parent
            return _exit_code_of(target, dataclasses.replace(cfg, host=host, spec=spec))

    return WorkerActor


class _Exited(BaseException):
    """``os._exit(code)`` called on the thread running the worker inside an actor (``args[0]``: code)."""


def _exit_code_of(target: Callable[[Any], None], cfg: Any) -> int:
    """Run ``target(cfg)`` and return the code it ends the process with (0 if it returns).

    ``os._exit`` on this thread returns here instead of ending the actor's process mid-task (which
    Ray reports as a death); on any other thread (the worker's parent watch) it still ends the
    process at once. The actor's process runs this one worker and nothing else."""
    real_exit, runner = os._exit, threading.get_ident()

    def exit_(code: int) -> None:
        if threading.get_ident() == runner:
            raise _Exited(code)
        real_exit(code)

    os._exit = exit_
    try:
        target(cfg)
        return 0
    except _Exited as done:
        return done.args[0]
    finally:
        os._exit = real_exit


class RayWorkerProcess:
    """The subset of ``multiprocessing.Process`` the engine uses, over a Ray actor on ``machine``'s node.

    ``address``: what the worker binds (the cluster file's address for the machine); None: the
    node's IP. After ``start``, ``host`` is the address it binds. ``cause`` says why it ended when
    Ray knows (e.g. its node died).
    """

    def __init__(self, target: Callable[[Any], None], args: tuple, machine: str, name: str = "",
                 address: str | None = None):
        self._target, self._args, self.machine, self.name = target, args, machine, name
        self.address = address
        self.daemon = True
        self._actor = None
        self._ref = None
        self.pid: int | None = None
        self.host: str | None = None
        self.cause: str | None = None
        self._exitcode: int | None = None

    def start(self) -> None:
        import ray

        cfg = self._args[0]
        gpus = 1 if cfg.spec.device.startswith("cuda") else 0
        self._actor = _actor_class().options(resources={machine_resource(self.machine): _NODE_SHARE},
                                             num_gpus=gpus, name=None, lifetime=None).remote()
        self.pid, self.host = ray.get(self._actor.where.remote(self.address), timeout=120)
        self._ref = self._actor.run.remote(self._target, cfg, self.host)

    @property
    def exitcode(self) -> int | None:
        if self._exitcode is not None or self._ref is None:
            return self._exitcode
        import ray

        ready, _ = ray.wait([self._ref], timeout=0)
        if ready:
            try:
                self._exitcode = ray.get(ready[0])
            except Exception as exc:  # noqa: BLE001 - the actor died (its node left, its parent went) or raised
                self.cause = _death_cause(exc, self.machine, self.host)
                self._exitcode = 1
            self._end_actor()  # the worker is done: its process ends now, a planned end Ray does not report
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
        self._end_actor()
        if self._exitcode is None:
            self._exitcode = -9

    def _end_actor(self) -> None:
        """End the actor's process (no interpreter teardown, as the worker's own ``os._exit``)."""
        import ray

        actor, self._actor = self._actor, None
        if actor is not None:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)


# Ray's words for a node that died ("its node has died", "node 5e1f died", "node ... was marked
# dead"), not for an actor whose worker process died on a live node (its text names "Node ID" too)
_NODE_DIED = re.compile(r"\bnode\b(?:\s+\S+)?\s+(?:has\s+died|died|is\s+dead|was\s+marked\s+dead)")


def _death_cause(exc: BaseException, machine: str, host: str | None = None) -> str:
    """One line: why Ray says the actor ended, naming the machine (and the address its worker bound).

    A node Ray declared dead is said to have left the cluster. An actor Ray cannot reach
    (``ActorUnavailableError``: its connection closed, e.g. gRPC's UNAVAILABLE, code 14) is what a
    node that just left looks like before its health checks fail, or a network that dropped: the
    node is said to have stopped answering. Ray's own text follows, cut at a word, never mid-word."""
    node = f"the Ray node of machine {machine}" + (f" at {host}" if host else "")
    # Ray's field lines ("\tclass_name: ...", "\tactor_id: ...") are left out: the rest says why
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip() and not ln.startswith("\t")]
    text = " ".join(lines)
    if _NODE_DIED.search(text.lower()):
        return f"{node} left the cluster (Ray: {_clip(text)})"
    if type(exc).__name__ == "ActorUnavailableError":
        return f"{node} stopped answering: it left the cluster or the network to it dropped (Ray: {_clip(text)})"
    return f"on machine {machine}: {_clip(text) or type(exc).__name__}"


def _clip(text: str, limit: int = 240) -> str:
    """``text`` up to ``limit`` characters, cut after a whole word ("..." marks the cut)."""
    if len(text) <= limit:
        return text
    return text[:limit].rsplit(" ", 1)[0].rstrip(" ,;:") + " ..."


class _RayContext:
    """Stands in for ``mp.get_context("spawn")``: ``Process`` makes ``RayWorkerProcess``es."""

    def __init__(self, machine_of: Callable[[str], str], addresses: dict[str, str]):
        self.machine_of, self.addresses = machine_of, addresses

    def Process(self, target, args=(), name: str = "", daemon: bool = True, **_):  # noqa: N802 - mp's name
        machine = self.machine_of(args[0].spec.name)
        return RayWorkerProcess(target, args, machine, name, address=self.addresses.get(machine))

    def set_forkserver_preload(self, module_names) -> None:
        """Nothing to preload: Ray starts the worker processes, whatever the start method."""


class _RayMP:
    def __init__(self, ctx: _RayContext, real):
        self._ctx, self._real = ctx, real

    def get_context(self, method: str | None = None):
        return self._ctx

    def __getattr__(self, name):
        return getattr(self._real, name)


_SWAP_LOCK = threading.Lock()


def start_ray_engine(plan, cluster, model_dir, config=None, *, machine_addresses: dict[str, str] | None = None,
                     **engine_kwargs):
    """``Engine.from_plan`` with every worker a Ray actor on its machine's node (Ray must be initialised,
    e.g. by ``RaySession.start``). ``config.host`` unset: the engine listens on this driver's Ray node IP.
    ``machine_addresses`` (default: the cluster file's) are what each machine's workers bind; a machine
    without one binds its Ray node's IP. With a private Ray (``RaySession.start`` without an address)
    every worker binds 127.0.0.1, whatever they say."""
    import ray

    from hetserve.errors import RuntimeFailure
    from hetserve.runtime import engine as engine_module
    from hetserve.runtime.workers import worker_group
    from hetserve.runtime.engine_config import EngineConfig

    if not ray.is_initialized():
        raise RuntimeFailure("the Ray backend needs a Ray session (RaySession.start) before the engine starts")
    machines = {d.name: d.machine for d in cluster.devices}
    missing = sorted({machine_resource(m) for m in cluster.machines} - set(ray.cluster_resources()))
    if missing:
        raise RuntimeFailure("no Ray node advertises " + ", ".join(missing) + "; start each machine's node with "
                             "`ray start --resources '{\"" + missing[0] + "\": 1000}'`")
    nodes = ray.nodes()
    private_ip = RaySession.private_ip()
    if private_ip is not None:  # one node on this machine hosts every machine: all bind its address
        addresses = {m: private_ip for m in cluster.machines}
    else:
        addresses = dict(cluster.machine_addresses if machine_addresses is None else machine_addresses)
        _check_addresses(cluster.name, addresses, nodes)
    config = config or EngineConfig()
    engine_kwargs.setdefault("devices", _devices(cluster, config.device, nodes))
    if config.host is None:
        config = dataclasses.replace(config, host=RaySession.node_ip())
    ctx = _RayContext(lambda device: machines[device], addresses)
    # The engine's spawn context is its only process-creation point; swap it for the duration of start-up.
    with _SWAP_LOCK:
        real = worker_group.mp
        worker_group.mp = _RayMP(ctx, real)
        try:
            return engine_module.Engine.from_plan(plan, cluster, model_dir, config, **engine_kwargs)
        finally:
            worker_group.mp = real


def _devices(cluster, device: str, nodes: list[dict]) -> dict[str, str]:
    """Each device's torch device, from its machine's Ray node: ``cuda:<index on the machine>`` where the
    node has GPUs (Ray then grants the worker one, ``num_gpus=1``), ``cpu`` for CPU worker slots."""
    from hetserve.errors import RuntimeFailure
    from hetserve.specs.cluster import gpu_index

    gpu_machines = {m for m in cluster.machines
                    if any(n.get("Alive") and machine_resource(m) in n.get("Resources", {})
                           and n["Resources"].get("GPU", 0) > 0 for n in nodes)}
    if device == "cuda" and set(cluster.machines) - gpu_machines:
        raise RuntimeFailure("device='cuda' requested but the Ray nodes of machines "
                             f"{sorted(set(cluster.machines) - gpu_machines)} advertise no GPU")
    use = gpu_machines if device != "cpu" else set()
    return {d.name: f"cuda:{gpu_index(d.name)}" if d.machine in use else "cpu" for d in cluster.devices}


def _check_addresses(cluster_name: str, addresses: dict[str, str], nodes: list[dict]) -> None:
    """A machine's ``address`` in the cluster file must be the IP of the Ray node advertising it
    (else its workers could not bind it); host names are left to the worker's bind to check."""
    import ipaddress

    from hetserve.errors import RuntimeFailure

    for machine, address in addresses.items():
        try:
            ipaddress.ip_address(address)
        except ValueError:
            continue
        ips = sorted({n["NodeManagerAddress"] for n in nodes
                      if n.get("Alive") and machine_resource(machine) in n.get("Resources", {})})
        if ips and address not in ips:
            raise RuntimeFailure(f"cluster {cluster_name!r}: machine {machine} has address {address}, but the Ray "
                                 f"node advertising {machine_resource(machine)} is at {', '.join(ips)}; start that "
                                 f"node with `ray start --node-ip-address {address}` or fix the cluster file")
