"""``hetserve serve``: run a plan's replicas and serve them over an OpenAI-compatible HTTP API.

    hetserve serve --plan plan.json --cluster demo-cpu --model ./tiny [--host 127.0.0.1 --port 8000]
        [--backend local|ray] [--ray-address HEAD:6379] [--advertise-address 10.0.0.5] [--port-range 20000-20099]
        [--placement eft] [--route flow] [--transmission molink] [--shape-links] [--micro-batches 4]
        [--api-key-file keys.txt] [--admin-key-file admin.txt] [--protect-probes]
        [--tls-cert node.pem --tls-key node.key --tls-ca ca.pem]

torch, FastAPI and uvicorn are imported inside ``run`` so the rest of the CLI works without the
``runtime`` extra.
"""

from __future__ import annotations

import argparse
import logging
import signal
import time

from hetserve.cli.http_options import add_key_options, bind, check_host, key_options
from hetserve.cli.policy_options import add_policy_options, placement_given, route_of, transmission_of
from hetserve.runtime.workers import DEVICE_CHANNELS
from hetserve.serve.limits import DEFAULT_MAX_BODY_BYTES


def register(sub: argparse._SubParsersAction) -> None:
    from hetserve.policies.batching import DEFAULT_BATCHING

    p = sub.add_parser("serve", help="serve a plan over an OpenAI-compatible HTTP API",
                       description="Start the plan's workers and an OpenAI-compatible server "
                                   "(/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics).")
    p.add_argument("--plan", required=True, help="plan file (JSON or YAML)")
    p.add_argument("--cluster", help="cluster preset or file (default: the cluster file the plan was made on, "
                   "else the plan's cluster name as a preset)")
    p.add_argument("--model", required=True, help="checkpoint folder (Hugging Face layout; see make-model)")
    p.add_argument("--model-name", help="the model name clients use (default: the folder's name)")
    p.add_argument("--host", default="127.0.0.1", help="address the HTTP API binds (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    p.add_argument("--backend", choices=["local", "ray"], default="local",
                   help="local processes (default) or Ray actors placed on the machines the plan names")
    p.add_argument("--ray-address", help="Ray cluster to join (default: start one on this machine)")
    p.add_argument("--advertise-address",
                   help="this machine's address on the pool's network: the engine's endpoint and TP rendezvous "
                        "store listen there for the workers (default: 127.0.0.1, or with --backend ray this "
                        "machine's Ray node IP; never all interfaces); see docs/multinode.md")
    p.add_argument("--port-range", type=port_range_arg, metavar="LO-HI",
                   help="ports hetserve's own listeners take theirs from, on every machine: the engine's endpoint "
                        "and TP rendezvous store, each worker's endpoint (default: ports the OS picks); each takes "
                        "the first free one. gloo's and NCCL's own ports are not in it: see docs/multinode.md")
    add_policy_options(p)  # the same names, policy objects and defaults as `simulate`
    p.add_argument("--shape-links", action="store_true",
                   help="emulate the cluster's per-pair bandwidth and latency between workers")
    p.add_argument("--time-scale", type=float,
                   help="with --shape-links: speed every link up by this factor (default 1)")
    p.add_argument("--micro-batches", type=int,
                   help="steps in flight per pipeline (MoLink searches N..2N for N stages; default N)")
    p.add_argument("--kv-capacity", type=int, help="KV-cache tokens per replica (default: what memory allows)")
    p.add_argument("--device-channel", choices=DEVICE_CHANNELS, default="off",
                   help="tensors between workers device to device: auto (CUDA IPC on one GPU, NCCL between "
                        "GPUs), on (gloo between CPU workers too), off (the socket; default until the GPU "
                        "paths have run on a GPU: bench/gpu/dataflow.sh)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help="the dtype weights, activations and KV are computed in (default: float32 on CPU, the "
                        "checkpoint's on CUDA); a device that cannot run it is an error before any worker starts")
    p.add_argument("--max-batched-tokens", type=int, metavar="N",
                   help=f"tokens per step, decode + prompt: prompts join a step while it stays within N (default "
                        f"{DEFAULT_BATCHING.token_budget}, as the simulator; at least --max-num-seqs); a smaller budget "
                        "spreads a burst of prompts over more steps, so the first of them answer sooner. It never "
                        "splits a prompt (a step's first prompt rides whole): --prefill-mode chunked --chunk-tokens "
                        "does, and colocated replicas then take --chunk-tokens per step instead")
    p.add_argument("--max-num-seqs", type=int, default=DEFAULT_BATCHING.max_batch, metavar="N",
                   help=f"sequences per step (default {DEFAULT_BATCHING.max_batch})")
    p.add_argument("--threads-per-worker", type=int, metavar="N",
                   help="torch threads of each worker process (default: this machine's cores divided among the "
                        "workers the plan places on it, at least 1)")
    p.add_argument("--slo-ttft", type=float, help="TTFT target in seconds (aladdin placement)")
    p.add_argument("--slo-tpot", type=float, help="TPOT target in seconds (aladdin placement)")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help=f"largest request body taken, bytes; a larger one is a 413 before it is read "
                        f"(default {DEFAULT_MAX_BODY_BYTES})")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM / Ctrl-C: seconds in-flight requests get to finish (default 30); new ones get 503")
    p.add_argument("--heartbeat-timeout", type=float, default=3.0,
                   help="a worker silent this long (hung, stopped) is declared dead and killed, and its requests re-run (default 3)")
    p.add_argument("--replan-on-failure", action="store_true",
                   help="when a replica dies, re-plan the surviving devices (warm-started from the running plan) "
                        "and bring the new replicas up while the others serve; POST /admin/replan (with --admin-key) "
                        "does it on demand")
    p.add_argument("--replan-workload",
                   help="workload preset or CSV the re-plan's planner plans for (default azure-conv), after a "
                        "failure (--replan-on-failure) or on POST /admin/replan (an admin key); local backend")
    p.add_argument("--replan-time-limit", type=float, metavar="S",
                   help="the re-plan's planner search time limit in seconds (default 10); as --replan-workload")
    add_prefill_mode_options(p)
    add_key_options(p)
    p.add_argument("--tls-cert", metavar="PATH", help="TLS certificate for the worker links (with --tls-key, --tls-ca)")
    p.add_argument("--tls-key", metavar="PATH", help="TLS private key for the worker links")
    p.add_argument("--tls-ca", metavar="PATH", help="CA certificate the worker links' peers must be signed by")
    p.add_argument("--seed", type=int, default=0, help="seed of the placement policies that draw and of a re-plan's search (default 0)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=run)


def port_range_arg(text: str):
    """``--port-range LO-HI`` as a ``PortRange``; argparse's one-line error otherwise."""
    from hetserve.runtime.workers.rendezvous import PortRange

    try:
        return PortRange.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_prefill_mode_options(p: argparse.ArgumentParser) -> None:
    """How replicas batch prompts and admit KV (``policies.batching``), for ``serve`` and ``compare``."""
    from hetserve.policies.batching import DEFAULT_BATCHING

    p.add_argument("--prefill-mode", choices=["mixed", "chunked"], default=DEFAULT_BATCHING.prefill_mode,
                   help="colocated replicas: whole prompts ride in the decode step (mixed, default) or prompts "
                        "feed chunks of at most --chunk-tokens per step, decodes included (chunked); "
                        "`simulate --prefill-mode` also plays prefill_first, which the engine does not run")
    p.add_argument("--chunk-tokens", type=int,
                   help=f"tokens per step with --prefill-mode chunked (default {DEFAULT_BATCHING.chunk_tokens})")
    p.add_argument("--kv-admission", choices=["reserve", "paged"], default=DEFAULT_BATCHING.kv_admission,
                   help="KV on colocated/decode replicas: reserve prompt + max_tokens at admission (reserve, "
                        "default), or vLLM's paged blocks as the context grows, pre-empting the latest arrival "
                        "(recomputed later) when a step would not fit (paged)")


def chunk_tokens_of(args: argparse.Namespace) -> int:
    """``--chunk-tokens``, or the default (None when not given, so that one given under --prefill-mode
    mixed is refused rather than ignored)."""
    from hetserve.policies.batching import DEFAULT_BATCHING

    return args.chunk_tokens if args.chunk_tokens is not None else DEFAULT_BATCHING.chunk_tokens


def check_chunk_tokens(args: argparse.Namespace, prefill_mode: str) -> None:
    """``--chunk-tokens`` sizes chunks only under ``--prefill-mode chunked``: refused beside another
    mode (it would be dropped unseen), for ``serve``'s fellow commands."""
    from hetserve.errors import SpecError

    if args.chunk_tokens is not None and prefill_mode != "chunked":
        raise SpecError("--chunk-tokens", SpecError.OPTION, "--prefill-mode chunked beside it (the other modes take whole "
                        "prompts); drop --chunk-tokens", f"{args.chunk_tokens} with --prefill-mode {prefill_mode}")


def replans_possible(args: argparse.Namespace, admin: bool) -> bool:
    """Whether this server can re-plan, so that --replan-workload and --replan-time-limit are read:
    the local backend builds a Replanner (serve/launch.py), and it runs after a replica's failure
    (--replan-on-failure) or on POST /admin/replan, which only an admin key opens (``admin``)."""
    return args.backend == "local" and (args.replan_on_failure or admin)


REPLAN_NEEDS = ("--replan-on-failure or an admin key (--admin-key, --admin-key-file or $HETSERVE_ADMIN_KEY: "
                "POST /admin/replan), on the local backend (the re-plan's planner reads it)")


def check_idle_options(args: argparse.Namespace, plan, admin: bool = False) -> None:
    """Options named on the command line that the others leave nothing to act on: one line naming
    the option and what it needs, before anything starts (each would otherwise be dropped unseen).
    ``admin``: an admin key is configured (/admin/* is on)."""
    from hetserve.errors import PlanError, SpecError
    from hetserve.sim.option_checks import idle_plan_option

    aladdin = "aladdin" in (args.placement, route_of(args))
    replans = replans_possible(args, admin)
    needs = [("--time-scale", args.time_scale, args.shape_links, "--shape-links (it scales the emulated links)"),
             ("--transmission", args.transmission, args.shape_links,
              "--shape-links (unshaped, each message goes at once: none waits for the policy to order it)"),
             ("--replan-workload", args.replan_workload, replans, REPLAN_NEEDS),
             ("--replan-time-limit", args.replan_time_limit, replans, REPLAN_NEEDS),
             ("--ray-address", args.ray_address, args.backend == "ray", "--backend ray"),
             ("--chunk-tokens", args.chunk_tokens, args.prefill_mode == "chunked", "--prefill-mode chunked"),
             ("--max-batched-tokens", args.max_batched_tokens,
              args.prefill_mode != "chunked" or any(r.role == "prefill" for r in plan.replicas),
              "--prefill-mode mixed or a prefill replica in the plan (under --prefill-mode chunked a colocated "
              "replica's steps take --chunk-tokens tokens instead)"),
             ("--slo-ttft", args.slo_ttft, aladdin, "--placement or --route aladdin (the SLO it places by)"),
             ("--slo-tpot", args.slo_tpot, aladdin, "--placement or --route aladdin (the SLO it places by)")]
    for option, value, acts, needed in needs:
        if value is not None and not acts:
            raise SpecError(option, SpecError.OPTION, f"{needed} beside it; drop {option} or add what it needs", value)
    colocated_only = [f"--prefill-mode {args.prefill_mode}"] if args.prefill_mode == "chunked" else []
    idle = idle_plan_option(plan, args.plan, route=args.route, colocated_only=colocated_only)
    if idle is not None:
        raise PlanError(idle)


def check_port_outside_range(port: int, ports) -> None:
    """The HTTP API's ``--port`` is the user's own fixed port; ``--port-range`` is where hetserve's
    other listeners (the engine's and workers' endpoints, the TP store) take theirs. The HTTP socket
    is bound but listens only once the workers are up, and a bound socket that does not listen yet
    does not keep another SO_REUSEADDR listener off its port: the engine's endpoint could take the
    same port, and the HTTP server would then fail to listen. So the two must not overlap."""
    from hetserve.errors import SpecError

    if ports is not None and port and ports.lo <= port <= ports.hi:
        raise SpecError("--port", SpecError.OPTION, f"a port outside --port-range {ports} (the HTTP API's own port; "
                        "the range is for hetserve's other listeners)", port)


def token_budget_of(args: argparse.Namespace) -> int:
    """``--max-batched-tokens``, or the default (None when not given, so that one given where it acts on
    nothing is refused rather than ignored), checked against ``--max-num-seqs``."""
    from hetserve.errors import SpecError
    from hetserve.policies.batching import DEFAULT_BATCHING, token_budget_rule

    budget = args.max_batched_tokens if args.max_batched_tokens is not None else DEFAULT_BATCHING.token_budget
    rule = token_budget_rule(budget, args.max_num_seqs, "--max-num-seqs", "--prefill-mode chunked --chunk-tokens")
    if rule is not None:
        raise SpecError("--max-batched-tokens", SpecError.OPTION, rule, budget)
    return budget


def run(args: argparse.Namespace) -> int:
    from hetserve.errors import RuntimeFailure, SpecError

    try:
        from hetserve.serve.launch import ServeOptions, tls_options
    except ImportError as exc:  # the runtime extra is missing
        raise RuntimeFailure(f"hetserve serve needs the runtime extra (pip install 'hetserve[runtime]'): {exc}") \
            from exc
    from hetserve.cli.model_dir import check_model_dir, plan_cluster
    from hetserve.planner.plan import Plan

    from hetserve.cli.bounds import check_micro_batches
    plan = Plan.load(args.plan)  # input errors first, in one line, before anything starts
    check_micro_batches(args.micro_batches, plan, args.plan)
    cluster = plan_cluster(args.plan, plan, args.cluster)  # --cluster, else the file the plan was made on
    check_model_dir(args.model)
    from hetserve.planner.validate import check_runnable
    from hetserve.specs.model import load_model

    # the checkpoint's layers and shapes against the plan's stages, before the port is taken; the
    # figures named as the checkpoint's (its label need not be the plan's model name)
    check_runnable(plan, cluster, load_model(args.model),
                   f"{args.plan} (planned for {plan.model}) with --model {args.model}")
    keys = key_options(args)  # before the idle options: an admin key makes the re-plan options act
    check_idle_options(args, plan, admin=bool(keys["admin_keys"]))
    check_host(args.host)
    check_port_outside_range(args.port, args.port_range)
    budget = token_budget_of(args)
    if args.heartbeat_timeout <= 0.2:
        raise SpecError("--heartbeat-timeout", "heartbeat_timeout", "more than 0.2 s (workers beat every "
                        "min(0.5 s, timeout / 4))", args.heartbeat_timeout)
    if args.replan_on_failure and args.backend == "ray":
        raise SpecError("--replan-on-failure", "backend", "the local backend (Ray actors are placed once)", "ray")
    if args.replan_time_limit is not None and not 0 < args.replan_time_limit <= 3600:
        raise SpecError("--replan-time-limit", "seconds", "a number in (0, 3600]", args.replan_time_limit)
    if replans_possible(args, bool(keys["admin_keys"])):
        from hetserve.specs.workload import load_workload

        load_workload(args.replan_workload or ServeOptions.replan_workload)  # reported now, not at the first re-plan
    # options left out keep ServeOptions' defaults (the one place they are written)
    given = {k: v for k, v in (("time_scale", args.time_scale), ("replan_workload", args.replan_workload),
                               ("replan_time_limit_s", args.replan_time_limit)) if v is not None}
    engine_options = {"heartbeat_timeout_s": args.heartbeat_timeout,
                      "heartbeat_interval_s": min(0.5, args.heartbeat_timeout / 4),
                      "prefill_mode": args.prefill_mode, "chunk_tokens": chunk_tokens_of(args),
                      "kv_admission": args.kv_admission, "dtype": args.dtype, "device_channel": args.device_channel,
                      "threads_per_worker": args.threads_per_worker, **tls_options(args.tls_cert, args.tls_key, args.tls_ca)}
    try:
        opts = ServeOptions(plan=plan, cluster=cluster, model_dir=args.model, model_name=args.model_name,
                            backend=args.backend, placement=args.placement, route=route_of(args), transmission=transmission_of(args),
                            shape_links=args.shape_links,
                            micro_batches=args.micro_batches, kv_capacity_tokens=args.kv_capacity, seed=args.seed,
                            max_batched_tokens=budget, max_num_seqs=args.max_num_seqs,
                            slo_ttft_s=args.slo_ttft, slo_tpot_s=args.slo_tpot, ray_address=args.ray_address,
                            advertise_address=args.advertise_address, port_range=args.port_range,
                            engine_options=engine_options, replan_on_failure=args.replan_on_failure,
                            max_body_bytes=args.max_body_bytes, **keys, **given)
    except ValueError as exc:
        raise RuntimeFailure(str(exc)) from exc
    sock = bind(args.host, args.port)
    with sock:  # bound from here: port 0 is a real one, printed once the workers are up
        return _start_and_serve(args, opts, sock)


def log_to_stderr(level: str) -> logging.Handler:
    """hetserve's own log lines (a worker's death, a re-plan, a drain) on stderr at ``--log-level``:
    uvicorn's level sets only its own loggers, and without a handler Python shows warnings only.
    One handler however often it is called (a process may serve more than once)."""
    logger = logging.getLogger("hetserve")
    for old in [h for h in logger.handlers if h.get_name() == "hetserve-stderr"]:
        logger.removeHandler(old)  # an earlier call's, on the stderr of its time
    handler = logging.StreamHandler()
    handler.set_name("hetserve-stderr")
    handler.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level.upper())
    return handler


