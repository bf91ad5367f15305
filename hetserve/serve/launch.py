"""Build a running server from options: engine (local or Ray) + links + placement + HTTP app.

    opts = ServeOptions(plan="plan.json", cluster="demo-cpu", model_dir="tiny/", transmission="molink",
                        shape_links=True)
    with start_server(opts) as server:       # engine started, HTTP on 127.0.0.1:<free port>
        server.url                            # "http://127.0.0.1:PORT"

``hetserve serve`` is ``serve_forever(build(opts))``; tests and ``bench/bench_serve.py`` use
``start_server``. The placement and KV-route policies are built on ``PolicyContext.for_plan``, the
context the simulator builds, with the same defaults, so a name means the same decision in both.
"""

from __future__ import annotations

import importlib
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hetserve.policies.batching import DEFAULT_BATCHING
from hetserve.serve.limits import DEFAULT_MAX_BODY_BYTES
from hetserve.policies.placement import DEFAULT_PLACEMENT
from hetserve.policies.routing import DEFAULT_ROUTE
from hetserve.policies.transmission import DEFAULT_TRANSMISSION

BACKENDS = ("local", "ray")


@dataclass(frozen=True)
class ServeOptions:
    plan: Any  # Plan or path
    cluster: Any = None  # Cluster, preset name or path; None: the preset the plan names
    model_dir: str = ""
    model_name: str | None = None  # the name clients pass as ``model``; default: the folder's name
    backend: str = "local"
    placement: str = DEFAULT_PLACEMENT  # request placement (hetserve.policies.placement)
    route: str = DEFAULT_ROUTE  # KV route policy (hetserve.policies.routing), as `simulate --route`
    transmission: str = DEFAULT_TRANSMISSION  # link scheduling (hetserve.policies.transmission)
    # what the policies' context holds beside the plan, as in the simulator: the workload (statistics
    # only), policy knobs (aladdin's gamma / theta), the cost model's efficiency (a calibration) and an
    # output-length predictor (policies.predictor protocol; None: the request's max_tokens)
    workload: Any = None
    policy_options: dict[str, Any] = field(default_factory=dict)
    efficiency: Any = None
    predictor: Any = None
    shape_links: bool = False  # hold messages to the cluster's per-pair bandwidth / latency
    time_scale: float = 1.0  # >1 speeds every shaped link up by this factor (latency / s, bandwidth * s)
    micro_batches: int | None = None  # steps in flight per pipeline (MoLink §4.3: N..2N); None: N
    kv_capacity_tokens: int | None = None
    max_num_seqs: int = DEFAULT_BATCHING.max_batch
    max_batched_tokens: int = DEFAULT_BATCHING.token_budget
    seed: int = 0
    slo_ttft_s: float | None = None  # for aladdin placement / routes
    slo_tpot_s: float | None = None
    engine_options: dict[str, Any] = field(default_factory=dict)  # extra EngineConfig fields
    ray_address: str | None = None  # connect to a running Ray cluster; None: start one locally
    # where the engine's endpoint and TP rendezvous store listen, reachable from every worker's node;
    # None: 127.0.0.1 (local backend) or this machine's Ray node IP (ray backend). Never all interfaces.
    advertise_address: str | None = None
    # the ports hetserve's own listeners take theirs from ("LO-HI", (lo, hi) or a PortRange; EngineConfig.port_range)
    port_range: Any = None
    replan_on_failure: bool = False  # re-plan the surviving devices when a replica dies (serve/replan.py)
    replan_workload: str = "azure-conv"  # the workload the re-plan's planner plans for
    replan_time_limit_s: float = 10.0  # the re-plan's planner search time limit
    # HTTP keys (serve/keys.py): with any API key, every route but the probes needs one; /admin/* is off
    # without an admin key. Kept out of repr so a logged or printed options object shows no key.
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    admin_keys: tuple[str, ...] = field(default=(), repr=False)
    protect_probes: bool = False  # /health and /metrics need an API key too
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # a larger request body is a 413 before it is read

    def __post_init__(self) -> None:
        from hetserve.serve.keys import check_key

        for name in ("api_keys", "admin_keys"):
            keys = getattr(self, name)
            if isinstance(keys, str):  # one string would be read as one key per character
                raise ValueError(f"{name} must be a list of keys, not one string")
            object.__setattr__(self, name, tuple(check_key(k, name) for k in keys))
        if self.protect_probes and not self.api_keys:
            raise ValueError("protect_probes needs at least one API key (the probes would stay open)")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.micro_batches is not None and self.micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {self.micro_batches}")
        if self.time_scale <= 0:
            raise ValueError(f"time_scale must be positive, got {self.time_scale}")
        if not self.model_dir:
            raise ValueError("model_dir is required (a checkpoint folder; see `hetserve make-model`)")
        if self.advertise_address is not None:
            from hetserve.runtime.workers.rendezvous import check_bind_address

            check_bind_address(self.advertise_address, "--advertise-address")
        from hetserve.runtime.workers.rendezvous import PortRange

        object.__setattr__(self, "port_range", PortRange.of(self.port_range))


