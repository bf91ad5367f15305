"""``EngineLoop``: the engine's scheduling state and the loop that drives it.

One thread owns all of it (one ``ReplicaScheduler`` and ``BlockManager`` per replica, the shared
waiting queue, the hand-offs, the steps in flight); other threads talk to it by posting messages to
the transport's inbox. Its loop: take every message that arrived (results, KV acknowledgements,
submissions, aborts), check the workers are alive, start the hand-offs whose destination has room,
start the steps each replica can run, publish a stats snapshot.

Disaggregated plans: a prefill replica runs the prompt and samples the first token; the request
then waits for room on the decode replica chosen by the route policy, the prefill workers send
their KV pieces straight to the decode workers (layer-matched, re-sharded), and the request joins
the decode replica's running batch once every decode worker has acknowledged its pieces.

Worker deaths, re-runs and elastic re-plans: ``Recovery`` (runtime/recovery.py), a mixin over
this state; so is ``Choices`` (runtime/choices.py): a request's n choices sharing its prompt's KV.
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
from hetserve.policies.request_checks import able_to_hold
from hetserve.runtime.choices import Choices
from hetserve.runtime.layout import ReplicaSpec
from hetserve.runtime.recovery import Recovery
from hetserve.runtime.routing import KVRoutePolicy
from hetserve.runtime.scheduler import ReplicaScheduler, requeue
from hetserve.runtime.sequence import Sequence, Status, StepLogprobs
from hetserve.runtime.snapshot import replica_snapshots, state_from_stats
from hetserve.runtime.step_timing import StepTiming
from hetserve.runtime.workers.transport import Priority, SocketTransport
from hetserve.runtime.workers.wire import Message
from hetserve.runtime.workers.worker_group import WorkerGroup


class EngineLoop(Recovery, Choices):
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
        self.refused: dict[str, dict[str, int]] = {}  # worker -> its endpoint's refused connections by reason
        self.channels: dict[str, dict[str, int]] = {}  # worker -> its device channel's counts (DeviceChannel.stats)
        self.deaths: list[dict[str, Any]] = []  # one record per replica taken out of service
        self._step_ids = itertools.count(1)
        self._transfer_ids = itertools.count(1)
        self.seqs: dict[int, Sequence] = {}  # every unfinished request
        self.waiting: deque[Sequence] = deque()
        self.handoff_queue: deque[Sequence] = deque()  # first token done, waiting for room on a decode replica
        self.handoffs: dict[int, Sequence] = {}  # KV on its way
        # abandoned hand-offs whose blocks wait for every receiver's word that no piece will land:
        # transfer -> (decode replica, its blocks, workers yet to confirm) (recovery.py, _fence)
        self.fenced: dict[int, tuple[str, list[int], set[str]]] = {}
        self.kv_fenced: dict[str, int] = {}  # worker -> pieces of abandoned hand-offs it dropped
        self.fences_opened = 0
        self.steps: dict[int, tuple[str, list[Sequence], list[int]]] = {}  # step id -> (replica, seqs, q_lens)
        self.num_completed = self.num_failed = 0
        self.broken: str | None = None
        # no replica left: seconds requests wait for a re-plan (``Engine.hold_while_empty``), since when
        self.hold_s, self.empty_since, self.held_for = 0.0, None, ""
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
        # When a list: one ``StepTiming`` per step finished, as the coordinator saw it (``hetserve
        # compare`` sets it to tell the step times from the queueing in served vs simulated).
        self.step_times: list[StepTiming] | None = None
        self._step_started: dict[int, StepTiming] = {}

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
            self._on_result(msg.meta["step"], msg.tensors["tokens"].tolist(), msg.meta, msg.tensors)
        elif kind == "kv_ready":
            self._on_kv_ready(msg.meta["seq"], msg.meta["worker"])
        elif kind == "kv_cancelled":
            self._on_kv_cancelled(msg.meta["seq"], msg.meta["worker"])
        elif kind == "kv_refused":
            self._on_kv_refused(msg.meta["seq"], msg.meta["worker"], str(msg.meta.get("reason", "")))
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
                if not self._hold_for_first(seq, msg.meta.get("parent")):
                    (self.schedulers[seq.pinned].pinned if seq.pinned else self.waiting).append(seq)
        elif kind == "abort":
            self._on_abort(msg.meta["id"])
        elif kind == "fail_all":
            self.fail_all(msg.meta["reason"])
        elif kind == "hold":
            self.hold_s = float(msg.meta["seconds"])
        elif kind == "end_hold":
            self._end_hold(msg.meta["reason"])
        elif kind == "heartbeat":
            self.last_beat[msg.meta["worker"]] = time.monotonic()
            self.refused[msg.meta["worker"]] = msg.meta.get("rejected", {})
            if "channel" in msg.meta:
                self.channels[msg.meta["worker"]] = msg.meta["channel"]
            if "kv_fenced" in msg.meta:
                self.kv_fenced[msg.meta["worker"]] = int(msg.meta["kv_fenced"])
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
    def _on_result(self, step_id: int, tokens: list[int], meta: dict, tensors: dict | None = None) -> None:
        entry = self.steps.pop(step_id, None)
        if entry is None:
            return  # a step of a replica that has failed meanwhile
        rid, seqs, q_lens, runs = entry
        timing = self._step_started.pop(step_id, None)
        if timing is not None and self.step_times is not None:
            timing.finished = time.monotonic()
            timing.worker_s = meta.get("worker_s", float("nan"))
            timing.worker_cpu_s = meta.get("worker_cpu_s", float("nan"))
            self.step_times.append(timing)
        sched = self.schedulers[rid]
        sched.complete(step_id)
        lps = StepLogprobs(seqs, q_lens, tensors or {})
        for b, (seq, token, q, run) in enumerate(zip(seqs, tokens, q_lens, runs)):
            if seq.status in (Status.FAILED, Status.FINISHED) or seq.reruns != run:
                continue
            if b in lps.prompt:
                seq.handle._prompt_logprobs(*lps.prompt[b])
            seq.num_cached += q
            if seq.aborted:
                self._finish(seq, "abort")
                continue
            if not sched.chunk_done(seq):
                continue  # chunked prefill, not its last chunk: the token it sampled is no output
            if seq.children:
                self._fork(seq, sched)
            seq.output.append(int(token))
            seq.handle._push(int(token), lps.sampled.get(b))
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
                fit = [c.id for c in able_to_hold([states[r] for r in alive], len(seq.prompt), seq.params.max_tokens,
                                                  self.schedulers[seq.replica].blocks.block_size, decoding=True)]
                seq.dst = self.route_policy.choose(info, seq.replica, fit, states, now)
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
            entries.append((seq.id, start, len(tokens), seq.table, seq.sample_key(),
                            seq.step_extra(start, len(tokens))))
            input_ids.extend(tokens)
            q_lens.append(len(tokens))
        priority = Priority.PREFILL if any(s.prefilling for s in batch) else Priority.DECODE
        meta = {"step": step_id, "seqs": entries, "handoffs": [], "priority": int(priority)}
        sched.start(step_id, batch)
        if self.trace is not None:
            self.trace.append(("step", sched.id, tuple(q.id for q in batch if not q.prefilling),
                               tuple(q.id for q in batch if q.prefilling)))
        # each sequence's run count goes with the step: a result for a run that has since been re-run
        # (its replica, or the prefill replica it came from, died) is stale and must not count
        self.steps[step_id] = (sched.id, batch, q_lens, tuple(s.reruns for s in batch))
        if self.step_times is not None:
            decodes = [(s, q) for s, q in zip(batch, q_lens) if not s.prefilling]
            self._step_started[step_id] = StepTiming(
                sched.id, time.monotonic(), tuple(s.id for s, _ in decodes),
                sum(s.num_cached + q for s, q in decodes), tuple(q for s, q in zip(batch, q_lens) if s.prefilling))
        self.transport.send(self.replicas[sched.id].entry,
                            Message("step", meta, {"input_ids": torch.tensor(input_ids, dtype=torch.long)}), priority)

    # ------------------------------------------------------------------ finishing, aborts, failures
    def _finish(self, seq: Sequence, reason: str) -> None:
        self._unhold(seq)
        if seq.replica is not None and seq.table:
            self.schedulers[seq.replica].release(seq)
        seq.status = Status.FINISHED
        self.seqs.pop(seq.id, None)
        self.num_completed += 1
        seq.handle._finish(reason)

    def _fail(self, seq: Sequence, error: Exception) -> None:
        self._unhold(seq)
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
        if seq.held_by is not None:
            seq.held_by.children.remove(seq)
            seq.held_by = None
            self._finish(seq, "abort")
        elif seq.status == Status.WAITING:
            (self.schedulers[seq.pinned].pinned if seq.pinned else self.waiting).remove(seq)
            self._finish(seq, "abort")
        elif seq.status == Status.HANDOFF and seq in self.handoff_queue:
            self.handoff_queue.remove(seq)
            self._finish(seq, "abort")
        elif seq.status == Status.RUNNING and seq.replica and self.schedulers[seq.replica].idle(seq):
            self.schedulers[seq.replica].drop(seq)
            self._finish(seq, "abort")
        # in flight or KV in transit: finished when the step result / last acknowledgement arrives

    def _publish_stats(self) -> None:
        self.stats = {
            "waiting": len(self.waiting) + sum(len(s.pinned) for s in self.schedulers.values()),
            "handoff_waiting": len(self.handoff_queue),
            "handoff_in_flight": len(self.handoffs), "running": sum(s.num_running for s in self.schedulers.values()),
            "completed": self.num_completed, "failed": self.num_failed, "broken": self.broken,
            "holding_s": None if self.empty_since is None else time.monotonic() - self.empty_since,
            "replicas": {rid: s.stats() for rid, s in self.schedulers.items()},
            "reruns": sum(d["requests"] for d in self.deaths), "deaths": list(self.deaths),
            "kv_fenced": {"opened": self.fences_opened, "pending": len(self.fenced),
                          "pieces_dropped": sum(self.kv_fenced.values())},
        }
        for rid, snap in replica_snapshots(self.schedulers, self._in_handoff()).items():
            self.stats["replicas"][rid]["state"] = snap

    def _in_handoff(self) -> list[Sequence]:
        return [*self.handoff_queue, *self.handoffs.values()]