def _start_and_serve(args: argparse.Namespace, opts, sock) -> int:
    from rich.console import Console

    from hetserve.errors import HetserveError, RuntimeFailure
    from hetserve.serve.launch import build
    from hetserve.serve.server import serve_forever, url_of

    console = Console(stderr=True)
    log_to_stderr(args.log_level)
    console.print(f"starting {args.backend} workers for {args.plan} ...")
    t0 = time.monotonic()
    # until the server takes over the signals, SIGTERM stops the start-up as Ctrl-C does: the
    # workers started so far are stopped (its default action would leave them running, orphaned)
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        deployment = build(opts)
    except ValueError as exc:
        if isinstance(exc, HetserveError):
            raise
        raise RuntimeFailure(str(exc)) from exc
    except KeyboardInterrupt:
        console.print("stopped while starting; every worker started has exited")
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    name, engine = deployment.coordinator.model_name, deployment.engine
    console.print(f"serving model [bold]{name}[/] ({engine.dtype}) on {url_of(sock)}/v1 "
                  f"({policies_line(args, deployment.plan)}{', shaped links' if args.shape_links else ''})",
                  soft_wrap=True)
    for line in resources_lines(deployment):
        console.print(line, soft_wrap=True, markup=False)
    pids = engine.worker_pids()  # which process holds which device: for an operator's ps / kill
    console.print(f"workers (up in {time.monotonic() - t0:.1f} s, measured): " + _workers_line(pids, engine),
                  soft_wrap=True, markup=False)
    for line in deployment.app.state.auth.describe():
        console.print(line, soft_wrap=True, markup=False)
    try:
        serve_forever(deployment.app, sock, log_level=args.log_level, drain_timeout_s=args.drain_timeout)
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it handled; stopping is the normal end
        pass
    finally:
        deployment.close()
    console.print("stopped; every worker has exited")
    return 0


