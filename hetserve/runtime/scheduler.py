"""Continuous batching for one replica: which sequences run in its next step.

Every step is rebuilt from scratch (requests join and leave the running batch every iteration):
the decoding sequences that are not already in flight, plus, on a prefill-capable replica, new
requests from the head of its waiting queues, composed by the shared rule
(``hetserve.policies.batching.compose_step``: token budget, sequence limit, KV reservation; the
simulator composes its steps with the same function). Up to ``num_stages`` steps are in flight at
once, on disjoint sequences, so every pipeline stage has work; decode sequences are spread evenly
over those micro-batches (``decode_share``).

With ``prefill_mode="chunked"`` (a colocated replica), every waiting prompt that fits the KV pool
and the sequence limit is admitted into ``prefilling``, and each step gives the admitted prompts
that are not already in flight chunks up to ``chunk_tokens`` with the decodes counted
(``prompt_chunks``, the simulator's rule); a prompt's token comes out of its last chunk.

KV admission (``kv_admission``): "reserve" takes ``kv_reservation`` at admission, prompt + max_tokens
on a colocated or decode replica, the prompt on a prefill replica (freed once the KV reached a
decode replica). "paged" (``policies.kv_admission``; the simulator's ``PagedKV`` decides with the
same functions) takes the blocks of the prefill at admission and one more block whenever a decode
step fills the last; when a step's new blocks do not fit, the latest-arrived sequence here is
pre-empted: its blocks are freed and the coordinator puts it back at the head of the waiting queue it
came from (``requeue``), to be recomputed (prompt + output so far prefilled again; its stream
continues). A step that pre-empts admits no prompt. Pure Python (no torch).
"""

from __future__ import annotations

from collections import deque

from hetserve.planner.plan import HasRole
from hetserve.policies.batching import DEFAULT_BATCHING, Offer, compose_step, decode_share, kv_reservation
from hetserve.policies.kv_admission import (KV_ADMISSIONS, RunningKV, blocks_for, can_admit_paged, decode_growth,
                                            preemptions)
from hetserve.policies.kv_admission import requeue as requeue_at
from hetserve.policies.request_checks import can_hold
from hetserve.runtime.kv_cache import BlockManager
from hetserve.runtime.sequence import Sequence, Status


