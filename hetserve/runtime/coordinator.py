"""``Coordinator``: the engine's scheduling state and the loop that drives it.

One thread owns all of it (one ``ReplicaScheduler`` and ``BlockManager`` per replica, the shared
waiting queue, the hand-offs, the steps in flight); other threads talk to it by posting messages to
the transport's inbox. Its loop: take every message that arrived (results, KV acknowledgements,
submissions, aborts), check the workers are alive, start the hand-offs whose destination has room,
start the steps each replica can run, publish a stats snapshot.

Disaggregated plans: a prefill replica runs the prompt and samples the first token; the request
then waits for room on the decode replica chosen by the route policy, the prefill workers send
their KV pieces straight to the decode workers (layer-matched, re-sharded), and the request joins
the decode replica's running batch once every decode worker has acknowledged its pieces.

Liveness: every worker sends a heartbeat every ``heartbeat_interval_s``; a worker whose process
exited, or that was silent for ``heartbeat_timeout_s`` (hung, SIGSTOPped), is declared dead and its
replica leaves service (its other workers are killed: a replica cannot run with a rank missing).

No request lost: each request the dead replica held (running there, its KV there or on its way
there, or placed there and waiting) goes back to the head of the waiting queue and is re-run on a
live replica — it re-prefills its prompt plus the tokens it already streamed and continues the
same stream, so its client sees only a pause. Sampling is keyed by (seed, position), so a seeded
request continues exactly as it would have. When the last decode replica of a disaggregated plan
dies, the prefill replicas become colocated ones (prefill and decode in place). A request fails with
one ``RuntimeFailure`` only when no live replica can ever hold it, or after ``max_reruns`` re-runs.
"""

from __future__ import annotations

import itertools
import queue
import time
from collections import deque
from typing import Any

import torch

from hetserve.errors import RuntimeFailure
from hetserve.policies.base import RequestInfo
from hetserve.runtime.layout import ReplicaSpec
from hetserve.runtime.routing import KVRoutePolicy
from hetserve.runtime.scheduler import ReplicaScheduler, requeue
from hetserve.runtime.sequence import Sequence, Status
from hetserve.runtime.snapshot import replica_snapshots, state_from_stats
from hetserve.runtime.transport import Message, Priority, SocketTransport
from hetserve.runtime.worker_group import WorkerGroup, last_line

POLL_S = 0.1  # how often worker processes are checked for exit


