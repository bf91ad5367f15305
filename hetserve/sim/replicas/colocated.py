"""``ColocatedReplica``: a vLLM-style engine, prefill and decode on one replica.

Waiting prompts are taken at the running batch's next iteration boundary by the shared batching
rule (``policies.batching.compose_step``) and, per ``prefill_mode``: ride in that iteration
with the decodes ("mixed", the runtime's engine), run as a prompts-only step that pauses decoding
("prefill_first"), or ride along as chunks up to ``chunk_tokens`` per iteration ("chunked").
"""

from __future__ import annotations

from collections import deque
from typing import Callable

from hetserve.cost.analytic import PrefillBatch
from hetserve.cost.prefill_costs import StagePrompt, mixed_step_time
from hetserve.policies.base import ReplicaState
from hetserve.cost.layout import micro_batches_of
from hetserve.policies.batching import Offer, Step, compose_step
from hetserve.policies.kv_admission import requeue
from hetserve.sim.events import Priority
from hetserve.sim.hosts import on_host, pipeline_step_beside
from hetserve.sim.choices import prefill_batch
from hetserve.sim.replicas.decoding import Decoding
from hetserve.sim.replicas.snapshots import KEEP, live_state


class ColocatedReplica(Decoding):
    def __init__(self, env, index, spec, layout) -> None:
        super().__init__(env, index, spec, layout)
        self.waiting: deque[int] = deque()
        self.queued_tokens = 0
        self.mode = self.limits.prefill_mode
        self._chunking: list[list[int]] = []  # [rid, prompt tokens already prefilled]
        self._prefilling: list[int] = []  # the prompts of the prefill now running (unchunked)
        # A pipeline runs up to ``m`` steps at once (the runtime's ``ReplicaScheduler``: one per
        # micro-batch), so a prompt that finds a slot free starts at once in a step of its own,
        # beside the decoding micro-batches, instead of waiting for their iteration boundary.
        S = len(layout.stages)
        self._slots = min(S, micro_batches_of(self.limits.micro_batches, S)) if S > 1 and self.mode == "mixed" else 0
        self._beside: list[list[int]] = []  # prompts of the steps now running beside the decodes
        self._beside_ready: list[int] = []  # their first tokens are out: they join at the next boundary
        self._beside_end = 0.0  # when the last of them ends
        self._held = False  # the decodes wait behind them (paused from their boundary until they end)
        self._prompt_terms: list[StagePrompt] | None = None  # ``_stage_prompts``

    def _stage_prompts(self) -> list[StagePrompt]:
        """Each stage's prompt terms (``CostModel.stage_prompt``), asked once: a mixed step reads them."""
        if self._prompt_terms is None:
            self._prompt_terms = [self.cost.stage_prompt(s) for s in self.layout.stages]
        return self._prompt_terms

    def place(self, rid: int) -> None:
        self.waiting.append(rid)
        self.queued_tokens += self.kv.prefill_tokens(rid)
        self.pred_sum += self.req.pred[rid] * self.req.choices[rid]
        if self._admissible():
            if not self._start_beside():
                self._request_boundary()

    def _decoding_micro_batches(self) -> int:
        """The running sequences spread over at most ``m`` micro-batches (0 off a pipeline in "mixed" mode)."""
        return min(self._slots, self.batch.size)

    def _steps_in_flight(self) -> int:
        """Steps the runtime would have in flight now: the decoding micro-batches, a prompts-only or
        mixed step, the steps beside."""
        return self._decoding_micro_batches() + (1 if self._paused else 0) + len(self._beside)

    def _start_beside(self) -> bool:
        """A pipeline with a step slot free: the waiting prompts run now in a step of their own
        (the decoding micro-batches go on), as the runtime's scheduler starts one whenever fewer than
        ``m`` are in flight. Returns whether one started."""
        busy = self.batch.size or self._paused  # idle: the prompt starts at once the usual way
        if not self._slots or not busy or self._steps_in_flight() >= self._slots:
            return False
        rids, _ = self._take(self.limits.token_budget)
        if not rids:
            return False
        self._beside.append(rids)
        self._beside_end = max(self._beside_end, self._prompt_step(rids, self._on_beside_done))
        self._request_boundary()  # the decoding micro-batches share the host with it from their next iteration
        return True

    def _on_beside_done(self, rids: list[int]) -> None:
        self._beside.remove(rids)
        held = self._held and not self._beside
        if held:
            self._held = self._paused = False
        done = []
        for rid in rids:
            if not self.kv.made(rid):
                self.env.first_token(rid)
            if self.kv.made(rid) + 1 >= self.req.out[rid]:
                done.append(rid)
                self.kv.never_joins(rid)
            else:
                self._beside_ready.append(rid)
        self._finish_all(done)
        if held:
            self._after_boundary()
        elif self._beside_ready:
            self._request_boundary()

    def inflight(self) -> int:
        return super().inflight() + sum(map(len, self._beside)) + len(self._beside_ready)

    def busy_now(self) -> bool:
        return super().busy_now() or bool(self._beside)

    def _admissible(self) -> bool:
        if not self.waiting or self.admitted >= self.max_batch:
            return False
        return self.kv.admits(self.waiting[0])

    def _take(self, budget: int | None, decodes: int = 0, chunk_tokens: int | None = None) -> tuple[list[int], Step]:
        """Admit waiting prompts in order into a step of ``budget`` tokens carrying ``decodes`` decode
        rows, within the KV and the batch limit (``compose_step``, the runtime's rule); returns their
        ids and the step (with ``chunk_tokens``: chunks of the admitted prompts, older ones first)."""
        r, kv, taken = self.req, self.kv, []

        def head() -> Offer | None:
            if not self.waiting:
                return None
            rid = self.waiting[0]
            return Offer(kv.prefill_tokens(rid), kv.admits(rid), r.choices[rid])

        def take() -> None:
            rid = self.waiting.popleft()
            self.queued_tokens -= kv.prefill_tokens(rid)
            kv.admit(rid)
            self.admitted += r.choices[rid]
            if not kv.made(rid):  # a recompute keeps its first start
                r.t_start[rid] = self.loop.now
            taken.append(rid)

        left = [kv.prefill_tokens(rid) - done for rid, done in self._chunking] if chunk_tokens else ()
        step = compose_step(head, take, token_budget=budget, max_seqs=self.max_batch, decodes=decodes,
                            seqs=self.admitted, chunk_tokens=chunk_tokens, prefilling=left)
        return taken, step

    def _requeue(self, victims: list[int]) -> None:
        """Pre-empted requests go back to the head of the waiting queue (``kv_admission.requeue``, as
        the runtime's coordinator does), to be recomputed when admitted again."""
        gone = set(victims)
        for item in [it for it in self._chunking if it[0] in gone]:  # admitted prompts not prefilled yet
            self._chunking.remove(item)
            self.kv.drop_prefilling(item[0])  # type: ignore[union-attr]
            self.admitted -= self.req.choices[item[0]]
        for rid in victims:
            requeue(self.waiting, rid, int, self.req.made.__getitem__)  # type: ignore[arg-type]
            self.queued_tokens += self.kv.prefill_tokens(rid)

    def _prefilling_ids(self) -> list[int]:
        return [rid for rid, _ in self._chunking]

    def _admit(self) -> None:
        if self._admissible():
            self._request_boundary()

    def _after_boundary(self) -> None:
        for rid in self._beside_ready:
            self._join(rid)
        self._beside_ready.clear()
        if self._beside and self.batch.size:
            # The decoding micro-batch queues behind the prompt at every stage (each stage's worker
            # runs its steps first come, first served): it gains no token until the prompt is through.
            self._pause(self._beside_end)
            self._held = True
            return
        self._preempt()
        if self.mode != "prefill_first":
            if self._mixed_iteration():
                return
        else:
            rids, _ = self._take(self.limits.token_budget)
            if rids:
                self._prefilling = rids
                self._pause(self._prompt_step(rids, self._on_prefill_done))
                return
        self._start_segment()

    def _prompt_step(self, rids: list[int], on_done) -> float:
        """Run ``rids``' prompts in a step of their own (no decodes in it) as this host runs it;
        ``on_done(rids)`` at its end, which is returned. Prefill-first runs it with the decodes
        paused; a pipeline with a free micro-batch slot runs it beside them."""
        now = self.loop.now
        prompts = prefill_batch(self.req, rids, self.kv.shared)
        b = self.batch
        m = self._decoding_micro_batches()  # those it runs beside
        if m and self._shares_cores():
            dur = self._beside_decodes(prompts, b.size / m, b.context / m, m) + self.env.dispatch_wait(self, False)
        else:
            dur = self._on_host(self.cost.prefill_time(self.layout, prompts), decodes=False)
        end = now + dur
        if self.trace is not None:
            self.trace.append((now, end, (), tuple(rids)))
        self._busy(now, end)
        self.loop.schedule(end, Priority.WORK, on_done, rids)
        return end

    def _on_prefill_done(self, rids: list[int]) -> None:
        self._paused = False
        self._prefilling = []
        self._first_tokens(rids)
        self._after_boundary()

    # ------------------------------------------------------------------ mixed / chunked prefill
    def _mixed_iteration(self) -> bool:
        """One iteration carrying every running decode plus prompts: whole ones admitted within the
        token budget ("mixed"), or chunks of the admitted ones up to ``chunk_tokens`` ("chunked")."""
        if not self.waiting and not self._chunking:  # no prompt to carry (most boundaries)
            return False
        b = self.batch
        chunked = self.mode == "chunked"
        rids, step = self._take(None if chunked else self.limits.token_budget, b.size,
                                self.limits.chunk_tokens if chunked else None)
        self._chunking.extend([rid, 0] for rid in rids)
        if not self._chunking:
            return False
        chunks = list(zip(self._chunking, step.chunks))
        prompts = self._chunk_batch(chunks)
        m = self._decoding_micro_batches()
        if m > 1 and self._shares_cores():
            # the prompts ride in one micro-batch (its decodes as one-token rows), the others go on
            own, context = b.size / m, b.context / m
            mixed = PrefillBatch(own + prompts.num_seqs, own + prompts.tokens, own + 2.0 * context + prompts.sum_sq,  # type: ignore[arg-type]
                                 prompts.scored)
            dur = self._beside_decodes(mixed, own, context, m - 1) + self.env.dispatch_wait(self, True)
        else:
            # the decodes alone priced by the round this replica keeps per batch size
            alone = self._priced_at(b.size)[0].at(b.context) if b.size else 0.0
            dur = mixed_step_time(self.cost, self.layout, b.size, b.context, prompts, self.limits.micro_batches,
                                  False, alone, self._stage_prompts())
            dur = self._on_host(dur, decodes=b.size > 0)
        now = self.loop.now
        if self.trace is not None:
            self.trace.append((now, now + dur, tuple(b.members), tuple(item[0] for item, _ in chunks)))
        self._pause(now + dur)
        self._busy(now, now + dur)
        self.loop.schedule(now + dur, Priority.WORK, self._on_mixed_done, chunks)
        return True

    def _chunk_batch(self, chunks: list[tuple[list[int], int]]) -> PrefillBatch:
        """The prompt tokens of a mixed iteration: whole prompts as their choices feed them
        (``sim.choices``); a part of a prompt (chunked) as one sequence attending to what it has
        prefilled, scoring its share of the prompt's scored positions."""
        r, fed = self.req, self.kv.prefill_tokens
        if all(item[1] == 0 and c == fed(item[0]) for item, c in chunks):
            return prefill_batch(r, [item[0] for item, _ in chunks], self.kv.shared)
        tokens = sum(c for _, c in chunks)
        sum_sq = sum(c * c + 2.0 * c * item[1] for item, c in chunks)
        scored = sum(c * r.choices[rid] * (r.inp[rid] - 1) // fed(rid) for (rid, _), c in chunks if r.scored[rid])
        return PrefillBatch(len(chunks), tokens, sum_sq, scored)

    def _on_mixed_done(self, chunks: list[tuple[list[int], int]]) -> None:
        self._paused = False
        if self.batch.size:
            self._finish_all(self.batch.advance(1))
        finished = []
        for item, c in chunks:
            item[1] += c
            if item[1] >= self.kv.prefill_tokens(item[0]):
                finished.append(item[0])
        if finished:
            gone = set(finished)
            self._chunking = [it for it in self._chunking if it[0] not in gone]
            self._first_tokens(finished)
        self._after_boundary()

    def _not_started(self):
        for rid in self._prefilling:
            yield rid, 0
        for rids in self._beside:
            for rid in rids:
                yield rid, 0
        for rid in self._beside_ready:
            yield rid, 1
        for rid, _ in self._chunking:
            yield rid, 0
        for rid in self.waiting:
            yield rid, self.kv.made(rid)

    snapshots_kept = True

    def snapshot_clock(self, waits: bool = True):
        # the clock enters the snapshot through the running batch (tokens made, context), a paused
        # step (the prefill wait) and the oldest waiting prompt (its wait); without the waits only
        # through the batch, which a live snapshot reads when asked (``snapshot``)
        b = self.batch
        if waits:
            return KEEP if not self.waiting and not b.size and not b.active and not self._paused else None
        return KEEP

    def snapshot(self, waits: bool) -> ReplicaState:
        """Without the waits, a snapshot whose clock-bound figures (outstanding tokens, context) are
        worked out when a policy reads them, at that moment: it holds until the replica changes, so
        a fleet's running batches are not re-read at every arrival, and reads what ``state`` reads."""
        if waits:
            return self.state(False, True)
        fields = self.state_fields()
        fields["outstanding_floor"], fields["outstanding_drain"], progress = self.live_figures()
        return live_state(fields, progress, self.loop.loop)

    def deferred_load(self, waits: bool) -> int:
        return -1 if waits else self._queued_requests() + self.batch.size

    def live_figures(self) -> tuple[float, tuple[float, float, float] | None,
                                    Callable[[float], tuple[tuple[float, int], float]]]:
        return self._outstanding_floor(), self._outstanding_drain(), self._held_progress

    def _queued_requests(self) -> int:
        return len(self.waiting) + len(self._chunking)

    def _figures(self, done: int) -> tuple[float, int]:
        """(outstanding tokens, Σ context) once ``done`` iterations of the running segment are through."""
        b = self.batch
        outstanding = self.queued_tokens + (max(0.0, self.pred_sum - b.generated_after(done)) if b.size
                                            else self.pred_sum)
        return outstanding, b.context_after(done)

    def _progress(self) -> tuple[tuple[float, int], int]:
        """((outstanding tokens, Σ context), iterations done) now: the figures of ``state`` that move
        with the clock, and how many iterations of the running segment they count."""
        done = self.batch.iterations_done(self.loop.now)  # asked once: the tokens made and the context both follow from it
        return self._figures(done), done

    def _held_progress(self, now: float) -> tuple[tuple[float, int], float]:
        """``_progress``'s figures at ``now`` (the clock) and the time they hold until: surely not
        before the running batch's next iteration boundary (less far more than the batch's
        tolerance); for ever when idle."""
        b = self.batch
        if not b.active:
            return self._figures(0), float("inf")
        done, until = b.progress(now)
        return self._figures(done), until - 1e-9 * (until if until > 1.0 else 1.0)

    def state_fields(self) -> dict:
        """The snapshot's fields that hold until the replica changes (all but the waits and progress)."""
        return {"id": self.id, "role": "colocated", "queued_requests": self._queued_requests(),
                "running_requests": self.batch.size, "queued_prefill_tokens": self.queued_tokens,
                "kv_used_tokens": int(self.kv_used), "kv_capacity_tokens": int(self.kv_capacity),
                "requests": (), "capacity_norm": self.capacity_norm}

    def _outstanding_floor(self) -> float:
        """The outstanding tokens once the running segment is through (those now when none runs):
        no fewer until the replica changes (``ReplicaState.outstanding_floor``)."""
        b = self.batch
        return self._figures(b.k if b.active else 0)[0]

    def _outstanding_drain(self) -> tuple[float, float, float] | None:
        """``ReplicaState.outstanding_drain`` of the running segment (None when none runs): no
        iteration is shorter than its shortest, so by ``now`` at most ``(now - t0) / shortest`` of
        them are through, each taking ``size`` tokens off; ``t0`` and the rate are eased by 1e-9
        for the rounding of the iteration times (``DecodeBatch.progress``)."""
        b = self.batch
        if not b.active or not b.size:
            return None
        shortest = b.shortest_iteration()
        if shortest <= 0.0:
            return None
        tokens = self.queued_tokens + self.pred_sum - b.generated_after(0)
        return b.t0 - 1e-9 * (b.t0 if b.t0 > 1.0 else 1.0), tokens, b.size / shortest * (1.0 + 1e-9)

    def state(self, with_requests: bool = False, waits: bool = True) -> ReplicaState:
        now = self.loop.now
        (outstanding, context), _ = self._progress()
        if waits:
            wait, age = self._prefill_wait(), now - self.req.arrival[self.waiting[0]] if self.waiting else 0.0
        else:
            wait = age = 0.0
        f = self.state_fields()
        return ReplicaState(f["id"], "colocated", f["queued_requests"], f["running_requests"],
                            f["queued_prefill_tokens"], outstanding, context, f["kv_used_tokens"],
                            f["kv_capacity_tokens"], self._snapshot_requests(with_requests), self.capacity_norm,
                            wait, age)

    def _shares_cores(self) -> bool:
        """Whether this replica's workers share a host's cores (``sim.hosts`` set its ``host``)."""
        return getattr(self, "host", None) is not None

    def _beside_decodes(self, step: PrefillBatch, other_b: float, other_context: float, others: int) -> float:
        """A pipeline's step carrying prompts beside ``others`` decoding micro-batches, on a host
        sharing its cores: priced stage by stage (``sim.hosts.pipeline_step_beside``)."""
        return pipeline_step_beside(self.cost, self.layout, step, other_b, other_context, others,
                                    lambda workers: self.env.slowdown(self, workers))

    def _on_host(self, dur: float, decodes: bool) -> float:
        """A step's cost-model time as this host runs it: slowed by the cores it shares, and
        started once the serving front end has sent it (one rule for both kinds of step), and has
        streamed the tokens of the step's ``decodes`` before it."""
        return on_host(dur, self._collectives, self.env.slowdown(self)) + self.env.dispatch_wait(self, decodes)
