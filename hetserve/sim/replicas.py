"""Replica entities: they hold state; the simulator's policies decide; the cost model prices.

* ``PrefillReplica`` — a FIFO of prompts, batched up to a token budget and the KV it can hold;
  the stages of a pipeline overlap (batch n+1 enters stage 0 when batch n leaves it), hand-offs
  priced by ``CostModel.pp_handoff_time``. It keeps each prompt's KV until the decode side has
  pulled it.
* ``DecodeReplica`` — admits finished prefills in arrival order when their whole KV footprint
  (prompt + output) fits (requests wait, none is dropped), pulls their KV over the links, and
  runs them with continuous batching (``DecodeBatch``): one event per change of membership, not
  per token.
* ``ColocatedReplica`` — a vLLM-style engine: waiting prompts interrupt the running decode batch
  at its next iteration boundary (prefill first), or, with chunked prefill, ride along with
  decode iterations up to a token budget.

Times come only from the cost model: ``stage_prefill_time`` / ``prefill_time`` for prompts,
``decode_step_time`` for decode iterations, ``kv_transfer_pairs`` + links for KV.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from hetserve.cost.analytic import PrefillBatch
from hetserve.cost.layout import ReplicaLayout
from hetserve.planner.plan import PlanReplica
from hetserve.policies.base import ReplicaState, RunningRequest
from hetserve.sim.batch import DecodeBatch
from hetserve.sim.events import Priority

if TYPE_CHECKING:  # pragma: no cover
    from hetserve.sim.simulator import Simulator


class Replica:
    """What every replica keeps: identity, KV accounting, busy time."""

    def __init__(self, sim: "Simulator", index: int, spec: PlanReplica, layout: ReplicaLayout):
        self.sim, self.loop, self.cost, self.req = sim, sim.loop, sim.cost, sim.req
        self.index, self.id, self.role, self.layout = index, spec.id, spec.role, layout
        self.kv_capacity = float(self.cost.kv_capacity_tokens(layout))
        self.kv_used = 0.0
        self.kv_peak = 0.0
        self._kv_area = 0.0
        self._kv_t = 0.0
        self.busy_s = 0.0
        self._busy_until = 0.0
        self.served = 0
        self.capacity_norm = 1.0

    # ------------------------------------------------------------------ bookkeeping
    def _kv_add(self, tokens: float) -> None:
        now = self.loop.now
        self._kv_area += self.kv_used * (now - self._kv_t)
        self._kv_t = now
        self.kv_used += tokens
        if self.kv_used > self.kv_peak:
            self.kv_peak = self.kv_used

    def _busy(self, start: float, end: float) -> None:
        """Add [start, end) to the busy time (intervals may overlap; their union counts)."""
        lo = start if start > self._busy_until else self._busy_until
        if end > lo:
            self.busy_s += end - lo
        if end > self._busy_until:
            self._busy_until = end

    def kv_mean(self, end: float) -> float:
        area = self._kv_area + self.kv_used * max(0.0, end - self._kv_t)
        return area / end if end > 0 else 0.0

    def _can_hold(self, used: float, tokens: float) -> bool:
        # A request larger than the whole pool still runs once the pool is empty (never dropped).
        return used + tokens <= self.kv_capacity or used <= 0

    def state(self, with_requests: bool = False) -> ReplicaState:  # pragma: no cover - overridden
        raise NotImplementedError


# ============================================================================ prefill


class PrefillReplica(Replica):
    def __init__(self, sim, index, spec, layout):
        super().__init__(sim, index, spec, layout)
        self.queue: deque[int] = deque()
        self.queued_tokens = 0
        self.running = 0
        self.running_tokens = 0
        self._in_prefill: dict[int, None] = {}  # rids of the batches now running (snapshots only)
        self._free = [0.0] * len(layout.stages)  # when each stage can take the next batch
        self._kick_at: float | None = None
        self._stages = [(s, i == len(layout.stages) - 1) for i, s in enumerate(layout.stages)]

    def place(self, rid: int) -> None:
        self.queue.append(rid)
        self.queued_tokens += self.req.inp[rid]
        self._kick()

    def release(self, tokens: int) -> None:
        """The decode side has pulled ``tokens`` of KV: free them."""
        self._kv_add(-tokens)
        if self.queue:
            self._kick()

    def _kick(self) -> None:
        t = max(self.loop.now, self._free[0])
        if self._kick_at is None or t < self._kick_at:
            self._kick_at = t
            self.loop.schedule(t, Priority.SCHEDULE, self._on_kick, t)

    def _on_kick(self, t: float) -> None:
        if t != self._kick_at:
            return
        self._kick_at = None
        now = self.loop.now
        if now < self._free[0]:
            self._kick()
            return
        inp, budget = self.req.inp, self.sim.opts.token_budget
        lengths: list[int] = []
        rids: list[int] = []
        tokens = 0
        while self.queue:
            n = inp[self.queue[0]]
            if rids and tokens + n > budget:
                break
            if not self._can_hold(self.kv_used + tokens, n) and not (not rids and self.kv_used <= 0):
                break
            rid = self.queue.popleft()
            rids.append(rid)
            lengths.append(n)
            tokens += n
        if not rids:
            return  # blocked on KV; ``release`` kicks again
        self.queued_tokens -= tokens
        self.running += len(rids)
        self.running_tokens += tokens
        self._kv_add(tokens)
        batch = PrefillBatch.of(lengths)
        t = now
        stages = self.layout.stages
        for i, (stage, last) in enumerate(self._stages):
            start = t if t > self._free[i] else self._free[i]
            end = start + self.cost.stage_prefill_time(stage, batch, last)
            self._free[i] = end
            t = end if last else end + self.cost.pp_handoff_time(stage, stages[i + 1], tokens)
        self._busy(now, t)
        for rid in rids:
            self.req.t_start[rid] = now
            self._in_prefill[rid] = None
        self.loop.schedule(t, Priority.WORK, self._on_done, (rids, tokens))
        if self.queue:
            self._kick()

    def _on_done(self, arg: tuple[list[int], int]) -> None:
        rids, tokens = arg
        self.running -= len(rids)
        self.running_tokens -= tokens
        self.served += len(rids)
        for rid in rids:
            del self._in_prefill[rid]
            self.sim.prefill_done(rid, self)

    def state(self, with_requests: bool = False) -> ReplicaState:
        reqs = ()
        if with_requests:
            r = self.req
            reqs = tuple(RunningRequest(rid, r.inp[rid], 0, r.pred[rid], 0.0, started=False)
                         for rid in (*self._in_prefill, *self.queue))
        return ReplicaState(self.id, "prefill", len(self.queue), self.running, self.queued_tokens,
                            float(self.queued_tokens + self.running_tokens), 0, int(self.kv_used), 0,
                            reqs, self.capacity_norm)


# ============================================================================ decode (shared)


class _Decoding(Replica):
    """Continuous batching with iteration boundaries on demand (shared by decode and colocated)."""

    def __init__(self, sim, index, spec, layout):
        super().__init__(sim, index, spec, layout)
        mb = sim.opts.micro_batches
        step = self.cost.decode_step_time
        self.batch = DecodeBatch(lambda b, c: step(layout, b, c, mb))
        self.max_batch = sim.max_batch
        self.admitted = 0  # holding a KV reservation and not finished
        self._version = 0
        self._next: float | None = None  # time of the boundary event now scheduled
        self._paused = False  # a prefill (or mixed iteration) is running; boundaries wait for it
        self.pred_sum = 0.0  # Σ predicted output of admitted requests
        # kv_admission="paged" (vLLM): KV grows with the context; overflow pre-empts the newest request
        self.paged = sim.opts.kv_admission == "paged"
        self._kv_held = 0.0  # paged: KV of admitted requests outside the batch (prefilling, KV inbound)
        self._g0: dict[int, int] = {}  # paged: tokens a re-joining request had made before pre-emption
        self.preempted: list[tuple[int, int]] = []  # paged: (rid, tokens made) waiting to recompute
        self.preemptions = 0

    def _request_boundary(self) -> None:
        """Stop the running segment at its next iteration boundary (or wake an idle replica)."""
        if self._paused:
            return
        b, now = self.batch, self.loop.now
        if b.active:
            j = b.boundary_at_or_after(now)
            t, prio = b.t0 + b.elapsed(j), Priority.WORK
        else:
            j, t, prio = 0, now, Priority.SCHEDULE
        if self._next is not None and self._next <= t:
            return
        self._version += 1
        self._next = t
        self.loop.schedule(t, prio, self._on_boundary, (self._version, j))

    def _pause(self) -> None:
        """A prefill (or mixed iteration, or recompute) starts at a boundary: decoding waits for it,
        and a boundary event already scheduled (e.g. by an admission a moment ago) is void — the
        pause's own end re-runs ``_after_boundary``."""
        self._paused = True
        self._version += 1
        self._next = None

    def _on_boundary(self, arg: tuple[int, int]) -> None:
        version, j = arg
        if version != self._version:
            return
        self._next = None
        b = self.batch
        if b.active:
            self._busy(b.t0, self.loop.now)
            if self.paged:  # the pool is fullest just before the finishing requests leave
                self._kv_add(self._kv_held + b.c0 + j * b.size - self.kv_used)
            self._finish_all(b.advance(j))
        self._after_boundary()

    def _start_segment(self) -> None:
        if self.batch.size == 0:
            return
        limit = self._make_room() if self.paged else None
        end = self.batch.start(self.loop.now, limit)
        self._version += 1
        self._next = end
        self.loop.schedule(end, Priority.WORK, self._on_boundary, (self._version, self.batch.k))

    def _join(self, rid: int) -> None:
        r = self.req
        if r.t_join[rid] != r.t_join[rid]:  # NaN: first time (a re-join keeps it: ATGT counts the stall)
            r.t_join[rid] = self.loop.now
        if self.paged:
            g = self._g0.get(rid, 1)
            self._kv_held -= r.inp[rid] + g
            self.batch.add(rid, r.inp[rid] + g, r.out[rid] - g, r.inp[rid] + r.out[rid])
        else:
            self.batch.add(rid, r.inp[rid] + 1, r.out[rid] - 1, r.inp[rid] + r.out[rid])

    def _finish_all(self, rids: list[int]) -> None:
        r = self.req
        for rid in rids:
            if self.paged:
                self._g0.pop(rid, None)
            else:
                self._kv_add(-(r.inp[rid] + r.out[rid]))
            self.admitted -= 1
            self.pred_sum -= r.pred[rid]
            self.served += 1
            self.sim.finished(rid)
        if self.paged:
            self._kv_sync()
        if rids:
            self._admit()

    # ------------------------------------------------------------------ KV admission modes
    def _need(self, rid: int) -> float:
        """KV to reserve when admitting ``rid``: prompt + whole output ("reserve"), or the prompt and
        its first token ("paged": the rest grows one token per iteration)."""
        return self.req.inp[rid] + (1 if self.paged else self.req.out[rid])

    def _kv_base(self) -> float:
        """KV an admission must fit beside: what is reserved ("reserve"), or the most the pool will
        hold before the running segment ends ("paged"), so no admission makes the segment overflow."""
        if not self.paged:
            return self.kv_used
        b = self.batch
        # plus vLLM's watermark (1 % of the pool) so an admission does not pre-empt at once
        return self._kv_held + (b.c0 + b.k * b.size if b.active else b.context) + 0.01 * self.kv_capacity

    def _hold(self, tokens: float) -> None:
        """Reserve KV for an admitted request."""
        if self.paged:
            self._kv_held += tokens
            self._kv_sync()
        else:
            self._kv_add(tokens)

    def _kv_sync(self) -> None:
        """Paged: set ``kv_used`` to what the pool holds now."""
        b = self.batch
        ctx = b.context + b.iterations_done(self.loop.now) * b.size if b.active else b.context
        self._kv_add(self._kv_held + ctx - self.kv_used)

    def _make_room(self) -> int | None:
        """Paged, at a boundary: iterations the batch can run before the pool overflows; when not
        even one fits, pre-empt the newest request (vLLM's recompute pre-emption) until it does.
        A lone request larger than the pool runs anyway (nothing is dropped)."""
        b, r = self.batch, self.req
        while True:
            free = self.kv_capacity - self._kv_held - b.context
            if free >= b.size:
                return int(free // b.size)
            if b.size <= 1:
                return None
            rid = max(b.members)  # the latest arrival goes first (vLLM pre-empts from the back)
            gen = b.iteration - b.members[rid] + self._g0.get(rid, 1)
            b.remove(rid, r.inp[rid] + gen)
            self.admitted -= 1
            self.preemptions += 1
            self.preempted.append((rid, gen))
            self._kv_sync()

    def _recompute_fits(self) -> bool:
        if not self.preempted or self.admitted >= self.max_batch:
            return False
        rid, gen = min(self.preempted)
        # room for the request and one more iteration of the batch it re-joins (no instant re-pre-emption)
        return self._can_hold(self._kv_base() + self.batch.size + 1, self.req.inp[rid] + gen)

    def _recompute(self) -> bool:
        """Paged, at a boundary: re-prefill pre-empted requests (prompt + tokens made so far), oldest
        first, as one prefill that pauses decoding; they re-join when it ends. False: none fits."""
        if not self._recompute_fits():
            return False
        r, take, tokens = self.req, [], 0
        self.preempted.sort()
        while self._recompute_fits():
            rid, gen = self.preempted[0]
            n = r.inp[rid] + gen
            if take and tokens + n > self.sim.opts.token_budget:
                break
            self.preempted.pop(0)
            self._g0[rid] = gen
            self.admitted += 1
            self._hold(n)
            take.append(rid)
            tokens += n
        now = self.loop.now
        dur = self.cost.prefill_time(self.layout, PrefillBatch.of([r.inp[i] + self._g0[i] for i in take]))
        self._pause()
        self._busy(now, now + dur)
        self.loop.schedule(now + dur, Priority.WORK, self._on_recomputed, take)
        return True

    def _on_recomputed(self, rids: list[int]) -> None:
        self._paused = False
        for rid in rids:
            self._join(rid)
        self._after_boundary()

    def _admit(self) -> None:  # pragma: no cover - overridden
        pass

    def _after_boundary(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def _generated_sum(self) -> float:
        return self.batch.generated(self.loop.now)

    def _requests(self) -> tuple[RunningRequest, ...]:
        """Per-request views for policies that ask for them (``needs_requests``): the running batch
        (``decode_time_s`` = time since joining it, the time ATGT counts), then the requests placed
        here that are not running yet (``started=False``: waiting for prefill, KV or a slot)."""
        b, r, now = self.batch, self.req, self.loop.now
        it = b.iteration + b.iterations_done(now)
        out = []
        for rid, joined in b.members.items():
            gen = it - joined + 1
            out.append(RunningRequest(rid, r.inp[rid], gen, self.sim.repredict(rid, gen), now - r.t_join[rid]))
        for rid, gen in self._not_started():
            dt = now - r.t_join[rid]  # a pre-empted request has been decoding; others: NaN -> 0
            out.append(RunningRequest(rid, r.inp[rid], gen, self.sim.repredict(rid, gen), dt if dt == dt else 0.0,
                                      started=False))
        for rid, gen in self.preempted:
            out.append(RunningRequest(rid, r.inp[rid], gen, self.sim.repredict(rid, gen), now - r.t_join[rid],
                                      started=False))
        return tuple(out)

    def _not_started(self):  # pragma: no cover - overridden
        """(rid, tokens generated so far) of the requests placed here and not in the batch."""
        return ()

    def _context_now(self) -> int:
        b = self.batch
        return int(b.context + b.iterations_done(self.loop.now) * b.size) if b.active else int(b.context)


# ============================================================================ decode


class DecodeReplica(_Decoding):
    def __init__(self, sim, index, spec, layout):
        super().__init__(sim, index, spec, layout)
        self.waiting: deque[tuple[int, "PrefillReplica"]] = deque()
        self.pending: list[int] = []  # KV arrived, joining at the next boundary
        self._inbound: dict[int, None] = {}  # admitted, not yet in the batch (KV on the way or pending)

    def enqueue(self, rid: int, src: PrefillReplica) -> None:
        """A finished prefill routed here: admit when its KV fits, then pull the KV."""
        self.waiting.append((rid, src))
        self.pred_sum += self.req.pred[rid]
        self._admit()

    def _admit(self) -> None:
        if self.preempted:  # pre-empted requests come back first
            if self._recompute_fits():
                self._request_boundary()
            return
        while self.waiting and self.admitted < self.max_batch:
            rid, src = self.waiting[0]
            need = self._need(rid)
            if not self._can_hold(self._kv_base(), need):
                break
            self.waiting.popleft()
            self._hold(need)
            self.admitted += 1
            self._inbound[rid] = None
            self.sim.start_kv(rid, src, self)

    def kv_arrived(self, rid: int) -> None:
        self.pending.append(rid)
        self._request_boundary()

    def _after_boundary(self) -> None:
        if self.paged and self._recompute():
            return
        for rid in self.pending:
            del self._inbound[rid]
            self._join(rid)
        self.pending.clear()
        self._start_segment()
        if self.paged:
            self._admit()  # the segment's end is known now: room for more?

    def _not_started(self):
        for rid in self._inbound:
            yield rid, 1  # the first token came with the prefill
        for rid, _ in self.waiting:
            yield rid, 1

    def state(self, with_requests: bool = False) -> ReplicaState:
        b = self.batch
        queued = len(self.waiting) + self.admitted - b.size + len(self.preempted)
        outstanding = max(0.0, self.pred_sum - self._generated_sum()) if b.size else self.pred_sum
        return ReplicaState(self.id, "decode", queued, b.size, 0, outstanding, self._context_now(),
                            int(self.kv_used), int(self.kv_capacity),
                            self._requests() if with_requests else (), self.capacity_norm)


# ============================================================================ colocated


class ColocatedReplica(_Decoding):
    """Prefill and decode on one replica: prefill interrupts decode (or chunks ride along)."""

    def __init__(self, sim, index, spec, layout):
        super().__init__(sim, index, spec, layout)
        self.waiting: deque[int] = deque()
        self.queued_tokens = 0
        self.chunked = sim.opts.chunked_prefill
        self._chunking: list[list[int]] = []  # [rid, prompt tokens already prefilled]
        self._prefilling: list[int] = []  # the prompts of the prefill now running (unchunked)

    def place(self, rid: int) -> None:
        self.waiting.append(rid)
        self.queued_tokens += self.req.inp[rid]
        self.pred_sum += self.req.pred[rid]
        if self._admissible():
            self._request_boundary()

    def _admissible(self) -> bool:
        if self.preempted or not self.waiting or self.admitted >= self.max_batch:
            return False
        return self._can_hold(self._kv_base(), self._need(self.waiting[0]))

    def _take(self, budget: int) -> list[int]:
        """Admit waiting prompts in order within ``budget`` tokens, KV and the batch limit."""
        r, taken, tokens = self.req, [], 0
        while self._admissible():
            rid = self.waiting[0]
            if taken and tokens + r.inp[rid] > budget:
                break
            self.waiting.popleft()
            self.queued_tokens -= r.inp[rid]
            self._hold(self._need(rid))
            self.admitted += 1
            r.t_start[rid] = self.loop.now
            taken.append(rid)
            tokens += r.inp[rid]
        return taken

    def _admit(self) -> None:
        if self._admissible() or self._recompute_fits():
            self._request_boundary()

    def _after_boundary(self) -> None:
        if self.paged and self._recompute():
            return
        if self.chunked:
            if self._mixed_iteration():
                return
        else:
            rids = self._take(self.sim.opts.token_budget)
            if rids:
                now = self.loop.now
                dur = self.cost.prefill_time(self.layout, PrefillBatch.of([self.req.inp[i] for i in rids]))
                self._pause()
                self._prefilling = rids
                self._busy(now, now + dur)
                self.loop.schedule(now + dur, Priority.WORK, self._on_prefill_done, rids)
                return
        self._start_segment()

    def _on_prefill_done(self, rids: list[int]) -> None:
        self._paused = False
        self._prefilling = []
        self._first_tokens(rids)
        self._after_boundary()

    def _first_tokens(self, rids: list[int]) -> None:
        r = self.req
        done = []
        for rid in rids:
            self.sim.first_token(rid, self)
            if r.out[rid] <= 1:
                done.append(rid)
                if self.paged:  # never joins: its prompt's KV goes now
                    self._kv_held -= r.inp[rid] + 1
            else:
                self._join(rid)
        self._finish_all(done)

    # ------------------------------------------------------------------ chunked prefill
    def _mixed_iteration(self) -> bool:
        """One iteration carrying every running decode plus prompt chunks up to the token budget."""
        budget = self.sim.opts.chunk_tokens
        b = self.batch
        self._chunking.extend([rid, 0] for rid in self._take(1 << 62))
        if not self._chunking:
            return False
        if self.paged and b.size:
            self._make_room()  # room for this iteration's decode tokens
        r = self.req
        left = max(1, budget - b.size)
        chunks, sum_sq, tokens = [], 2.0 * b.context, b.size
        for item in self._chunking:
            if left <= 0:
                break
            rid, done = item
            c = min(r.inp[rid] - done, left)
            chunks.append((item, c))
            sum_sq += c * c + 2.0 * c * done
            tokens += c
            left -= c
        pb = PrefillBatch(b.size + len(chunks), tokens, sum_sq)
        dur = self.cost.prefill_time(self.layout, pb)
        if b.size:
            dur = max(dur, self.cost.decode_step_time(self.layout, b.size, b.context, self.sim.opts.micro_batches))
        now = self.loop.now
        self._pause()
        self._busy(now, now + dur)
        self.loop.schedule(now + dur, Priority.WORK, self._on_mixed_done, chunks)
        return True

    def _on_mixed_done(self, chunks: list[tuple[list[int], int]]) -> None:
        self._paused = False
        if self.batch.size:
            self._finish_all(self.batch.advance(1))
        finished = []
        for item, c in chunks:
            item[1] += c
            if item[1] >= self.req.inp[item[0]]:
                finished.append(item[0])
        if finished:
            gone = set(finished)
            self._chunking = [it for it in self._chunking if it[0] not in gone]
            self._first_tokens(finished)
        self._after_boundary()

    def _not_started(self):
        for rid in self._prefilling:
            yield rid, 0
        for rid, _ in self._chunking:
            yield rid, 0
        for rid in self.waiting:
            yield rid, 0

    def state(self, with_requests: bool = False) -> ReplicaState:
        b = self.batch
        queued = len(self.waiting) + len(self._chunking) + len(self.preempted)
        outstanding = self.queued_tokens + (max(0.0, self.pred_sum - self._generated_sum()) if b.size
                                            else self.pred_sum)
        return ReplicaState(self.id, "colocated", queued, b.size, self.queued_tokens, outstanding,
                            self._context_now(), int(self.kv_used), int(self.kv_capacity),
                            self._requests() if with_requests else (), self.capacity_norm)