class Coordinator:
    def __init__(self, layout: tuple[ReplicaSpec, ...], schedulers: dict[str, ReplicaScheduler],
                 transport: SocketTransport, workers: WorkerGroup, route_policy: KVRoutePolicy,
                 heartbeat_timeout_s: float = 3.0, max_reruns: int = 3):
        self.layout = layout
        self.replicas = {r.id: r for r in layout}
        self.schedulers = schedulers
        self.transport = transport
        self.workers = workers
        self.route_policy = route_policy
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.max_reruns = max_reruns
        self.last_beat: dict[str, float] = {}
        self.deaths: list[dict[str, Any]] = []  # one record per replica taken out of service
        self._step_ids = itertools.count(1)
        self._transfer_ids = itertools.count(1)
        self.seqs: dict[int, Sequence] = {}  # every unfinished request
        self.waiting: deque[Sequence] = deque()
        self.handoff_queue: deque[Sequence] = deque()  # first token done, waiting for room on a decode replica
        self.handoffs: dict[int, Sequence] = {}  # KV on its way
        self.steps: dict[int, tuple[str, list[Sequence], list[int]]] = {}  # step id -> (replica, seqs, q_lens)
        self.num_completed = self.num_failed = 0
        self.broken: str | None = None
        self.stopping = False
        self._last_poll = 0.0
        self.stats: dict[str, Any] = {}
        # elastic re-plan: start-up messages of workers being added go here (Engine.reconfigure reads them)
        self.joining: queue.Queue | None = None
        self.replans: list[dict[str, Any]] = []
        # When a list: ("arrive", seq id) per submission handled, ("step", replica, decode ids,
        # prompt ids) per step started and ("preempt", replica, ids) per pre-emption, in order
        # (tests compare it with the simulator's steps).
        self.trace: list[tuple] | None = None

    # ------------------------------------------------------------------ loop
    def run(self) -> None:
        now = time.monotonic()
        self.last_beat = {name: now for name in self.workers.procs}
        try:
            while not self.stopping:
                msg = self.transport.recv(timeout=0.02)
                while msg is not None:
                    self._handle(msg)
                    msg = self.transport.recv(timeout=0)
                if self.stopping:
                    break
                self._poll_workers()
                self._start_handoffs()
                self._schedule()
                self._publish_stats()
        except BaseException as exc:  # noqa: BLE001 - a coordinator bug must not leave callers hanging
            self.broken = f"the coordinator failed: {exc!r}"
            self.fail_all(self.broken)
            raise

    def fail_all(self, why: str) -> None:
        """Fail every unfinished request and empty the queues (steps in flight finish unheard)."""
        for seq in list(self.seqs.values()):
            self._fail(seq, RuntimeFailure(f"request {seq.id} failed: {why}"))
        self.waiting.clear()
        self.handoff_queue.clear()
        self.handoffs.clear()
        for sched in self.schedulers.values():
            sched.pinned.clear()
            sched.ready.clear()

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
            else:
                if seq.pinned is not None and not self.schedulers[seq.pinned].alive:
                    seq.pinned = None  # placed on a replica that died meanwhile: any live one will do
                self.seqs[seq.id] = seq
                if self.trace is not None:
                    self.trace.append(("arrive", seq.id))
                (self.schedulers[seq.pinned].pinned if seq.pinned else self.waiting).append(seq)
        elif kind == "abort":
            self._on_abort(msg.meta["id"])
        elif kind == "fail_all":
            self.fail_all(msg.meta["reason"])
        elif kind == "heartbeat":
            self.last_beat[msg.meta["worker"]] = time.monotonic()
        elif kind == "error":
            self.workers.worker_errors[msg.meta["worker"]] = msg.meta["error"]
            if self.joining is not None:
                self.joining.put(msg)
        elif kind in ("ready", "peers_ack"):
            if self.joining is not None:
                self.joining.put(msg)
        elif kind == "retire":
            self._retire(msg.meta["replicas"], msg.meta["why"])
            msg.meta["done"].set()
        elif kind == "add":
            self._add(msg.meta)
            msg.meta["done"].set()
        # "wake", "link_error" (the exit poll reports dead peers): nothing to do

    # ------------------------------------------------------------------ steps and hand-offs
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
            if not sched.chunk_done(seq):
                continue  # chunked prefill, not its last chunk: the token it sampled is no output
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
        states = None
        for seq in list(self.handoff_queue):
            if seq.dst is None or seq.dst not in alive:
                if states is None:  # the decode replicas as the route policy sees them (as in the simulator)
                    snaps = replica_snapshots({r: self.schedulers[r] for r in alive}, self._in_handoff())
                    states = {r: state_from_stats(r, {"role": "decode", "state": snaps[r]}) for r in alive}
                now = time.monotonic()
                info = RequestInfo(seq.id, seq.handle.arrival_time, len(seq.prompt), float(seq.params.max_tokens))
                seq.dst = self.route_policy.choose(info, seq.replica, alive, states, now)
            dst = self.schedulers[seq.dst]
            tokens = dst.handoff_tokens(seq)
            if seq.dst in blocked or not dst.can_admit(tokens):
                blocked.add(seq.dst)
                continue
            self.handoff_queue.remove(seq)
            seq.dst_table = dst.blocks.allocate(tokens)
            seq.acks = set()
            seq.transfer = next(self._transfer_ids)
            seq.handoff_sent = time.monotonic()
            self.handoffs[seq.transfer] = seq
            meta = {"step": None, "seqs": [], "priority": int(Priority.KV),
                    "handoffs": [(seq.transfer, seq.table, seq.num_cached, seq.dst, seq.dst_table)]}
            self.transport.send(self.replicas[seq.replica].entry, Message("step", meta), Priority.CONTROL)

    def _on_kv_ready(self, transfer: int, worker: str) -> None:
        seq = self.handoffs.get(transfer)
        if seq is None:
            return  # a hand-off abandoned when its source or destination died
        seq.acks.add(worker)
        if len(seq.acks) < len(self.replicas[seq.dst].workers):
            return
        del self.handoffs[transfer]
        seq.handle.handoff_s = time.monotonic() - seq.handoff_sent  # calibration measures the hand-off by it
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
                if sched.last_preempted:
                    self._requeue(sched.id, sched.last_preempted)
                if not batch:
                    break
                self._send_step(sched, batch)

    def _requeue(self, replica: str, preempted: list[Sequence]) -> None:
        """Pre-empted sequences (paged KV) go back to the head of the queue they were admitted from:
        the prefill-capable replica they were placed on, if it is alive, else the shared one. Their
        recompute re-prefills prompt + output there (on a disaggregated plan, then a new hand-off)."""
        if self.trace is not None:
            self.trace.append(("preempt", replica, tuple(q.id for q in preempted)))
        for seq in preempted:
            home = self.schedulers.get(seq.pinned) if seq.pinned else None
            if home is None or not home.alive:
                seq.pinned, home = None, None
            requeue(home.pinned if home else self.waiting, seq)

    def _send_step(self, sched: ReplicaScheduler, batch: list[Sequence]) -> None:
        step_id = next(self._step_ids)
        entries, input_ids, q_lens = [], [], []
        for seq in batch:
            start, tokens = seq.next_input()
            entries.append((seq.id, start, len(tokens), seq.table, seq.sample_key()))
            input_ids.extend(tokens)
            q_lens.append(len(tokens))
        priority = Priority.PREFILL if any(s.prefilling for s in batch) else Priority.DECODE
        meta = {"step": step_id, "seqs": entries, "handoffs": [], "priority": int(priority)}
        sched.start(step_id, batch)
        if self.trace is not None:
            self.trace.append(("step", sched.id, tuple(q.id for q in batch if not q.prefilling),
                               tuple(q.id for q in batch if q.prefilling)))
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
        elif seq.status == Status.RUNNING and seq.replica and self.schedulers[seq.replica].idle(seq):
            self.schedulers[seq.replica].drop(seq)
            self._finish(seq, "abort")
        # in flight or KV in transit: finished when the step result / last acknowledgement arrives

    def _poll_workers(self) -> None:
        now = time.monotonic()
        if now - self._last_poll < POLL_S:
            return
        self._last_poll = now
        for name, code in self.workers.exited():
            if name not in self.workers.dead:  # an earlier death this round may have taken its replica
                self._on_worker_death(name, self.workers.exit_reason(name, code))
        for name in self.workers.procs:
            silent = now - self.last_beat.get(name, now)
            if name not in self.workers.dead and silent > self.heartbeat_timeout_s:
                self._on_worker_death(name, f"sent no heartbeat for {silent:.1f} s (hung or stopped)")

    def _on_worker_death(self, name: str, what: str) -> None:
        w = self.workers.worker(name)
        error = self.workers.worker_errors.get(name)
        why = f"worker {name} (replica {w.replica}, stage {w.stage}, pid {self.workers.pids[name]}) {what}"
        if error:
            why += f": {last_line(error)}"
        rid = w.replica
        sched = self.schedulers[rid]
        sched.alive = False
        self.workers.stop_replica(self.replicas[rid])  # the rest of its replica cannot work without it
        for step_id in [s for s, (r, _, _) in self.steps.items() if r == rid]:
            del self.steps[step_id]
        sched.clear()
        hit = [seq for seq in self.seqs.values() if seq.replica == rid or seq.pinned == rid or seq.dst == rid]
        rerun = []
        for seq in hit:
            if seq.replica != rid and seq.status == Status.HANDOFF:
                self._reroute(seq)  # its KV is safe on a live prefill replica: hand it to another decode replica
            else:
                rerun.append(seq)
        if not any(s.alive and s.role == "decode" for s in self.schedulers.values()):
            # a disaggregated plan lost its last decode replica: its prefill replicas decode in place
            converted = [s for s in self.schedulers.values() if s.alive and s.role == "prefill"]
            for s in converted:
                s.role = "colocated"
                # its requests hold prompt-sized KV only: drop its steps in flight and re-run them
                for step_id in [k for k, (r, _, _) in self.steps.items() if r == s.id]:
                    del self.steps[step_id]
                s.clear(steps_only=True)
            ids = {s.id for s in converted}
            rerun += [seq for seq in self.seqs.values() if seq.replica in ids and seq not in rerun]
        self.deaths.append({"worker": name, "replica": rid, "why": why, "at": time.monotonic(),
                            "requests": len(rerun)})
        self._rerun(sorted(rerun, key=lambda q: q.id), why)
        alive = [s for s in self.schedulers.values() if s.alive]
        if not any(s.serves_prefill for s in alive) or not any(s.serves_decode for s in alive):
            self.broken = why
            self.fail_all(f"{why}; no replica left to serve it")
            return
        for seq in list(self.waiting):  # a request only the dead replica's KV pool could hold fails now
            if not self._can_ever_serve(seq):
                self.waiting.remove(seq)
                self._fail(seq, RuntimeFailure(f"request {seq.id} failed: {why}; no live replica's KV pool "
                                               f"can hold its {seq.reserve_tokens} tokens"))

    # ------------------------------------------------------------------ elastic re-plan
    def _retire(self, rids: list[str], why: str) -> None:
        """Take replicas out of the plan (dead ones, or survivors the re-plan changes): their requests
        re-run on the replicas that stay, exactly as after a death; their devices are freed."""
        for rid in rids:
            sched = self.schedulers[rid]
            sched.alive = False
            self.workers.stop_replica(self.replicas[rid])
            for step_id in [s for s, (r, _, _) in self.steps.items() if r == rid]:
                del self.steps[step_id]
            sched.clear()
            hit = [q for q in self.seqs.values() if rid in (q.replica, q.pinned, q.dst)]
            for seq in hit:
                if seq.replica != rid and seq.status == Status.HANDOFF:
                    self._reroute(seq)
            self._rerun(sorted((q for q in hit if q.replica == rid or q.status != Status.HANDOFF),
                               key=lambda q: q.id), f"{why}: replica {rid} retired")
        for rid in rids:
            self.workers.forget(self.replicas[rid])
            for w in self.replicas[rid].workers:
                self.last_beat.pop(w.name, None)
            del self.schedulers[rid], self.replicas[rid]
        self.layout = tuple(r for r in self.layout if r.id not in rids)
        self.workers.layout = self.layout

    def _add(self, meta: dict[str, Any]) -> None:
        """Put newly started replicas into service (their processes come from ``WorkerGroup.start_more``)."""
        self.layout = meta["layout"]
        self.workers.add(meta["procs"], self.layout)
        now = time.monotonic()
        for name in meta["procs"]:
            self.last_beat[name] = now
        for spec, sched in zip(meta["replicas"], meta["schedulers"]):
            self.replicas[spec.id] = spec
            self.schedulers[spec.id] = sched
        if hasattr(self.route_policy, "plan"):  # PlanRoutes: the new plan's KV routes
            self.route_policy.plan = meta["plan"]
        alive = [s for s in self.schedulers.values() if s.alive]
        if any(s.serves_prefill for s in alive) and any(s.serves_decode for s in alive):
            self.broken = None  # the re-planned deployment can serve again

    def _reroute(self, seq: Sequence) -> None:
        """A hand-off whose destination died goes back to the hand-off queue (the route policy picks again)."""
        self.handoffs.pop(seq.transfer, None)
        seq.dst, seq.dst_table, seq.acks = None, [], set()  # the dead replica's blocks are gone with it
        if seq not in self.handoff_queue:
            self.handoff_queue.appendleft(seq)

    def _rerun(self, seqs: list[Sequence], why: str) -> None:
        """Put ``seqs`` back at the head of the waiting queue, in arrival order, to re-prefill on a live replica."""
        for seq in reversed(seqs):
            if seq in self.handoff_queue:
                self.handoff_queue.remove(seq)
            self.handoffs.pop(seq.transfer, None)
            if seq in self.waiting:
                self.waiting.remove(seq)
            for s in self.schedulers.values():
                s.drop(seq)
            if seq.replica is not None and seq.table and self.schedulers[seq.replica].alive:
                self.schedulers[seq.replica].release(seq)
            if seq.dst is not None and seq.dst_table and self.schedulers[seq.dst].alive:
                self.schedulers[seq.dst].blocks.free(seq.dst_table)
            seq.replica, seq.table, seq.num_cached, seq.prefill_end, seq.pinned = None, [], 0, 0, None
            seq.dst, seq.dst_table, seq.acks = None, [], set()
            if seq.aborted:
                self._finish(seq, "abort")
                continue
            seq.reruns += 1
            if seq.reruns > self.max_reruns:
                self._fail(seq, RuntimeFailure(f"request {seq.id} failed: {why} (its replica died "
                                               f"{seq.reruns} times; giving up)"))
                continue
            seq.status = Status.WAITING
            self.waiting.appendleft(seq)

    def _can_ever_serve(self, seq: Sequence) -> bool:
        scheds = [s for s in self.schedulers.values() if s.alive]
        return (any(s.blocks.fits_ever(s.admission_tokens(seq)) for s in scheds if s.serves_prefill)
                and any(s.blocks.fits_ever(seq.reserve_tokens) for s in scheds if s.serves_decode))

    def _publish_stats(self) -> None:
        self.stats = {
            "waiting": len(self.waiting) + sum(len(s.pinned) for s in self.schedulers.values()),
            "handoff_waiting": len(self.handoff_queue),
            "handoff_in_flight": len(self.handoffs), "running": sum(s.num_running for s in self.schedulers.values()),
            "completed": self.num_completed, "failed": self.num_failed, "broken": self.broken,
            "replicas": {rid: s.stats() for rid, s in self.schedulers.items()},
            "reruns": sum(d["requests"] for d in self.deaths), "deaths": list(self.deaths),
        }
        for rid, snap in replica_snapshots(self.schedulers, self._in_handoff()).items():
            self.stats["replicas"][rid]["state"] = snap

    def _in_handoff(self) -> list[Sequence]:
        return [*self.handoff_queue, *self.handoffs.values()]