class ReplicaScheduler(HasRole):
    def __init__(self, replica_id: str, role: str, blocks: BlockManager, num_stages: int,
                 max_num_seqs: int = DEFAULT_BATCHING.max_batch,
                 max_batched_tokens: int = DEFAULT_BATCHING.token_budget,
                 prefill_mode: str = DEFAULT_BATCHING.prefill_mode, chunk_tokens: int = DEFAULT_BATCHING.chunk_tokens,
                 kv_admission: str = DEFAULT_BATCHING.kv_admission,
                 kv_watermark: float = DEFAULT_BATCHING.kv_watermark):
        if prefill_mode not in ("mixed", "chunked"):
            raise ValueError(f"the engine batches prompts 'mixed' or 'chunked', not {prefill_mode!r} "
                             "('prefill_first' is a simulator what-if)")
        if kv_admission not in KV_ADMISSIONS:
            raise ValueError(f"kv_admission must be one of {', '.join(KV_ADMISSIONS)}, got {kv_admission!r}")
        self.id = replica_id
        self.role = role
        self.blocks = blocks
        self.max_inflight = max(1, num_stages)
        self.max_num_seqs = max_num_seqs
        self.max_batched_tokens = max_batched_tokens
        self.prefill_mode = prefill_mode
        self.chunk_tokens = chunk_tokens
        self.paged = kv_admission == "paged"
        self.kv_watermark = kv_watermark
        self.num_preemptions = 0
        self.last_preempted: list[Sequence] = []  # pre-empted by the last ``next_step`` call
        self.prefilling: list[Sequence] = []  # chunked: admitted, prompt not all prefilled, admission order
        self._in_flight: set[int] = set()  # ids of the sequences of the steps in flight
        self.ready: deque[Sequence] = deque()  # holding KV here, waiting for their next decode step
        self.pinned: deque[Sequence] = deque()  # waiting requests placed on this replica at submission
        self.inflight: dict[int, list[Sequence]] = {}  # step id -> its sequences
        self.alive = True
        self.num_steps = 0
        self.last_batch_size = 0

    @property
    def chunked(self) -> bool:
        """Chunked prefill applies to a colocated replica: read from the role, which a re-plan or
        the death of a replica's partners may change while it serves."""
        return self.prefill_mode == "chunked" and self.role == "colocated"

    @property
    def num_running(self) -> int:
        return len(self.ready) + len(self._idle_prefilling()) + sum(len(v) for v in self.inflight.values())

    def _idle_prefilling(self) -> list[Sequence]:
        return [q for q in self.prefilling if q.id not in self._in_flight]

    def admission_tokens(self, seq: Sequence) -> int:
        # a re-run request (its replica died, or pre-empted) re-prefills what it had generated too
        if self.paged:
            return seq.prefill_tokens
        return kv_reservation(seq.prefill_tokens, seq.params.max_tokens - len(seq.output), self.serves_decode,
                              self.blocks.block_size)

    def handoff_tokens(self, seq: Sequence) -> int:
        """KV a decode replica takes for ``seq``'s hand-off: all it may hold, or (paged) what it brings."""
        return seq.num_cached if self.paged else seq.reserve_tokens

    def can_admit(self, tokens: int) -> bool:
        """Whether a sequence taking ``tokens`` tokens of KV is admitted into the pool now."""
        if not self.paged:
            return self.blocks.can_allocate(tokens)
        b = self.blocks
        return can_admit_paged(b.num_free_blocks, b.num_blocks, blocks_for(tokens, b.block_size), self.kv_watermark)

    def can_start_step(self) -> bool:
        return self.alive and len(self.inflight) < self.max_inflight

    def next_step(self, waiting: deque[Sequence]) -> list[Sequence]:
        """Sequences of the next step (empty: nothing to run). Admitted ones get their blocks."""
        self.last_preempted = []
        if not self.can_start_step():
            return []
        batch: list[Sequence] = []
        if self.serves_decode and self.ready:
            share = decode_share(self.num_running, self.max_inflight)
            for _ in range(min(len(self.ready), share, self.max_num_seqs)):
                batch.append(self.ready.popleft())
        if self.paged and batch:
            self._make_room(batch)
        decodes = len(batch)
        admitted: list[Sequence] = []
        idle = self._idle_prefilling() if self.chunked else []
        step = compose_step(*self._queue(waiting, admitted), token_budget=None if self.chunked else
                            self.max_batched_tokens, max_seqs=self.max_num_seqs, decodes=decodes,
                            seqs=decodes + len(self.prefilling) if self.chunked else decodes,
                            chunk_tokens=self.chunk_tokens if self.chunked else None,
                            prefilling=[q.prefill_end - q.num_cached for q in idle],
                            admit=self.serves_prefill and not self.last_preempted)
        if not self.chunked:
            return batch + admitted
        self.prefilling += admitted
        feeding = idle + admitted
        for q, c in zip(feeding, step.chunks):
            q.chunk = c
        return batch + feeding[:len(step.chunks)]

    def _queue(self, waiting: deque[Sequence], admitted: list[Sequence]):
        """``compose_step``'s view of the waiting requests: those placed here first, then the shared
        queue; ``take`` gives the head its blocks and appends it to ``admitted``."""
        def first() -> deque[Sequence] | None:
            if self.pinned:
                return self.pinned
            # the shared queue's head is left to another replica where this pool can never hold it
            # (paged admission would take it on its prompt alone, and it would stall when it outgrew the pool)
            if waiting and can_hold(self.blocks.capacity_tokens, waiting[0].prefill_tokens,
                                    waiting[0].params.max_tokens - len(waiting[0].output), self.serves_decode,
                                    self.blocks.block_size):
                return waiting
            return None

        def held(seq: Sequence) -> int:  # a choice forked from another holds the prompt's blocks here already
            return len(seq.table) * self.blocks.block_size if seq.replica == self.id else 0

        def head() -> Offer | None:
            queue = first()
            if queue is None:
                return None
            seq = queue[0]
            have = held(seq)
            return Offer(seq.prefill_tokens - have, self.can_admit(max(0, self.admission_tokens(seq) - have)))

        def take() -> None:
            seq = first().popleft()
            have = held(seq)
            seq.table = (seq.table if have else []) + self.blocks.allocate(max(0, self.admission_tokens(seq) - have))
            seq.replica, seq.num_cached, seq.status = self.id, have, Status.RUNNING
            seq.prefill_end, seq.chunk = seq.prefill_tokens, 0
            admitted.append(seq)

        return head, take

    def _make_room(self, batch: list[Sequence]) -> None:
        """Paged KV: give the step's decodes the blocks their tokens need, pre-empting (the shared
        rule, ``kv_admission.preemptions``) the latest-arrived idle sequences here until they fit.
        The pre-empted (``last_preempted``) hold nothing here any more; the coordinator puts them
        back in a waiting queue (``requeue``)."""
        bs = self.blocks.block_size
        in_step = {q.id for q in batch}
        idle = {q.id: q for q in [*batch, *self.ready, *self._idle_prefilling()]}
        running = [RunningKV(q.id, len(q.table), decode_growth(q.num_cached, bs) if q.id in in_step else 0)
                   for q in idle.values()]
        for sid in preemptions(running, self.blocks.num_free_blocks):
            seq = idle[sid]
            if seq in batch:
                batch.remove(seq)
            self.drop(seq)
            self.release(seq)
            seq.replica, seq.num_cached, seq.prefill_end, seq.chunk = None, 0, 0, 0
            seq.status = Status.WAITING
            seq.preemptions += 1
            self.last_preempted.append(seq)
        self.num_preemptions += len(self.last_preempted)
        for seq in list(batch):
            more = blocks_for(seq.num_cached + 1, bs) - len(seq.table)
            if more <= 0:
                continue
            if self.blocks.num_free_blocks < more:  # the rest is held by steps in flight: wait for them
                batch.remove(seq)
                self.ready.appendleft(seq)
                continue
            seq.table += self.blocks.allocate(more * bs)

    def chunk_done(self, seq: Sequence) -> bool:
        """After a step: whether ``seq`` finished its prefill (its token is its first output)."""
        if seq.prefilling:
            return False
        if seq in self.prefilling:
            self.prefilling.remove(seq)
        return True

    def start(self, step_id: int, batch: list[Sequence]) -> None:
        self.inflight[step_id] = batch
        self._in_flight.update(q.id for q in batch)
        self.num_steps += 1
        self.last_batch_size = len(batch)

    def complete(self, step_id: int) -> list[Sequence]:
        batch = self.inflight.pop(step_id)
        self._in_flight.difference_update(q.id for q in batch)
        return batch

    def release(self, seq: Sequence) -> None:
        """Give back the blocks ``seq`` holds here."""
        if seq.table:
            self.blocks.free(seq.table)
            seq.table = []
        if seq in self.prefilling:
            self.prefilling.remove(seq)

    def idle(self, seq: Sequence) -> bool:
        """Whether ``seq`` runs here and waits for its next step (not in a step in flight)."""
        return seq.id not in self._in_flight and (seq in self.ready or seq in self.prefilling)

    def drop(self, seq: Sequence) -> None:
        """Forget ``seq`` in every queue here (its blocks stay: ``release`` gives them back)."""
        for queue in (self.ready, self.pinned, self.prefilling):
            if seq in queue:
                queue.remove(seq)

    def clear(self, steps_only: bool = False) -> None:
        """Forget the steps in flight (their replica died, or turned colocated) and, unless
        ``steps_only``, every sequence queued here."""
        self.inflight.clear()
        self._in_flight.clear()
        if not steps_only:
            self.ready.clear()
            self.pinned.clear()
            self.prefilling.clear()

    def stats(self) -> dict:
        return {"role": self.role, "alive": self.alive, "running": self.num_running, "ready": len(self.ready),
                "waiting": len(self.pinned), "prefilling": len(self.prefilling),
                "inflight_steps": len(self.inflight), "batch_size": self.last_batch_size, "steps": self.num_steps,
                "preemptions": self.num_preemptions, "kv_used_blocks": self.blocks.num_used_blocks,
                "kv_total_blocks": self.blocks.num_blocks, "kv_usage": self.blocks.usage}


def requeue(queue: deque[Sequence], seq: Sequence) -> None:
    """Put a pre-empted ``seq`` back at the head of ``queue`` (the shared rule, ``kv_admission.requeue``)."""
    requeue_at(queue, seq, lambda q: q.id, lambda q: q.preemptions > 0)
