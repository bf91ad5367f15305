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
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from typing import Any

import torch

from hetserve.errors import RuntimeFailure
from hetserve.policies.base import RequestInfo
from hetserve.runtime.layout import ReplicaSpec
from hetserve.runtime.routing import KVRoutePolicy
from hetserve.runtime.scheduler import ReplicaScheduler
from hetserve.runtime.sequence import Sequence, Status
from hetserve.runtime.snapshot import replica_snapshots, state_from_stats
from hetserve.runtime.transport import Message, Priority, SocketTransport
from hetserve.runtime.worker_group import WorkerGroup, last_line

POLL_S = 0.1  # how often worker processes are checked for exit


class Coordinator:
    def __init__(self, layout: tuple[ReplicaSpec, ...], schedulers: dict[str, ReplicaScheduler],
                 transport: SocketTransport, workers: WorkerGroup, route_policy: KVRoutePolicy):
        self.layout = layout
        self.replicas = {r.id: r for r in layout}
        self.schedulers = schedulers
        self.transport = transport
        self.workers = workers
        self.route_policy = route_policy
        self._step_ids = itertools.count(1)
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
        # When a list: ("arrive", seq id) per submission handled and ("step", replica, decode ids,
        # prompt ids) per step started, in order (tests compare it with the simulator's steps).
        self.trace: list[tuple] | None = None

    # ------------------------------------------------------------------ loop
    def run(self) -> None:
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
        for seq in list(self.seqs.values()):
            self._fail(seq, RuntimeFailure(f"request {seq.id} failed: {why}"))

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
                if self.trace is not None:
                    self.trace.append(("arrive", seq.id))
                (self.schedulers[seq.pinned].pinned if seq.pinned else self.waiting).append(seq)
        elif kind == "abort":
            self._on_abort(msg.meta["id"])
        elif kind == "error":
            self.workers.worker_errors[msg.meta["worker"]] = msg.meta["error"]
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
        if self.trace is not None:
            self.trace.append(("step", sched.id, tuple(q.id for q in batch if q.num_cached),
                               tuple(q.id for q in batch if not q.num_cached)))
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
        elif seq.status == Status.RUNNING and seq.replica and seq in self.schedulers[seq.replica].ready:
            self.schedulers[seq.replica].ready.remove(seq)
            self._finish(seq, "abort")
        # in flight or KV in transit: finished when the step result / last acknowledgement arrives

    def _poll_workers(self) -> None:
        now = time.monotonic()
        if now - self._last_poll < POLL_S:
            return
        self._last_poll = now
        for name, code in self.workers.exited():
            if name not in self.workers.dead:  # an earlier death this round may have taken its replica
                self._on_worker_death(name, code)

    def _on_worker_death(self, name: str, code: int) -> None:
        w = self.workers.worker(name)
        error = self.workers.worker_errors.get(name)
        why = (f"worker {name} (replica {w.replica}, stage {w.stage}, pid {self.workers.pids[name]}) "
               f"died with exit code {code}")
        if error:
            why += f": {last_line(error)}"
        rid = w.replica
        sched = self.schedulers[rid]
        sched.alive = False
        self.workers.stop_replica(self.replicas[rid])  # the rest of its replica cannot work without it
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
            self.fail_all(f"{why}; no replica left to serve it")
            self.waiting.clear()
            self.handoff_queue.clear()

    def _publish_stats(self) -> None:
        self.stats = {
            "waiting": len(self.waiting) + sum(len(s.pinned) for s in self.schedulers.values()),
            "handoff_waiting": len(self.handoff_queue),
            "handoff_in_flight": len(self.handoffs), "running": sum(s.num_running for s in self.schedulers.values()),
            "completed": self.num_completed, "failed": self.num_failed, "broken": self.broken,
            "replicas": {rid: s.stats() for rid, s in self.schedulers.items()},
        }
        for rid, snap in replica_snapshots(self.schedulers, self._in_handoff()).items():
            self.stats["replicas"][rid]["state"] = snap

    def _in_handoff(self) -> list[Sequence]:
        return [*self.handoff_queue, *self.handoffs.values()]
