"""``PrefillReplica``: a FIFO of prompts, batched up to a token budget and the KV it can hold.

The stages of a pipeline overlap (batch n+1 enters stage 0 when batch n leaves it), hand-offs
priced by ``CostModel.pp_handoff_time``. It keeps each prompt's KV until the decode side has
pulled it (``release``).
"""

from __future__ import annotations

from collections import deque
from typing import Any

from hetserve.policies.base import ReplicaState, RunningRequest
from hetserve.policies.batching import Offer, compose_step
from hetserve.sim.replicas.snapshots import KEEP, with_wait
from hetserve.policies.kv_admission import requeue
from hetserve.sim.choices import fed_tokens, prefill_batch, reservation, shared_tokens
from hetserve.sim.events import Priority
from hetserve.sim.hosts import on_host
from hetserve.sim.replicas.base import LazyRequests, Replica


class PrefillReplica(Replica):
    def __init__(self, env, index, spec, layout) -> None:
        super().__init__(env, index, spec, layout)
        self.queue: deque[int] = deque()
        self.queued_tokens = 0
        self.running = 0
        self.running_tokens = 0
        self._in_prefill: dict[int, None] = {}  # rids of the batches now running (snapshots only)
        self._free = [0.0] * len(layout.stages)  # when each stage can take the next batch
        self._kick_at: float | None = None
        self._rate = (0.0, 0.0)  # (steps, tokens) per second of the last batch started
        # each stage: (stage, whether last, the TP collectives' fixed cost there)
        self._stages = [(s, i == len(layout.stages) - 1, self.cost.collectives_time(s))
                        for i, s in enumerate(layout.stages)]
        # when a list: (start, end, (), prompt ids) per batch, as ``Decoding.trace`` (hetserve compare)
        self.trace: list[tuple[float, float, tuple, tuple[int, ...]]] | None = None

    def place(self, rid: int) -> None:
        self.queue.append(rid)
        self.queued_tokens += self._tokens(rid)
        self._kick()

    def requeue(self, rid: int) -> None:
        """``rid`` was pre-empted on a decode replica (paged KV): re-prefill its prompt and the tokens it
        had made, at the head of its queue."""
        requeue(self.queue, rid, int, self.req.made.__getitem__)  # type: ignore[arg-type]  # the runtime's rule (kv_admission.requeue)
        self.queued_tokens += self._tokens(rid)
        self._kick()

    def _shared(self, rid: int) -> int:
        return shared_tokens(self.req, rid, self.limits.block_size, self.limits.paged)

    def _tokens(self, rid: int) -> int:
        """Tokens ``rid``'s prefill feeds: its prompt, and what it had made if it is a recompute, for
        each of its choices (``sim.choices``)."""
        return fed_tokens(self.req, rid, self._shared(rid))

    def reservation(self, rid: int) -> int:
        """KV held for ``rid``'s prefill (whole blocks, its choices' together)."""
        return reservation(self.req, rid, False, self.limits.block_size, self._shared(rid))

    def release(self, rid: int) -> None:
        """The decode side has pulled ``rid``'s KV (or it needed none): free it."""
        self.kv_add(-self.reservation(rid))
        if self.queue:
            self._kick()

    def _kick(self) -> None:
        t = max(self.loop.now, self._free[0])
        if self._kick_at is None or t < self._kick_at:
            self._kick_at = t
            self.loop.schedule(t, Priority.SCHEDULE, self._on_kick, t)

    def _take(self) -> tuple[list[int], list[int], int]:
        """Prompts of the next batch, in order (``compose_step``, the runtime's rule: token budget,
        batch limit, KV left); returns their ids, lengths and KV reservation."""
        rids: list[int] = []
        held = 0
        queue, r, block = self.queue, self.req, self.limits.block_size
        res = 0  # the head's reservation, as ``head`` showed it to ``take``

        def head() -> Offer | None:
            nonlocal res
            if not queue:
                return None
            rid = queue[0]
            shared = self._shared(rid)  # what ``_tokens`` and ``reservation`` both read, found once
            res = reservation(r, rid, False, block, shared)
            return Offer(fed_tokens(r, rid, shared), self.can_hold(self.kv_used + held, res))

        def take() -> None:
            nonlocal held
            rids.append(queue.popleft())
            held += res

        lim = self.limits
        step = compose_step(head, take, token_budget=lim.token_budget, max_seqs=lim.max_batch, decodes=0, seqs=0)
        return rids, list(step.chunks), held

    def _on_kick(self, t: float) -> None:
        if t != self._kick_at:
            return
        self._kick_at = None
        now = self.loop.now
        if now < self._free[0]:
            self._kick()
            return
        rids, lengths, held = self._take()
        if not rids:
            return  # blocked on KV; ``release`` kicks again
        tokens = sum(lengths)
        self.queued_tokens -= tokens
        self.running += len(rids)
        self.running_tokens += tokens
        self.kv_add(held)
        batch = prefill_batch(self.req, rids, self._shared)
        slow = self.env.slowdown(self)
        t = now + self.env.dispatch_wait(self, decodes=False)  # the step waits for the front end to send it
        stages = self.layout.stages
        for i, (stage, last, collectives) in enumerate(self._stages):
            start = t if t > self._free[i] else self._free[i]
            end = start + on_host(self.cost.stage_prefill_time(stage, batch, last), collectives, slow)
            self._free[i] = end
            t = end if last else end + self.cost.pp_handoff_time(stage, stages[i + 1], tokens)
        self._busy(now, t)
        if self.trace is not None:
            self.trace.append((now, t, (), tuple(rids)))
        self._rate = (1.0 / (t - now), len(rids) / (t - now)) if t > now else (0.0, 0.0)
        for rid in rids:
            if not self.req.made[rid]:  # a recompute keeps its first start
                self.req.t_start[rid] = now
            self._in_prefill[rid] = None
        self.loop.schedule(t, Priority.WORK, self._on_done, (rids, tokens))
        self.env.host_changed(self)  # the decoding beside it on a shared host slows from now
        if self.queue:
            self._kick()

    def _on_done(self, arg: tuple[list[int], int]) -> None:
        rids, tokens = arg
        self.running -= len(rids)
        self.running_tokens -= tokens
        self.served += len(rids)
        for rid in rids:
            del self._in_prefill[rid]
            self.env.prefill_done(rid, self)
        self.env.host_changed(self)

    def busy_now(self) -> bool:
        now = self.loop.now
        return any(f > now for f in self._free)

    def step_rate(self) -> tuple[float, float]:
        """(steps, first tokens) per second of the batch now running: the front end's work."""
        return self._rate if self.busy_now() else (0.0, 0.0)

    def inflight(self) -> int:
        now = self.loop.now
        return sum(f > now for f in self._free)

    snapshots_kept = True

    def snapshot_clock(self, waits: bool = True):
        # the clock enters the snapshot through the oldest prompt's wait (build it again) and the
        # wait for the first stage to be free (re-set alone while nothing is queued): the waits only
        if not waits:
            return KEEP
        if self.queue:
            return None
        return KEEP if self._free[0] <= self.loop.now else self._retimed

    def _retimed(self, snap: ReplicaState) -> ReplicaState:
        return with_wait(snap, max(0.0, self._free[0] - self.loop.now))  # as state() sets it

    def state(self, with_requests: bool = False, waits: bool = True) -> ReplicaState:
        reqs: Any = ()
        if with_requests:
            r = self.req
            reqs = LazyRequests(lambda: tuple(RunningRequest(rid, r.inp[rid], 0, r.pred[rid], 0.0, started=False)
                                              for rid in (*self._in_prefill, *self.queue)), self.loop)
        return ReplicaState(self.id, "prefill", len(self.queue), self.running, self.queued_tokens,
                            float(self.queued_tokens + self.running_tokens), 0, int(self.kv_used), 0,
                            reqs, self.capacity_norm, max(0.0, self._free[0] - self.loop.now),
                            self.loop.now - self.req.arrival[self.queue[0]] if self.queue else 0.0)