class Deployment:
    """Everything one server owns; ``close()`` stops the engine, the workers and the links."""

    def __init__(self, opts: ServeOptions, plan, cluster, engine, links, coordinator, app, ray_session=None):
        self.opts, self.plan, self.cluster, self.engine, self.links = opts, plan, cluster, engine, links
        self.coordinator, self.app, self.ray_session = coordinator, app, ray_session
        self._closed = False

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.coordinator.replanner is not None:
            self.coordinator.replanner.close()
        try:
            self.engine.shutdown()
        finally:
            self.links.close()
            if self.ray_session is not None:
                self.ray_session.close()


def _load(opts: ServeOptions):
    from hetserve.planner.plan import Plan, load_plan_cluster
    from hetserve.specs.cluster import Cluster

    plan = opts.plan if isinstance(opts.plan, Plan) else Plan.load(opts.plan)
    cluster = opts.cluster if isinstance(opts.cluster, Cluster) else load_plan_cluster(
        plan, "<plan>" if isinstance(opts.plan, Plan) else str(opts.plan), opts.cluster)
    return plan, cluster


def policy_context(opts: ServeOptions, plan, cluster):
    """The policies' context for ``plan``: ``PolicyContext.for_plan``, as the simulator builds it."""
    from hetserve.cost.efficiency import Efficiency, load_efficiency
    from hetserve.policies.placement import PolicyContext
    from hetserve.specs.model import load_model_as
    from hetserve.specs.workload import SLO

    model = load_model_as(opts.model_dir, plan.model)
    eff = opts.efficiency
    if eff is not None and not isinstance(eff, Efficiency):
        eff = load_efficiency(eff)
    return PolicyContext.for_plan(plan, cluster, model, opts.workload,
                                  slo=SLO(ttft_s=opts.slo_ttft_s, tpot_s=opts.slo_tpot_s), seed=opts.seed,
                                  options=opts.policy_options, efficiency=eff, predictor=opts.predictor)


def _load_in_background(load, *args) -> Future:
    """``load(*args)`` in a daemon thread, its result in a future. The tokenizer loads this way
    (transformers' imports take seconds) while the workers start in their own processes, not
    before them; a daemon thread, because an executor's thread is joined at exit: a Ctrl-C or a
    failed start-up would wait for the tokenizer before the process ends."""
    future: Future = Future()
    # transformers (in the thread) and the workers' start-up (here) both import ``packaging.version``;
    # CPython may hand one of two threads importing modules crosswise a half-made module (an
    # ImportError), so it is imported once before the thread starts
    try:
        importlib.import_module("packaging.version")
    except ImportError:  # not installed: neither side imports it then
        pass

    def run() -> None:
        try:
            future.set_result(load(*args))
        except BaseException as exc:  # handed to whoever reads the result
            future.set_exception(exc)

    threading.Thread(target=run, name="hetserve-tokenizer", daemon=True).start()
    return future


def build(opts: ServeOptions) -> Deployment:
    """Start the engine and build the app (blocks until every worker has loaded its shard)."""
    from hetserve.runtime.engine import Engine
    from hetserve.runtime.engine_config import EngineConfig
    from hetserve.policies.placement import make_placement
    from hetserve.policies.routing import make_route
    from hetserve.runtime.links.factory import LinkSchedulerFactory
    from hetserve.runtime.routing import PlanRoutes
    from hetserve.serve.app import create_app
    from hetserve.serve.coordinator import Coordinator
    from hetserve.serve.engine_backend import EngineBackend
    from hetserve.serve.text import HFCodec

    plan, cluster = _load(opts)
    ctx = policy_context(opts, plan, cluster)
    placement = make_placement(opts.placement, ctx)
    routes = PlanRoutes(plan, make_route(opts.route, ctx))
    codec_future = _load_in_background(HFCodec.from_dir, opts.model_dir)
    links = LinkSchedulerFactory(cluster, opts.transmission, shape=opts.shape_links, time_scale=opts.time_scale)
    config = EngineConfig(**{"max_num_seqs": opts.max_num_seqs, "max_batched_tokens": opts.max_batched_tokens,
                             "kv_capacity_tokens": opts.kv_capacity_tokens, "micro_batches": opts.micro_batches,
                             "host": opts.advertise_address, "port_range": opts.port_range, **opts.engine_options})
    ray_session = engine = None
    try:
        if opts.backend == "ray":
            from hetserve.runtime.workers.ray_backend import start_ray_engine
            from hetserve.runtime.workers.ray_session import RaySession

            ray_session = RaySession.start(cluster, address=opts.ray_address, node_ip_address=opts.advertise_address)
            # (a private one-node Ray binds every machine's workers on loopback: start_ray_engine's rule)
            engine = start_ray_engine(plan, cluster, opts.model_dir, config, link_scheduler=links, route_policy=routes)
        else:
            engine = Engine.from_plan(plan, cluster, opts.model_dir, config, link_scheduler=links,
                                      route_policy=routes)
        codec = codec_future.result()
    except BaseException:
        if engine is not None:  # the tokenizer failed: the workers started meanwhile stop too
            engine.shutdown()
        links.close()
        if ray_session is not None:
            ray_session.close()
        raise
    backend = EngineBackend(engine, links)
    name = opts.model_name or Path(opts.model_dir).resolve().name
    coordinator = Coordinator(backend, codec, name, placement=placement, predictor=opts.predictor)
    if opts.backend == "local":  # Ray actors are placed once at start-up (ray_backend.py): no re-plan there
        from hetserve.serve.replan import Replanner

        coordinator.replanner = Replanner(engine, opts.replan_workload, time_limit_s=opts.replan_time_limit_s,
                                          seed=opts.seed, on_failure=opts.replan_on_failure)
    auth = auth_of(opts)
    coordinator.admin_replan = bool(auth.admin_keys)
    app = create_app(coordinator, auth=auth, max_body_bytes=opts.max_body_bytes)
    return Deployment(opts, plan, cluster, engine, links, coordinator, app, ray_session)


