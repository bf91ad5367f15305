"""``Engine``: runs a ``Plan`` with real worker processes and streams tokens back.

    engine = Engine.from_plan(plan, cluster, model_dir, EngineConfig(kv_capacity_tokens=4096))
    handle = engine.submit(prompt_token_ids, SamplingParams(max_tokens=32, temperature=0.7, seed=1))
    for token in handle: ...          # or: async for token in handle; handle.result()
    engine.stats()                    # queue lengths, KV use, batch size per replica
    engine.shutdown()                 # no process left behind

The engine checks the plan and the request, and wires three parts together: the worker processes
(``worker_group.py``: one per device of the plan, ``worker.py``), the coordinator thread that owns
all scheduling state (``coordinator.py``), and the knobs and KV-pool sizing (``engine_config.py``).
Other threads (``submit``, aborts) only post messages to the coordinator's inbox.

Failures: a worker that fails to start or a plan that does not fit the checkpoint or the cluster's
memory is reported as ``PlanError`` / ``RuntimeFailure``. A worker that dies (its process exits, or
it sends no heartbeat for ``heartbeat_timeout_s``) takes its replica out of service; the requests
it held are re-run on the live replicas, continuing their streams (see ``coordinator.py``), and
fail with one ``RuntimeFailure`` only when no live replica can serve them.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import threading
import weakref
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from hetserve.errors import RuntimeFailure
from hetserve.planner.plan import Plan
from hetserve.policies.request_checks import check_context, check_kv_fits, check_prompt_ids
from hetserve.runtime.workers.auth import LinkSecurity, deployment_secret
from hetserve.runtime.engine_loop import EngineLoop
from hetserve.runtime.deployment import build_layout, local_devices
from hetserve.runtime.engine_config import (EngineConfig, KVPool, check_dtype, kv_capacity, largest_message_bytes,
                                            memory_is_real, scheduler_for, worker_threads)
from hetserve.runtime.handle import RequestHandle
from hetserve.runtime.kernels import native
from hetserve.runtime.links.network import LinkStats
from hetserve.runtime.links.reports import LinkReports, process_link_stats
from hetserve.runtime.layout import ReplicaSpec
from hetserve.runtime.model.config import ArchConfig
from hetserve.runtime.model.loader import check_weights
from hetserve.runtime.workers.rendezvous import LOOPBACK
from hetserve.runtime.routing import KVRoutePolicy, PlanRoutes
from hetserve.runtime.params import SamplingParams
from hetserve.runtime.sequence import Sequence
from hetserve.runtime.workers.link_scheduling import LinkScheduler, LinkShaper
from hetserve.runtime.workers.transport import SocketTransport
from hetserve.runtime.workers.wire import ENGINE, Message
from hetserve.runtime.workers.worker import WorkerConfig
from hetserve.runtime.workers.worker_group import WorkerGroup, kill_processes
from hetserve.specs.cluster import Cluster, load_cluster

__all__ = ["Engine", "EngineConfig"]

OMP_WAIT_ENV = "OMP_WAIT_POLICY"
OMP_SPIN_ENV = "GOMP_SPINCOUNT"
# spins of a waiting OpenMP thread before it sleeps: tens of microseconds on this project's CPU
# machine, enough to catch the next operator of a step, short enough to hand the core back
WORKER_SPINS = 10_000


@contextlib.contextmanager
def bounded_omp_spin(multithreaded: bool):
    """Workers started inside inherit ``GOMP_SPINCOUNT=10000`` when they run several threads (unless
    the user set it or ``OMP_WAIT_POLICY``). A waiting OpenMP thread spins before it sleeps. torch's
    default spin is long: where other processes keep the host's cores busy (the engine's own front
    end, its clients) a spinning thread holds the core its partner needs, and a 2-thread step ran
    5-12x slower than on one thread. Never spinning (``PASSIVE``) pays a sleep and a wake-up between
    operators, about a quarter of a step on an idle host. A short spin keeps most of both (numbers:
    docs/serving.md). Set only while the workers start: OpenMP reads it once, when it loads."""
    if not multithreaded or OMP_WAIT_ENV in os.environ or OMP_SPIN_ENV in os.environ:
        yield
        return
    os.environ[OMP_SPIN_ENV] = str(WORKER_SPINS)
    try:
        yield
    finally:
        os.environ.pop(OMP_SPIN_ENV, None)


class Engine:
    """Use ``Engine.from_plan``; the constructor expects started workers."""

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_plan(cls, plan: Plan | str | Path, cluster: Cluster | str | Path, model_dir: str | Path,
                  config: EngineConfig | None = None, *, route_policy: KVRoutePolicy | None = None,
                  link_scheduler: Callable[[str, str], LinkScheduler] | None = None,
                  shaper: LinkShaper | None = None, devices: dict[str, str] | None = None) -> "Engine":
        """Check ``plan`` against the checkpoint in ``model_dir`` and ``cluster``, start its workers.

        ``route_policy`` picks the decode replica of each hand-off (default: the plan's KV-route
        weights). ``link_scheduler`` (a picklable factory ``(src, dst) -> LinkScheduler``) and
        ``shaper`` (picklable) go into every endpoint's send path. ``devices`` (plan device -> torch
        device) is decided by the launcher when the workers' machines are not this one (the Ray
        backend); None: from this process's CUDA devices. Blocks until every worker has
        loaded its shard; raises PlanError / SpecError / RuntimeFailure instead of hanging.
        """
        config = config or EngineConfig()
        plan = plan if isinstance(plan, Plan) else Plan.load(plan)
        cluster = cluster if isinstance(cluster, Cluster) else load_cluster(str(cluster))
        arch = ArchConfig.from_dir(model_dir)
        if devices is not None:
            device_of = {d: devices[d] for d in plan.devices}
            use_cuda = any(v.startswith("cuda") for v in device_of.values())
        else:
            use_cuda = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
            if use_cuda and not torch.cuda.is_available():
                raise RuntimeFailure("device='cuda' requested but CUDA is not available")
            device_of = local_devices(plan.devices, cluster, torch.cuda.device_count() if use_cuda else 0)
        dtype = config.dtype or (arch.dtype if use_cuda else "float32")
        check_dtype(dtype, set(device_of.values()))
        layout = build_layout(plan, cluster, arch, device_of, source=f"plan for {plan.model!r}",
                              checkpoint=str(model_dir))
        pools = kv_capacity(layout, cluster, arch, dtype, config,
                            memory_is_real(device_of, cluster, use_cuda, one_host=devices is None))
        check_weights(model_dir)  # a missing checkpoint is reported here, not by every worker
        engine = cls(plan, layout, arch, str(model_dir), dtype, {r: p.tokens for r, p in pools.items()}, config,
                     route_policy or PlanRoutes(plan), link_scheduler, shaper)
        engine.cluster, engine._use_cuda, engine.kv_sizing = cluster, use_cuda, pools
        engine.devices = devices
        # workers started here share this host; a launcher's (Ray) run on the cluster's machines
        host_of = (lambda d: cluster.device(d).machine) if devices is not None else (lambda d: "here")
        engine.threads = worker_threads(layout, config, host_of)
        try:
            engine._start_workers()
        except BaseException:
            engine._kill_all()
            engine.transport.close()
            raise
        engine._thread.start()
        return engine

    def __init__(self, plan: Plan, layout: tuple[ReplicaSpec, ...], arch: ArchConfig, model_dir: str, dtype: str,
                 capacity: dict[str, int], config: EngineConfig, route_policy: KVRoutePolicy,
                 link_scheduler: Callable[[str, str], LinkScheduler] | None, shaper: LinkShaper | None):
        self.plan, self.layout, self.arch, self.model_dir, self.dtype = plan, layout, arch, model_dir, dtype
        self.config = config
        self.route_policy = route_policy
        self._link_scheduler, self._shaper = link_scheduler, shaper
        self.replicas = {r.id: r for r in layout}
        # every replica id this engine has served under: a re-plan's new replicas never reuse one (a
        # metrics series or a log line names one replica for the engine's whole life)
        self.replica_ids_used = set(self.replicas)
        self.schedulers = {r.id: scheduler_for(r, capacity[r.id], config) for r in layout}
        # one secret per deployment: every worker this engine starts (now or on a re-plan) gets it
        self.security = LinkSecurity(deployment_secret(), tls=config.tls,
                                     max_message_bytes=largest_message_bytes(arch, capacity, config))
        self.transport = SocketTransport(ENGINE, self.security, host=config.host or LOOPBACK,
                                         scheduler_factory=link_scheduler, shaper=shaper, ports=config.port_range)
        self.workers = WorkerGroup(layout, self.transport, config.start_timeout_s, config.device_channel,
                                   config.port_range)
        # each worker's link counters, taken off the wire as they arrive (never reach the loop)
        self.link_reports = LinkReports(lambda: self.workers.procs)
        self.transport.on_message = self.link_reports.handle
        self.loop = EngineLoop(layout, self.schedulers, self.transport, self.workers, route_policy,
                                       heartbeat_timeout_s=config.heartbeat_timeout_s, max_reruns=config.max_reruns)
        self._ids = itertools.count(1)
        self._reconfiguring = False
        self._reconf_lock = threading.Lock()
        self.cluster: Cluster | None = None
        self._use_cuda = False
        self.devices: dict[str, str] | None = None  # the launcher's device -> torch device (Ray); None: local_devices
        self.threads: dict[str, int] = {}  # worker name -> its torch threads (set by from_plan)
        self.kv_sizing: dict[str, KVPool] = {}  # replica id -> its KV pool as sized, and why (from_plan, re-plans)
        self._closed = False
        self._close_lock = threading.Lock()
        self._thread = threading.Thread(target=self.loop.run, name="hetserve-engine-loop", daemon=True)
        self._finalizer = weakref.finalize(self, kill_processes, self.workers.procs)

    def refused_connections(self) -> dict[str, int]:
        """Connections the engine's and the workers' endpoints closed unread, by reason (a failed
        handshake, a malformed message, too many handshakes at once): the count of an attack or a
        misconfigured peer. Workers report theirs with each heartbeat."""
        total = dict(self.transport.rejected)
        for counts in list(self.loop.refused.values()):
            for reason, n in counts.items():
                total[reason] = total.get(reason, 0) + n
        return total

    def channel_stats(self) -> dict[str, dict[str, int]]:
        """Per worker with device channels, which path its transfers took and what failed
        (``DeviceChannel.stats``), as of its latest heartbeat."""
        return {worker: dict(counts) for worker, counts in list(self.loop.channels.items())}

    def link_stats(self) -> list[LinkStats]:
        """Link counters per (src, dst) device pair, summed over every process that sends: each
        worker's as of its latest report (one beside each heartbeat), this process's now. A dead
        worker's last counters stay counted; nothing here waits on a worker."""
        live = [n for n in list(self.workers.procs) if n not in self.workers.dead]
        return self.link_reports.merged(process_link_stats(self._link_scheduler), live)

    @property
    def procs(self) -> dict[str, Any]:
        """Worker name -> its process (``multiprocessing.Process`` or a Ray stand-in)."""
        return self.workers.procs

    @property
    def broken(self) -> str | None:
        """Why the engine cannot serve any more (None while it can)."""
        return self.loop.broken

    @property
    def holding(self) -> bool:
        """No replica is left and requests wait for a re-plan's (``hold_while_empty``)."""
        return self.loop.empty_since is not None

    # ------------------------------------------------------------------ public API
    def submit(self, prompt_token_ids: Iterable[int], params: SamplingParams | None = None, *,
               replica: str | None = None, share_prefix_with: RequestHandle | None = None) -> RequestHandle:
        """Queue a request; returns at once with a handle that yields tokens as they are produced.

        ``replica`` pins the prompt to one prefill-capable replica (a placement policy's choice);
        by default the first replica with room takes it from the shared FCFS queue. Raises
        ValueError for an empty/out-of-vocabulary prompt, one longer than the model's context or an
        unknown replica, InfeasibleError if its KV could never fit, RuntimeFailure if the engine is down.

        ``share_prefix_with``: the handle of another choice of the same prompt, submitted first; this
        one then waits for that one's prefill and shares its prompt's KV blocks on the same replica
        (``EngineLoop._fork``), prefilling only the rest of the prompt. Ignored once that one has
        produced a token.
        """
        if self._closed:
            raise RuntimeFailure("the engine is shut down")
        if self.broken:
            raise RuntimeFailure(f"the engine cannot serve: {self.broken}")
        params = params or SamplingParams()
        prompt = [int(t) for t in prompt_token_ids]
        # the simulator refuses by the same rules (policies/request_checks.py)
        check_prompt_ids(prompt, self.arch.vocab_size)
        check_context(len(prompt), params.max_tokens, self.arch.max_positions)
        if replica is not None and (replica not in self.schedulers or not self.schedulers[replica].serves_prefill):
            raise ValueError(f"replica {replica!r} is not a prefill or colocated replica of the plan")
        self._check_fits(len(prompt), params.max_tokens)
        stop = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.arch.eos_token_ids))
        rid = next(self._ids)
        handle = RequestHandle(rid, len(prompt))
        handle._abort = self._post_abort
        seed = params.seed if params.seed is not None else random.getrandbits(62)
        seq = Sequence(rid, prompt, params, seed, frozenset(stop), handle, pinned=replica)
        parent = share_prefix_with.request_id if share_prefix_with is not None else None
        self.transport.post(Message("submit", {"seq": seq, "parent": parent}))
        return handle

    def generate(self, prompts: list[list[int]], params: SamplingParams | None = None,
                 timeout: float | None = None) -> list[list[int]]:
        """Submit all ``prompts`` at once and wait for every output."""
        handles = [self.submit(p, params) for p in prompts]
        return [h.result(timeout) for h in handles]

    def stats(self) -> dict[str, Any]:
        """Snapshot for /metrics: queue lengths, per-replica running batch and KV use, totals."""
        return dict(self.loop.stats)

    def fail_all(self, reason: str) -> None:
        """End every unfinished request with ``RuntimeFailure(reason)`` (the engine keeps serving)."""
        self.transport.post(Message("fail_all", {"reason": reason}))

    def hold_while_empty(self, seconds: float) -> None:
        """When no replica is left to serve, keep every request (and take new ones) for up to
        ``seconds`` for a re-plan to bring one (``Engine.reconfigure``), instead of failing them at
        once; ``end_hold`` fails them sooner. 0: fail at once (the default)."""
        self.transport.post(Message("hold", {"seconds": float(seconds)}))

    def end_hold(self, reason: str) -> None:
        """No replica is coming after all: the requests held (``hold_while_empty``) fail with ``reason``."""
        self.transport.post(Message("end_hold", {"reason": reason}))

    def worker_pids(self) -> dict[str, int]:
        """Device name -> worker process id."""
        return dict(self.workers.pids)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop serving, fail what is pending, and end every worker process (killing stragglers)."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self.loop.stopping = True
        self.transport.post(Message("wake"))
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
        self.loop.fail_all("the engine was shut down")
        self.workers.send_shutdown()
        self.transport.flush(2.0)
        self.workers.join(timeout)
        self._kill_all()
        self.transport.close()
        self.workers.close()
        self._finalizer.detach()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ start-up
    def worker_config(self, w, layout, num_slots: int, store_address, backend) -> WorkerConfig:
        """What worker ``w`` of ``layout`` starts with (at start-up and when a re-plan adds it)."""
        return WorkerConfig(spec=w, layout=layout, model_dir=self.model_dir, dtype=self.dtype, num_slots=num_slots,
                            block_size=self.config.block_size, engine_address=self.transport.address,
                            security=self.security, store_address=store_address, backend=backend,
                            link_scheduler=self._link_scheduler, shaper=self._shaper,
                            host=self.transport.address[0],  # the Ray backend rebinds each to its node
                            port_range=self.config.port_range,  # each machine's own ports: Ray workers too
                            heartbeat_s=self.config.heartbeat_interval_s, threads=self.worker_threads(w.name),
                            channel_timeout_s=self.config.channel_timeout_s)

    def worker_loads(self) -> dict[str, dict]:
        """Each worker's start-up: seconds to build and load its shard, checkpoint bytes read, its CUDA
        graphs (``graphs``: captured before it reported ready, or why not) and its kernels."""
        return dict(self.workers.loads)

    def _start_workers(self) -> None:
        def make_config(w, store_address, backend) -> WorkerConfig:
            return self.worker_config(w, self.layout, self.schedulers[w.replica].blocks.capacity_tokens,
                                      store_address, backend)

        if any(w.device == "cpu" for r in self.layout for w in r.workers):
            native.available()  # CPU workers load the C++ kernels: built here once, not by each at once
        with bounded_omp_spin(max(self.threads.values(), default=1) > 1):
            self.workers.start(make_config, self.config.start_method)

    def worker_threads(self, name: str) -> int:
        """Torch threads for worker ``name``: as placed at start-up; a worker added later (a re-plan)
        gets the configured count, or one."""
        return self.threads.get(name, self.config.threads_per_worker or 1)

    # ------------------------------------------------------------------ elastic re-plan
    def reconfigure(self, plan: Plan, cluster: Cluster | None = None) -> dict[str, Any]:
        """Move the running deployment to ``plan`` while it serves (see ``elastic.py``)."""
        from hetserve.runtime.elastic import reconfigure

        with self._reconf_lock:
            self._reconfiguring = True
            try:
                return reconfigure(self, plan, cluster or self.cluster)
            finally:
                self._reconfiguring = False

    def _kill_all(self) -> None:
        self.workers.kill_all()

    def _check_fits(self, prompt_len: int, max_tokens: int) -> None:
        """Some live replica could ever hold the request's KV (``check_kv_fits``, the simulator's and
        the server's rule); while a re-plan brings replicas up, or none is left and requests are
        held for one (``hold_while_empty``), the request waits for them."""
        scheds = [s for s in list(self.schedulers.values()) if s.alive]
        if not scheds and (self._reconfiguring or self.holding):
            return
        check_kv_fits(prompt_len, max_tokens, [(s.role, s.blocks.capacity_tokens) for s in scheds],
                      self.config.block_size)

    def _post_abort(self, request_id: int) -> None:
        self.transport.post(Message("abort", {"id": request_id}))