def policies_line(args: argparse.Namespace, plan) -> str:
    """The policies serving runs, each marked "(default)" where the command line did not name it;
    the KV route policy only on a plan with prefill replicas (nothing else hands KV on)."""
    def one(what: str, value: str, given: bool) -> str:
        return f"{what} {value}" + ("" if given else " (default)")

    parts = [one("placement", args.placement, placement_given(args))]
    if any(r.role == "prefill" for r in plan.replicas):
        parts.append(one("KV route", route_of(args), args.route is not None))
    parts.append(one("transmission", transmission_of(args), args.transmission is not None))
    return ", ".join(parts)


def resources_lines(deployment) -> list[str]:
    """Each replica's KV pool in tokens and where its size comes from, and the workers' torch threads."""
    from hetserve.serve.launch import kv_pools, worker_threads

    pools = kv_pools(deployment)
    sources = sorted({src for *_, src in pools})
    if len(sources) == 1:
        lines = ["KV pools (tokens): " + ", ".join(f"{rid} ({role}) {tokens}" for rid, role, tokens, _ in pools)
                 + f"; sized by {sources[0]}"]
    else:
        lines = ["KV pools (tokens): " + ", ".join(f"{rid} ({role}) {tokens}, sized by {src}"
                                                   for rid, role, tokens, src in pools)]
    threads, source = worker_threads(deployment)
    counts = sorted(set(threads.values()))
    if counts:
        said = (f"{counts[0]} each" if len(counts) == 1 else
                ", ".join(f"{w} {n}" for w, n in sorted(threads.items())))
        lines.append(f"torch threads per worker: {said} ({source})")
    return lines


def _workers_line(pids: dict[str, int], engine) -> str:
    """Each worker's device, process id and what making its stage took (measured by the worker)."""
    loads = getattr(engine, "worker_loads", dict)()
    parts = []
    for dev, pid in sorted(pids.items()):
        load = loads.get(dev)
        took = "" if load is None else (f", stage in {load['seconds']:.2f} s" +
                                        (f" ({_size(load['bytes_read'])} read)" if load["bytes_read"] else
                                         " (random weights)" if str(load["source"]).startswith("random") else ""))
        parts.append(f"{dev} pid {pid}{took}")
    return ", ".join(parts)


def _size(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.1f} MB"


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt
