"""``Recovery``: how the coordinator keeps every request when workers die or the plan changes.

Liveness: every worker sends a heartbeat every ``heartbeat_interval_s``; a worker whose process
exited, or that was silent for ``heartbeat_timeout_s`` (hung, SIGSTOPped), is declared dead and its
replica leaves service (its other workers are killed: a replica cannot run with a rank missing).

No request lost: each request the dead replica held (running there, its KV there or on its way
there, or placed there and waiting) goes back to the head of the waiting queue and is re-run on a
live replica — it re-prefills its prompt plus the tokens it already streamed and continues the
same stream, so its client sees only a pause. Sampling is keyed by (seed, position), so a seeded
request continues exactly as it would have. When the last decode replica of a disaggregated plan
dies, the prefill replicas become colocated ones (prefill and decode in place); when its last prefill
replica dies, the decode replicas do. A request fails with
one ``RuntimeFailure`` only when no live replica can ever hold it, or after ``max_reruns`` re-runs.

Elastic re-plans (``Engine.reconfigure``) use the same path: retired replicas' requests re-run on
the replicas that stay, and new replicas join in service.

A mixin over the ``EngineLoop``'s state (its schedulers, queues, steps in flight and workers),
kept apart so the coordinator's own file holds the normal path: messages, steps, hand-offs.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from hetserve.errors import RuntimeFailure
from hetserve.runtime.sequence import Sequence, Status
from hetserve.runtime.workers.transport import Priority
from hetserve.runtime.workers.wire import Message
from hetserve.runtime.workers.worker_group import last_line

POLL_S = 0.1  # how often worker processes are checked for exit

log = logging.getLogger("hetserve.runtime")


def _on(seq: Sequence, rid: str) -> bool:
    """``seq`` runs on replica ``rid``, hands off to it, or waits in its queue (placed there at
    submission). A request that was prefilled there and now decodes elsewhere is not on it: it keeps
    ``pinned`` (a pre-empted one goes back there) but has nothing on ``rid`` to lose."""
    return seq.replica == rid or seq.dst == rid or (seq.pinned == rid and seq.replica is None)


class Recovery:
    """Worker deaths, re-runs and elastic re-plans, for ``EngineLoop`` (see the module docstring)."""

    def _poll_workers(self) -> None:
        now = time.monotonic()
        gap = now - self._last_poll
        if gap < POLL_S:
            return
        self._last_poll = now
        if gap > self.heartbeat_timeout_s:
            # the engine itself did not run for a while (its process stopped or starved): the
            # heartbeats of that time wait unread in its queue, so every worker's silence counts from now
            for name in self.last_beat:
                self.last_beat[name] = now
        if self.empty_since is not None and now - self.empty_since > self.hold_s:
            self._end_hold(f"no re-plan brought one within {self.hold_s:.0f} s")
        self.workers.reap()  # the workers killed with a dead one's replica: no zombie left behind
        # a worker a signal ended first: its TP peers then exit on the broken connection (code 1), and
        # the first death handled is the one named as its replica's cause
        for name, code in sorted(self.workers.exited(), key=lambda e: e[1] >= 0):
            if name not in self.workers.dead:  # an earlier death this round may have taken its replica
                self._on_worker_death(name, self.workers.exit_reason(name, code))
        for name in self.workers.procs:
            silent = now - self.last_beat.get(name, now)
            if name not in self.workers.dead and silent > self.heartbeat_timeout_s:
                self._on_worker_death(name, f"sent no heartbeat for {silent:.1f} s (hung or stopped); killed with its replica")

    def _no_replica_left(self, why: str) -> None:
        """Hold every request for a re-plan (``hold_s`` > 0: they wait in the queue, new ones too) or
        fail them all now."""
        if self.hold_s <= 0:
            self.broken = why
            self.fail_all(f"{why}; no replica left to serve it")
            return
        if self.empty_since is None:
            self.empty_since, self.held_for = time.monotonic(), why
            log.warning("no replica left to serve: %d request(s) held up to %.0f s for a re-plan",
                        len(self.seqs), self.hold_s)

    def _end_hold(self, why: str) -> None:
        """No replica is coming (the hold ran out, or the re-plan failed): every request held fails."""
        if self.empty_since is None:
            return
        self.empty_since = None
        self.broken = f"{self.held_for}; no replica left to serve it, and {why}"
        self.fail_all(self.broken)

    def _stop_replica(self, rid: str) -> None:
        """Out of service: its workers stopped, its steps in flight forgotten, its batches cleared."""
        self.schedulers[rid].alive = False
        self.workers.stop_replica(self.replicas[rid])
        for step_id in [s for s, (r, *_) in self.steps.items() if r == rid]:
            del self.steps[step_id]
        self.schedulers[rid].clear()
        self.schedulers[rid].blocks.release_all()  # its KV went with its workers (its gauges read 0)
        for transfer in [t for t, (dst, _, _) in self.fenced.items() if dst == rid]:
            del self.fenced[transfer]  # its blocks went with it

    def _on_worker_death(self, name: str, what: str) -> None:
        w = self.workers.worker(name)
        error = self.workers.worker_errors.get(name)
        why = f"worker {name} (replica {w.replica}, stage {w.stage}, pid {self.workers.pids[name]}) {what}"
        if error:
            why += f": {last_line(error)}"
        rid = w.replica
        self._stop_replica(rid)  # the rest of its replica cannot work without it
        hit = [seq for seq in self.seqs.values() if _on(seq, rid)]
        rerun = []
        for seq in hit:
            if seq.replica != rid and seq.status == Status.HANDOFF:
                self._reroute(seq)  # its KV is safe on a live prefill replica: hand it to another decode replica
            else:
                rerun.append(seq)
        if not any(s.alive and s.role == "decode" for s in self.schedulers.values()):
            # a disaggregated plan lost its last decode replica: its prefill replicas decode in place
            for s in [s for s in self.schedulers.values() if s.alive and s.role == "prefill"]:
                rerun += [seq for seq in self._change_role(s.id, "colocated") if seq not in rerun]
        if not any(s.alive and s.serves_prefill for s in self.schedulers.values()):
            # ... and one that lost its last prefill replica: its decode replicas prefill in place
            for s in [s for s in self.schedulers.values() if s.alive and s.role == "decode"]:
                self._change_role(s.id, "colocated")
        self.deaths.append({"worker": name, "replica": rid, "why": why, "at": time.monotonic(),
                            "requests": len(rerun)})
        roles = ", ".join(f"{s.id} {s.role}" for s in self.schedulers.values() if s.alive)
        if roles:
            log.warning("%s: replica %s out of service, %d request(s) re-run; live replicas: %s",
                        why, rid, len(rerun), roles)
        else:  # nothing left to re-run on: they wait for a re-plan or fail (_no_replica_left says which)
            log.warning("%s: replica %s out of service, the last one; %d request(s) it held wait for a re-plan "
                        "or fail", why, rid, len(rerun))
        self._rerun(sorted(rerun, key=lambda q: q.id), why)
        alive = [s for s in self.schedulers.values() if s.alive]
        if not any(s.serves_prefill for s in alive) or not any(s.serves_decode for s in alive):
            self._no_replica_left(why)
            return
        for seq in list(self.waiting):  # a request only the dead replica's KV pool could hold fails now
            if not self._can_ever_serve(seq):
                self.waiting.remove(seq)
                self._fail(seq, RuntimeFailure(f"request {seq.id} failed: {why}; no live replica's KV pool "
                                               f"can hold its {seq.reserve_tokens} tokens"))

    def _change_role(self, rid: str, role: str) -> list[Sequence]:
        """Give the live replica ``rid`` another role in place (its workers keep running); returns the
        requests it ran, to re-run. A decode replica turning colocated keeps them: their KV holds all
        they may generate, so they go on decoding there. Any other change re-runs them, since their KV
        was taken for the old role (a prefill replica's holds the prompt only) and a colocated
        replica's decodes have no hand-off to move them: their steps in flight are forgotten. Requests
        waiting on it that it can no longer prefill join the shared queue; hand-offs on their way to
        it, when it no longer decodes, go back to the hand-off queue."""
        sched = self.schedulers[rid]
        old, sched.role = sched.role, role
        if old == role or (old == "decode" and role == "colocated"):
            return []
        for step_id in [k for k, (r, *_) in self.steps.items() if r == rid]:
            del self.steps[step_id]
        sched.clear(steps_only=True)
        if not sched.serves_prefill:
            for seq in reversed([q for q in sched.pinned if q.replica != rid]):
                sched.pinned.remove(seq)
                seq.pinned = None
                self.waiting.appendleft(seq)
        if not sched.serves_decode:
            for seq in [q for q in self.seqs.values() if q.dst == rid and q.replica != rid]:
                if seq.dst_table:
                    self._fence(seq)  # pieces already sent may still land in its blocks there
                self._reroute(seq)
        return [q for q in self.seqs.values() if q.replica == rid]

    # ------------------------------------------------------------------ elastic re-plan
    def _retire(self, rids: list[str], why: str) -> None:
        """Take replicas out of the plan (dead ones, or survivors the re-plan changes): their requests
        re-run on the replicas that stay, exactly as after a death; their devices are freed."""
        for rid in rids:
            self._stop_replica(rid)
            hit = [q for q in self.seqs.values() if _on(q, rid)]
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
        self.replicas = {r.id: r for r in self.layout}
        for sched in meta["schedulers"]:
            self.schedulers[sched.id] = sched
        # kept replicas take their roles in the new plan now that the replicas they hand off to (or
        # take hand-offs from) are in service; the requests a change displaces re-run
        rerun: list[Sequence] = []
        for rid, role in meta["roles"].items():
            if self.schedulers[rid].alive and self.schedulers[rid].role != role:
                meta["changed"][rid] = [self.schedulers[rid].role, role]
                rerun += self._change_role(rid, role)
        self._rerun(sorted(rerun, key=lambda q: q.id), "re-plan: its replica changed role")
        if hasattr(self.route_policy, "plan"):  # PlanRoutes: the new plan's KV routes
            self.route_policy.plan = meta["plan"]
        alive = [s for s in self.schedulers.values() if s.alive]
        if any(s.serves_prefill for s in alive) and any(s.serves_decode for s in alive):
            self.broken = self.empty_since = None  # the re-planned deployment can serve again (held requests run)

    def _reroute(self, seq: Sequence) -> None:
        """A hand-off whose destination died goes back to the hand-off queue (the route policy picks again)."""
        self.handoffs.pop(seq.transfer, None)
        seq.dst, seq.dst_table, seq.acks = None, [], set()  # the dead replica's blocks are gone with it
        if seq not in self.handoff_queue:
            self.handoff_queue.appendleft(seq)

    def _on_kv_refused(self, transfer: int, worker: str, reason: str) -> None:
        """A worker refused hand-off ``transfer``: a sender whose layout lacks the destination, or a
        receiver that could not write a piece (``workers/kv_receiver.py``). The request re-runs from
        its prompt rather than wait for pieces that never come; the pieces other senders wrote are
        fenced off the destination's blocks (``_rerun``)."""
        seq = self.handoffs.get(transfer)
        if seq is None:
            return  # already re-run or abandoned (another sender refused it first)
        log.warning("request %s: KV hand-off refused by %s (%s); re-running it", seq.id, worker, reason)
        self._rerun([seq], f"its KV hand-off was refused by worker {worker}: {reason}")

    def _rerun(self, seqs: list[Sequence], why: str) -> None:
        """Put ``seqs`` back at the head of the waiting queue, in arrival order, to re-prefill on a live replica."""
        for seq in reversed(seqs):
            if seq.held_by is not None:  # a choice waiting for another's prefill: queue it on its own
                seq.held_by.children.remove(seq)
                seq.held_by = None
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
                self._fence(seq)
            seq.replica, seq.table, seq.num_cached, seq.prefill_end, seq.pinned = None, [], 0, 0, None
            seq.dst, seq.dst_table, seq.acks = None, [], set()
            if seq.aborted:
                self._finish(seq, "abort")
                continue
            seq.reruns += 1
            if seq.reruns > self.max_reruns:
                self._fail(seq, RuntimeFailure(f"request {seq.id} failed: {why} (run {seq.reruns} times, "
                                               f"the last re-run allowed; giving up)"))
                continue
            seq.status = Status.WAITING
            self.waiting.appendleft(seq)

    def _fence(self, seq: Sequence) -> None:
        """``seq``'s hand-off is abandoned while its decode replica lives. Pieces its senders already
        sent may still land there (a dead sender's socket delivers what it had written), so its
        blocks stay taken until every receiving worker has confirmed that no piece of this transfer
        will be written any more (``kv_cancel`` -> ``kv_cancelled``); only then can another request
        have them."""
        workers = {w.name for w in self.replicas[seq.dst].workers}
        self.fenced[seq.transfer] = (seq.dst, seq.dst_table, workers)
        self.fences_opened += 1
        for name in workers:
            self.transport.send(name, Message("kv_cancel", {"seq": seq.transfer}), Priority.CONTROL)

    def _on_kv_cancelled(self, transfer: int, worker: str) -> None:
        fence = self.fenced.get(transfer)
        if fence is None:
            return
        rid, table, waiting = fence
        waiting.discard(worker)
        if waiting:
            return
        del self.fenced[transfer]
        if rid in self.schedulers and self.schedulers[rid].alive:
            self.schedulers[rid].blocks.free(table)

    def _can_ever_serve(self, seq: Sequence) -> bool:
        scheds = [s for s in self.schedulers.values() if s.alive]
        return (any(s.blocks.fits_ever(s.admission_tokens(seq)) for s in scheds if s.serves_prefill)
                and any(s.blocks.fits_ever(seq.reserve_tokens) for s in scheds if s.serves_decode))