def auth_of(opts: ServeOptions):
    """The ``APIAuth`` the HTTP app enforces for ``opts``."""
    from hetserve.serve.keys import APIAuth, KeySet

    return APIAuth(api_keys=KeySet(opts.api_keys), admin_keys=KeySet(opts.admin_keys),
                   protect_probes=opts.protect_probes)


def tls_options(cert: str | None, key: str | None, ca: str | None) -> dict[str, Any]:
    """``engine_options`` for TLS on the worker links: ``{"tls": TLSFiles(cert=, key=, ca=)}`` when all
    three files are given, ``{}`` when none is. One or two of them is an error (a link would be half
    configured), and so is a path that is not a readable file. Raises ``SpecError``."""
    from hetserve.errors import SpecError

    given = {"--tls-cert": cert, "--tls-key": key, "--tls-ca": ca}
    if not any(given.values()):
        return {}
    missing = [name for name, v in given.items() if not v]
    if missing:
        raise SpecError("--tls-cert/--tls-key/--tls-ca", "tls", "all three files or none",
                        f"missing {', '.join(missing)}")
    for name, path in given.items():
        if not Path(path).is_file():
            raise SpecError(name, "path", "an existing file", path)
    # imported here: the runtime's TLS support is optional and loads only when TLS is asked for
    from hetserve.runtime.workers.auth import TLSFiles

    return {"tls": TLSFiles(cert=str(cert), key=str(key), ca=str(ca))}


class RunningServer:
    """A ``Deployment`` served over HTTP on a background thread (context manager)."""

    def __init__(self, deployment: Deployment, host: str = "127.0.0.1", port: int = 0):
        from hetserve.serve.server import ServerThread

        self.deployment = deployment
        try:
            self.http = ServerThread(deployment.app, host, port)
        except BaseException:
            deployment.close()
            raise

    @property
    def url(self) -> str:
        return self.http.url

    def close(self) -> None:
        try:
            self.http.stop()
        finally:
            self.deployment.close()

    def __enter__(self) -> "RunningServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def start_server(opts: ServeOptions, host: str = "127.0.0.1", port: int = 0) -> RunningServer:
    return RunningServer(build(opts), host, port)


def kv_pools(deployment: Deployment) -> list[tuple[str, str, int, str]]:
    """(replica id, role, KV pool in tokens, where that size comes from) per replica of the running
    engine, as ``runtime.engine_config.kv_capacity`` sized it (``Engine.kv_sizing``)."""
    engine, asked = deployment.engine, deployment.opts.kv_capacity_tokens
    config = engine.config
    out = []
    for rid, sched in engine.schedulers.items():
        tokens = int(sched.blocks.capacity_tokens)
        pool = getattr(engine, "kv_sizing", {}).get(rid)
        if pool is None:
            source = "source unknown"
        elif pool.how == "asked":
            source = f"--kv-capacity {asked}" + (f", in whole blocks of {config.block_size}" if tokens != asked else "")
        elif pool.how == "capped":
            source = (f"the default cap ({config.default_kv_tokens}; the cluster file's memory, room for {pool.room}, "
                      "is not what the workers have: CPU, or plan devices sharing a GPU)")
        else:
            source = (f"the cluster file's device memory x {config.memory_fraction:g} less weights and "
                      "activation buffers")
        out.append((rid, sched.role, tokens, source))
    return out


def worker_threads(deployment: Deployment) -> tuple[dict[str, int], str]:
    """(torch threads per worker, where the count comes from): ``--threads-per-worker``, or this
    host's cores divided among the workers placed on it (``runtime.engine_config.worker_threads``)."""
    from hetserve.runtime.engine_config import host_cores

    engine = deployment.engine
    threads = dict(getattr(engine, "threads", {}))
    if engine.config.threads_per_worker is not None:
        return threads, "--threads-per-worker"
    return threads, f"default: {host_cores()} cores here divided among the workers on each host"
