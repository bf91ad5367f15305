"""``DecodeReplica``: admits finished prefills in arrival order when their KV fits (requests wait,
none is dropped), pulls their KV over the links, and runs them with continuous batching. With paged
KV a pre-empted request goes back to its prefill replica to be recomputed."""

from __future__ import annotations

from collections import deque

from hetserve.policies.base import ReplicaState
from hetserve.sim.replicas.decoding import Decoding
from hetserve.sim.replicas.prefill import PrefillReplica


class DecodeReplica(Decoding):
    def __init__(self, env, index, spec, layout) -> None:
        super().__init__(env, index, spec, layout)
        self.waiting: deque[tuple[int, PrefillReplica]] = deque()
        self.pending: list[int] = []  # KV arrived, joining at the next boundary
        self._inbound: dict[int, None] = {}  # admitted, not yet in the batch (KV on the way or pending)

    def enqueue(self, rid: int, src: PrefillReplica) -> None:
        """A finished prefill routed here: admit when its KV fits, then pull the KV."""
        self.waiting.append((rid, src))
        self.pred_sum += self.req.pred[rid] * self.req.choices[rid]
        self._admit()

    def _admit(self) -> None:
        kv = self.kv
        while self.waiting and self.admitted < self.max_batch:
            rid, src = self.waiting[0]
            if not kv.admits(rid, whole_segment=True):  # beside all the running segment will take
                break
            self.waiting.popleft()
            kv.admit(rid)
            self.admitted += self.req.choices[rid]
            self._inbound[rid] = None
            self.env.start_kv(rid, src, self)

    def kv_arrived(self, rid: int) -> None:
        self.pending.append(rid)
        self._request_boundary()

    def _after_boundary(self) -> None:
        for rid in self.pending:
            del self._inbound[rid]
            self._join(rid)
        self.pending.clear()
        self._preempt()
        self._start_segment()
        if self.kv.grows:
            self._admit()  # the segment's end is known now: room for more?

    def _requeue(self, victims: list[int]) -> None:
        """Pre-empted requests go back to the prefill replica that prefilled them, to be recomputed
        and handed off again (the runtime's engine does the same)."""
        for rid in victims:
            self.pred_sum -= self.req.pred[rid] * self.req.choices[rid]
            self.env.recompute(rid)

    def _not_started(self):
        for rid in self._inbound:
            yield rid, 1  # the first token came with the prefill
        for rid, _ in self.waiting:
            yield rid, 1

    def state(self, with_requests: bool = False, waits: bool = True) -> ReplicaState:
        b = self.batch
        queued = len(self.waiting) + self.admitted - b.size
        done = b.iterations_done(self.loop.now)  # asked once: the tokens made and the context both follow from it
        outstanding = max(0.0, self.pred_sum - b.generated_after(done)) if b.size else self.pred_sum
        return ReplicaState(self.id, "decode", queued, b.size, 0, outstanding, b.context_after(done),
                            int(self.kv_used), int(self.kv_capacity),
                            self._snapshot_requests(with_requests), self.capacity_norm)
