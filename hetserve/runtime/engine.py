"""``Engine``: runs a ``Plan`` with real worker processes and streams tokens back.

    engine = Engine.from_plan(plan, cluster, model_dir, EngineConfig(kv_capacity_tokens=4096))
    handle = engine.submit(prompt_token_ids, SamplingParams(max_tokens=32, temperature=0.7, seed=1))
    for token in handle: ...          # or: async for token in handle; handle.result()
    engine.stats()                    # queue lengths, KV use, batch size per replica
    engine.shutdown()                 # no process left behind

One worker process per device of the plan (``worker.py``); a coordinator thread in this process owns
all scheduling state (one ``ReplicaScheduler`` and ``BlockManager`` per replica, the shared
waiting queue, the hand-offs) and is the only thread touching it; other threads talk to it by
posting messages to its inbox. Its loop: take every message that arrived (results, KV
acknowledgements, submissions, aborts), check the workers are alive, start the hand-offs whose
destination has room, start the steps each replica can run.

Disaggregated plans: a prefill replica runs the prompt and samples the first token; the request
then waits for room on the decode replica chosen by the route policy, the prefill workers send
their KV pieces straight to the decode workers (layer-matched, re-sharded), and the request joins
the decode replica's running batch once every decode worker has acknowledged its pieces.

Failures: a worker that fails to start, a plan that does not fit the checkpoint or the cluster's
memory, and a worker that dies are reported as ``PlanError`` / ``RuntimeFailure``; requests on a
replica that lost a worker fail within a poll interval (0.1 s) of the process exit.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
import torch.multiprocessing as mp

from hetserve.errors import InfeasibleError, PlanError, RuntimeFailure
from hetserve.planner.plan import Plan
from hetserve.runtime.handle import RequestHandle
from hetserve.runtime.kv_cache import BlockManager
from hetserve.runtime.deployment import build_layout, check_memory
from hetserve.runtime.layout import ReplicaSpec
from hetserve.runtime.model.config import ArchConfig
from hetserve.runtime.model.loader import CheckpointReader
from hetserve.runtime.routing import KVRoutePolicy, WeightedRoutes
from hetserve.runtime.sampling import SamplingParams
from hetserve.runtime.scheduler import ReplicaScheduler
from hetserve.runtime.sequence import Sequence, Status
from hetserve.runtime.transport import LinkScheduler, LinkShaper, Message, Priority, SocketTransport
from hetserve.runtime.worker import ENGINE, WorkerConfig, worker_main
from hetserve.specs.cluster import Cluster, load_cluster

POLL_S = 0.1  # how often worker processes are checked for exit


@dataclass(frozen=True)
class EngineConfig:
    kv_capacity_tokens: int | dict[str, int] | None = None  # per replica; None: what memory allows, capped
    default_kv_tokens: int = 16384  # the cap on CPU, where device memory in the cluster file is fictional
    block_size: int = 16
    max_num_seqs: int = 64  # per step
    max_batched_tokens: int = 2048  # per step, prompt tokens + decode tokens
    dtype: str | None = None  # None: float32 on CPU, the checkpoint's dtype on CUDA
    device: str = "auto"  # "auto" | "cpu" | "cuda"
    memory_fraction: float = 0.9
    start_timeout_s: float = 120.0
    micro_batches: int | None = None  # steps in flight per replica; None: its number of pipeline stages
    start_method: str = "spawn"  # or "forkserver": workers fork from a server that imported torch once

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.max_num_seqs < 1 or self.max_batched_tokens < 1:
            raise ValueError("block_size, max_num_seqs and max_batched_tokens must be positive")
        if self.start_method not in ("spawn", "forkserver"):
            raise ValueError(f"start_method must be spawn or forkserver, got {self.start_method!r}")
        if self.micro_batches is not None and self.micro_batches < 1:
            raise ValueError(f"micro_batches must be positive, got {self.micro_batches}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.dtype not in (None, "float32", "float16", "bfloat16"):
            raise ValueError(f"dtype must be float32, float16 or bfloat16, got {self.dtype!r}")
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")


class Engine:
    """Use ``Engine.from_plan``; the constructor expects started workers."""

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_plan(cls, plan: Plan | str | Path, cluster: Cluster | str | Path, model_dir: str | Path,
                  config: EngineConfig | None = None, *, route_policy: KVRoutePolicy | None = None,
                  link_scheduler: Callable[[str, str], LinkScheduler] | None = None,
                  shaper: LinkShaper | None = None) -> "Engine":
        """Check ``plan`` against the checkpoint in ``model_dir`` and ``cluster``, start its workers.

        ``route_policy`` picks the decode replica of each hand-off (default: the plan's KV-route
        weights). ``link_scheduler`` (a picklable factory ``(src, dst) -> LinkScheduler``) and
        ``shaper`` (picklable) go into every endpoint's send path. Blocks until every worker has
        loaded its shard; raises PlanError / SpecError / RuntimeFailure instead of hanging.
        """
        config = config or EngineConfig()
        plan = plan if isinstance(plan, Plan) else Plan.load(plan)
        cluster = cluster if isinstance(cluster, Cluster) else load_cluster(str(cluster))
        arch = ArchConfig.from_dir(model_dir)
        use_cuda = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
        if use_cuda and not torch.cuda.is_available():
            raise RuntimeFailure("device='cuda' requested but CUDA is not available")
        if use_cuda:
            n = torch.cuda.device_count()
            device_of = {d: f"cuda:{i % n}" for i, d in enumerate(plan.devices)}
        else:
            device_of = {d: "cpu" for d in plan.devices}
        dtype = config.dtype or (arch.dtype if use_cuda else "float32")
        layout = build_layout(plan, cluster, arch, device_of, source=f"plan for {plan.model!r}")
        capacity = _kv_capacity(layout, cluster, arch, dtype, config, use_cuda)
        CheckpointReader(model_dir).close()  # a missing checkpoint is reported here, not by every worker
        engine = cls(plan, layout, arch, str(model_dir), dtype, capacity, config,
                     route_policy or WeightedRoutes.from_plan(plan), link_scheduler, shaper)
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
        self.schedulers = {
            r.id: ReplicaScheduler(r.id, r.role, BlockManager(capacity[r.id] // config.block_size, config.block_size),
                                   config.micro_batches or len(r.stages), config.max_num_seqs,
                                   config.max_batched_tokens)
            for r in layout}
        self.transport = SocketTransport(ENGINE, scheduler_factory=link_scheduler, shaper=shaper)
        self.procs: dict[str, Any] = {}
        self.pids: dict[str, int] = {}
        self._store = None
        self._ids = itertools.count(1)
        self._step_ids = itertools.count(1)
        self.seqs: dict[int, Sequence] = {}  # every unfinished request
        self.waiting: deque[Sequence] = deque()
        self.handoff_queue: deque[Sequence] = deque()  # first token done, waiting for room on a decode replica
        self.handoffs: dict[int, Sequence] = {}  # KV on its way
        self.steps: dict[int, tuple[str, list[Sequence], list[int]]] = {}  # step id -> (replica, seqs, q_lens)
        self.worker_errors: dict[str, str] = {}
        self.dead: set[str] = set()
        self.num_completed = self.num_failed = 0
        self.broken: str | None = None
        self._closed = False
        self._stopping = False
        self._last_poll = 0.0
        self._stats: dict[str, Any] = {}
        self._close_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="hetserve-coordinator", daemon=True)
        self._finalizer = weakref.finalize(self, _kill_processes, self.procs)

    # ------------------------------------------------------------------ public API
    def submit(self, prompt_token_ids: Iterable[int], params: SamplingParams | None = None, *,
               replica: str | None = None) -> RequestHandle:
        """Queue a request; returns at once with a handle that yields tokens as they are produced.

        ``replica`` pins the prompt to one prefill-capable replica (a placement policy's choice);
        by default the first replica with room takes it from the shared FCFS queue. Raises
        ValueError for an empty/out-of-vocabulary prompt, one longer than the model's context or an
        unknown replica, InfeasibleError if its KV could never fit, RuntimeFailure if the engine is down.
        """
        if self._closed:
            raise RuntimeFailure("the engine is shut down")
        if self.broken:
            raise RuntimeFailure(f"the engine cannot serve: {self.broken}")
        params = params or SamplingParams()
        prompt = [int(t) for t in prompt_token_ids]
        if not prompt:
            raise ValueError("the prompt is empty")
        bad = [t for t in prompt if not 0 <= t < self.arch.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.arch.vocab_size})")
        if len(prompt) + params.max_tokens > self.arch.max_positions:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                             f"model's context of {self.arch.max_positions} tokens")
        if replica is not None and (replica not in self.schedulers or not self.schedulers[replica].serves_prefill):
            raise ValueError(f"replica {replica!r} is not a prefill or colocated replica of the plan")
        self._check_fits(len(prompt), len(prompt) + params.max_tokens)
        stop = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.arch.eos_token_ids))
        rid = next(self._ids)
        handle = RequestHandle(rid, len(prompt))
        handle._abort = self._post_abort
        seed = params.seed if params.seed is not None else random.getrandbits(62)
        seq = Sequence(rid, prompt, params, seed, frozenset(stop), handle, pinned=replica)
        self.transport.post(Message("submit", {"seq": seq}))
        return handle

    def generate(self, prompts: list[list[int]], params: SamplingParams | None = None,
                 timeout: float | None = None) -> list[list[int]]:
        """Submit all ``prompts`` at once and wait for every output."""
        handles = [self.submit(p, params) for p in prompts]
        return [h.result(timeout) for h in handles]

    def stats(self) -> dict[str, Any]:
        """Snapshot for /metrics: queue lengths, per-replica running batch and KV use, totals."""
        return dict(self._stats)

    def worker_pids(self) -> dict[str, int]:
        """Device name -> worker process id."""
        return dict(self.pids)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop serving, fail what is pending, and end every worker process (killing stragglers)."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._stopping = True
        self.transport.post(Message("wake"))
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
        for seq in list(self.seqs.values()):
            self._fail(seq, RuntimeFailure(f"request {seq.id} failed: the engine was shut down"))
        for r in self.layout:
            if r.id not in self.dead:
                for stage in r.stages:
                    try:
                        self.transport.send(stage[0].name, Message("shutdown"), Priority.CONTROL)
                    except ConnectionError:
                        pass
        self.transport.flush(2.0)
        deadline = time.monotonic() + timeout
        for p in self.procs.values():
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        self._kill_all()
        self.transport.close()
        self._store = None
        self._finalizer.detach()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ start-up
    def _start_workers(self) -> None:
        workers = [w for r in self.layout for w in r.workers]
        store_address = None
        if any(w.tp_world > 1 for w in workers):
            import torch.distributed as dist

            self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            store_address = ("127.0.0.1", self._store.port)
        ctx = mp.get_context(self.config.start_method)
        if self.config.start_method == "forkserver":
            ctx.set_forkserver_preload(["hetserve.runtime.worker"])
        for w in workers:
            stage = self.replicas[w.replica].stages[w.stage]
            gpus = [s.device for s in stage]
            # NCCL needs one GPU per rank; ranks sharing a GPU (more workers than GPUs) use gloo
            backend = "nccl" if gpus[0].startswith("cuda") and len(set(gpus)) == len(gpus) else "gloo"
            cfg = WorkerConfig(spec=w, layout=self.layout, model_dir=self.model_dir, dtype=self.dtype,
                               num_slots=self.schedulers[w.replica].blocks.capacity_tokens,
                               block_size=self.config.block_size, engine_address=self.transport.address,
                               store_address=store_address, backend=backend,
                               link_scheduler=self._link_scheduler, shaper=self._shaper)
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
        deadline = time.monotonic() + self.config.start_timeout_s
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
                raise RuntimeFailure(f"workers {missing} did not {what} within {self.config.start_timeout_s:.0f} s")
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
        w = self._worker(name)
        where = f"worker {name} (replica {w.replica}, stage {w.stage}, TP rank {w.tp_rank})"
        detail = _last_line(error) if error else f"exited with code {code}"
        exc = RuntimeFailure(f"{where} failed to {what}: {detail}")
        if error:
            exc.add_note(error)
        return exc

    def _worker(self, name: str):
        return next(w for r in self.layout for w in r.workers if w.name == name)

    def _kill_all(self) -> None:
        _kill_processes(self.procs)

    def _check_fits(self, prompt_len: int, reserve: int) -> None:
        scheds = [s for s in self.schedulers.values() if s.alive]
        prefill_ok = any(s.blocks.fits_ever(reserve if s.serves_decode else prompt_len)
                         for s in scheds if s.serves_prefill)
        decode_ok = any(s.blocks.fits_ever(reserve) for s in scheds if s.serves_decode)
        if not (prefill_ok and decode_ok):
            cap = max(s.blocks.capacity_tokens for s in scheds) if scheds else 0
            raise InfeasibleError(f"a request needing {reserve} tokens of KV cache (prompt {prompt_len} + max_tokens) "
                                  f"cannot fit any replica's KV pool (largest: {cap} tokens)")

    # ------------------------------------------------------------------ coordinator loop
    def _run(self) -> None:
        try:
            while not self._stopping:
                msg = self.transport.recv(timeout=0.02)
                while msg is not None:
                    self._handle(msg)
                    msg = self.transport.recv(timeout=0)
                if self._stopping:
                    break
                self._poll_workers()
                self._start_handoffs()
                self._schedule()
                self._publish_stats()
        except BaseException as exc:  # noqa: BLE001 - a coordinator bug must not leave callers hanging
            self.broken = f"the coordinator failed: {exc!r}"
            for seq in list(self.seqs.values()):
                self._fail(seq, RuntimeFailure(f"request {seq.id} failed: {self.broken}"))
            raise

    def _handle(self, msg: Message) -> None:
        kind = msg.kind
        if kind == "result":
            self._on_result(msg.meta["step"], msg.tensors["tokens"].tolist())
        elif kind == "kv_ready":
            self._on_kv_ready(msg.meta["seq"], msg.meta["worker"])
        elif kind == "submit":
            seq = msg.meta["seq"]
            if self.broken:
                self._fail(seq, RuntimeFailure(f"request {seq.id} failed: {self.broken}"))
            elif seq.pinned is not None and not self.schedulers[seq.pinned].alive:
                self._fail(seq, RuntimeFailure(f"request {seq.id} failed: replica {seq.pinned} is down"))
            else:
                self.seqs[seq.id] = seq
                (self.schedulers[seq.pinned].pinned if seq.pinned else self.waiting).append(seq)
        elif kind == "abort":
            self._on_abort(msg.meta["id"])
        elif kind == "error":
            self.worker_errors[msg.meta["worker"]] = msg.meta["error"]
        # "wake", "link_error" (the exit poll reports dead peers): nothing to do

    def _on_result(self, step_id: int, tokens: list[int]) -> None:
        entry = self.steps.pop(step_id, None)
        if entry is None:
            return  # a step of a replica that has failed meanwhile
        rid, seqs, q_lens = entry
        sched = self.schedulers[rid]
        sched.complete(step_id)
        for seq, token, q in zip(seqs, tokens, q_lens):
            if seq.status in (Status.FAILED, Status.FINISHED):
                continue
            seq.num_cached += q
            if seq.aborted:
                self._finish(seq, "abort")
                continue
            seq.output.append(int(token))
            seq.handle._push(int(token))
            reason = seq.finish_reason()
            if reason:
                self._finish(seq, reason)
            elif sched.role == "prefill":
                seq.status = Status.HANDOFF
                self.handoff_queue.append(seq)
            else:
                sched.ready.append(seq)

    def _start_handoffs(self) -> None:
        """Reserve room on a decode replica for each waiting hand-off (FIFO per destination) and send it."""
        if not self.handoff_queue:
            return
        alive = [r for r, s in self.schedulers.items() if s.alive and s.role == "decode"]
        blocked: set[str] = set()
        for seq in list(self.handoff_queue):
            if seq.dst is None or seq.dst not in alive:
                seq.dst = self.route_policy.choose(seq.replica, alive)
            dst = self.schedulers[seq.dst]
            if seq.dst in blocked or not dst.blocks.can_allocate(seq.reserve_tokens):
                blocked.add(seq.dst)
                continue
            self.handoff_queue.remove(seq)
            seq.dst_table = dst.blocks.allocate(seq.reserve_tokens)
            seq.acks = set()
            self.handoffs[seq.id] = seq
            meta = {"step": None, "seqs": [], "priority": int(Priority.KV),
                    "handoffs": [(seq.id, seq.table, seq.num_cached, seq.dst, seq.dst_table)]}
            self.transport.send(self.replicas[seq.replica].entry, Message("step", meta), Priority.CONTROL)

    def _on_kv_ready(self, seq_id: int, worker: str) -> None:
        seq = self.handoffs.get(seq_id)
        if seq is None:
            return
        seq.acks.add(worker)
        if len(seq.acks) < len(self.replicas[seq.dst].workers):
            return
        del self.handoffs[seq_id]
        self.schedulers[seq.replica].release(seq)
        seq.replica, seq.table, seq.dst, seq.dst_table = seq.dst, seq.dst_table, None, []
        if seq.aborted:
            self._finish(seq, "abort")
            return
        seq.status = Status.RUNNING
        self.schedulers[seq.replica].ready.append(seq)

    def _schedule(self) -> None:
        prefill_first = sorted((s for s in self.schedulers.values() if s.alive),
                               key=lambda s: (not s.serves_prefill, s.num_running))
        for sched in prefill_first:
            while sched.can_start_step():
                batch = sched.next_step(self.waiting)
                if not batch:
                    break
                self._send_step(sched, batch)

    def _send_step(self, sched: ReplicaScheduler, batch: list[Sequence]) -> None:
        step_id = next(self._step_ids)
        entries, input_ids, q_lens = [], [], []
        for seq in batch:
            start, tokens = seq.next_input()
            entries.append((seq.id, start, len(tokens), seq.table, seq.sample_key()))
            input_ids.extend(tokens)
            q_lens.append(len(tokens))
        priority = Priority.DECODE if all(q == 1 and s.num_cached for q, s in zip(q_lens, batch)) else Priority.PREFILL
        meta = {"step": step_id, "seqs": entries, "handoffs": [], "priority": int(priority)}
        sched.start(step_id, batch)
        self.steps[step_id] = (sched.id, batch, q_lens)
        self.transport.send(self.replicas[sched.id].entry,
                            Message("step", meta, {"input_ids": torch.tensor(input_ids, dtype=torch.long)}), priority)

    # ------------------------------------------------------------------ finishing, aborts, failures
    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.replica is not None and seq.table:
            self.schedulers[seq.replica].release(seq)
        seq.status = Status.FINISHED
        self.seqs.pop(seq.id, None)
        self.num_completed += 1
        seq.handle._finish(reason)

    def _fail(self, seq: Sequence, error: Exception) -> None:
        if seq.replica is not None and seq.table and seq.replica in self.schedulers:
            self.schedulers[seq.replica].release(seq)
        if seq.dst is not None and seq.dst_table:
            self.schedulers[seq.dst].blocks.free(seq.dst_table)
            seq.dst_table = []
        seq.status = Status.FAILED
        self.seqs.pop(seq.id, None)
        self.num_failed += 1
        seq.handle._finish("error", error)

    def _post_abort(self, request_id: int) -> None:
        self.transport.post(Message("abort", {"id": request_id}))

    def _on_abort(self, request_id: int) -> None:
        seq = self.seqs.get(request_id)
        if seq is None:
            return
        seq.aborted = True
        if seq.status == Status.WAITING:
            (self.schedulers[seq.pinned].pinned if seq.pinned else self.waiting).remove(seq)
            self._finish(seq, "abort")
        elif seq.status == Status.HANDOFF and seq in self.handoff_queue:
            self.handoff_queue.remove(seq)
            self._finish(seq, "abort")
        elif seq.status == Status.RUNNING and seq.replica and seq in self.schedulers[seq.replica].ready:
            self.schedulers[seq.replica].ready.remove(seq)
            self._finish(seq, "abort")
        # in flight or KV in transit: finished when the step result / last acknowledgement arrives

    def _poll_workers(self) -> None:
        now = time.monotonic()
        if now - self._last_poll < POLL_S:
            return
        self._last_poll = now
        for name, p in self.procs.items():
            if name not in self.dead and p.exitcode is not None:
                self._on_worker_death(name, p.exitcode)

    def _on_worker_death(self, name: str, code: int) -> None:
        w = self._worker(name)
        error = self.worker_errors.get(name)
        why = f"worker {name} (replica {w.replica}, stage {w.stage}, pid {self.pids[name]}) died with exit code {code}"
        if error:
            why += f": {_last_line(error)}"
        rid = w.replica
        sched = self.schedulers[rid]
        sched.alive = False
        for other in self.replicas[rid].workers:  # the rest of its replica cannot work without it
            self.dead.add(other.name)
            if self.procs[other.name].exitcode is None:
                self.procs[other.name].kill()
        for step_id in [s for s, (r, _, _) in self.steps.items() if r == rid]:
            del self.steps[step_id]
        sched.inflight.clear()
        sched.ready.clear()
        sched.pinned.clear()
        for seq in list(self.seqs.values()):
            if seq.replica == rid or seq.dst == rid or (seq.pinned == rid and seq.status == Status.WAITING):
                if seq in self.handoff_queue:
                    self.handoff_queue.remove(seq)
                self.handoffs.pop(seq.id, None)
                self._fail(seq, RuntimeFailure(f"request {seq.id} failed: {why}"))
        if not any(s.alive and s.role == "decode" for s in self.schedulers.values()):
            # prefill replicas have nowhere to hand their KV to: they stop too
            for s in self.schedulers.values():
                if s.alive and s.role == "prefill":
                    s.alive = False
                    for seq in list(self.seqs.values()):
                        if seq.replica == s.id or (seq.pinned == s.id and seq.status == Status.WAITING):
                            if seq in self.handoff_queue:
                                self.handoff_queue.remove(seq)
                            self._fail(seq, RuntimeFailure(f"request {seq.id} failed: {why}; no decode replica left"))
                    s.ready.clear()
                    s.pinned.clear()
        alive = [s for s in self.schedulers.values() if s.alive]
        if not any(s.serves_prefill for s in alive) or not any(s.serves_decode for s in alive):
            self.broken = why
            for seq in list(self.seqs.values()):
                self._fail(seq, RuntimeFailure(f"request {seq.id} failed: {why}; no replica left to serve it"))
            self.waiting.clear()
            self.handoff_queue.clear()

    def _publish_stats(self) -> None:
        self._stats = {
            "waiting": len(self.waiting) + sum(len(s.pinned) for s in self.schedulers.values()),
            "handoff_waiting": len(self.handoff_queue),
            "handoff_in_flight": len(self.handoffs), "running": sum(s.num_running for s in self.schedulers.values()),
            "completed": self.num_completed, "failed": self.num_failed, "broken": self.broken,
            "replicas": {rid: s.stats() for rid, s in self.schedulers.items()},
        }


# ----------------------------------------------------------------------------- helpers


def _kv_capacity(layout: tuple[ReplicaSpec, ...], cluster: Cluster, arch: ArchConfig, dtype: str,
                 config: EngineConfig, use_cuda: bool) -> dict[str, int]:
    """KV tokens per replica: asked for (checked against memory) or what memory allows (capped on CPU)."""
    fit = check_memory(layout, cluster, arch, dtype, config.memory_fraction)
    out = {}
    for r in layout:
        asked = config.kv_capacity_tokens
        if isinstance(asked, dict):
            asked = asked.get(r.id)
        if asked is None:
            tokens = fit[r.id] if use_cuda else min(fit[r.id], config.default_kv_tokens)
        elif asked > fit[r.id]:
            raise PlanError(f"replica {r.id}: a KV pool of {asked} tokens does not fit next to its weights "
                            f"(at most {fit[r.id]} tokens on its smallest device)")
        else:
            tokens = asked
        blocks = tokens // config.block_size
        if blocks < 1:
            raise PlanError(f"replica {r.id}: room for {tokens} KV tokens, less than one block of {config.block_size}")
        out[r.id] = blocks * config.block_size
    return out


def _kill_processes(procs: dict[str, Any]) -> None:
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


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else text
