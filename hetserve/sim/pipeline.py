"""A pipeline replica simulated stage by stage, its activations on the shared links.

``SimOptions(pipeline="detailed")`` uses this for decode and colocated replicas with two or more
stages. It is the view MoLink needs: decode activations (small, latency-critical) and prefill
activations / KV (bulk) cross the same links, so the transmission policy decides who waits.

Model (vLLM-style pipeline with virtual engines):

* the running requests are split into ``m`` micro-batch groups (``SimOptions.micro_batches``,
  default the number of stages); a new request joins the group with the fewest requests;
* a group cycles round the ring: stage 0 → … → last stage (tokens sampled: first tokens and
  finished requests are recorded here) → token ids back to stage 0, which starts its next iteration.
  Each stage runs one item at a time, first come first served; an item's time is the cost model's
  ``stage_decode_time`` (or ``stage_prefill_time`` for a prefill item, which interrupts that
  group's decoding: vLLM runs a group's new prompts before its next decode step);
* between stages, ``tokens · hidden · dtype`` bytes of activations go over the fastest device pair
  of the two stages (the pair ``pp_handoff_time`` would use) as a ``decode`` or ``prefill``
  message; the token ids go back as a ``decode`` message of 4 bytes per sequence;
* KV admission is as in ``DecodeReplica``/``ColocatedReplica`` (the whole footprint reserved).

Each group's members are a ``DecodeBatch`` (finish heap, aggregate context), so an iteration
costs O(stages + finishing requests), not O(batch). Events: one per stage per micro-batch per
iteration plus one per message — use it where link contention is the question.
"""

from __future__ import annotations

from collections import deque

from hetserve.cost.analytic import PrefillBatch
from hetserve.cost.layout import micro_batches_of
from hetserve.policies.aladdin_constraints import AladdinConstraints
from hetserve.policies.base import DecodeTiming, ReplicaState, RunningRequest
from hetserve.policies.batching import Offer, compose_step, kv_reservation
from hetserve.policies.transmission import next_decode_return, round_trip_time
from hetserve.sim.batch import DecodeBatch
from hetserve.sim.events import Priority
from hetserve.sim.replicas.base import Replica
from hetserve.sim.replicas.columns import Columns, KeptColumns, columns

TOKEN_ID_BYTES = 4


class _Group:
    __slots__ = ("batch", "prefill", "joins", "in_flight", "item")

    def __init__(self):
        self.batch = DecodeBatch(lambda b, c: 0.0)  # used for membership only
        self.prefill: list[int] = []  # admitted prompts awaiting this group's next iteration
        self.joins: list[int] = []  # KV arrived (decode role): join at the next launch
        self.in_flight = False
        self.item = None

    @property
    def load(self) -> int:
        return self.batch.size + len(self.prefill) + len(self.joins)


class _Item:
    """One micro-batch iteration travelling round the ring."""

    __slots__ = ("group", "kind", "prefill", "size", "context", "tokens")

    def __init__(self, group: int, kind: str, prefill: list[int], size: int, context: float, tokens: int):
        self.group, self.kind, self.prefill = group, kind, prefill
        self.size, self.context, self.tokens = size, context, tokens


class PipelineReplica(Replica):
    def __init__(self, env, index, spec, layout) -> None:
        super().__init__(env, index, spec, layout)
        S = len(layout.stages)
        m = micro_batches_of(self.limits.micro_batches, S)
        self.groups = [_Group() for _ in range(m)]
        self.max_batch = self.limits.max_batch
        self.admitted = 0
        self._inbound: dict[int, None] = {}  # decode: admitted, KV not yet arrived
        self.waiting: deque = deque()  # colocated: rid; decode: (rid, src)
        self.queued_tokens = 0
        self.pred_sum = 0.0
        self._queue: list[deque] = [deque() for _ in range(S)]
        self._busy_stage = [False] * S
        self._exec: list[tuple[float | None, float]] = [(None, 0.0)] * S  # (start, duration) of the decode item running per stage
        self._done_at: list[list[float | None]] = [[None] * m for _ in range(S)]  # per stage, when each group's latest decode item finished
        net = env.network
        self._hops = []
        nb = 1e6
        for s in range(S):
            a, b = layout.stages[s], layout.stages[(s + 1) % S]
            d, e = min(((d, e) for d in a.devices for e in b.devices), key=lambda p: self.cost.p2p_time(*p, nb))  # type: ignore[call-arg]
            link = net.link(d, e)
            link.decode_timing = (lambda now, s=s: self._timing(s, now))
            self._hops.append((d, e))
        self._hop_links = [self.cost.cluster.link(d, e) for d, e in self._hops]  # (latency s, bytes/s)
        self._act_bytes = env.activation_bytes  # per token

    # ------------------------------------------------------------------ admission
    def place(self, rid: int) -> None:  # colocated
        self.waiting.append(rid)
        self.queued_tokens += self.req.inp[rid]
        self.pred_sum += self.req.pred[rid]
        self._admit()

    def enqueue(self, rid: int, src) -> None:  # decode
        self.waiting.append((rid, src))
        self.pred_sum += self.req.pred[rid]
        self._admit()

    def _admit(self) -> None:
        r = self.req
        while self.waiting and self.admitted < self.max_batch:
            head = self.waiting[0]
            rid = head if self.role == "colocated" else head[0]
            need = self._need(rid)
            if not self.can_hold(self.kv_used, need):
                break
            self.waiting.popleft()
            self.kv_add(need)
            self.admitted += 1
            if self.role == "colocated":
                self.queued_tokens -= r.inp[rid]
                r.t_start[rid] = self.loop.now
                g = self._least_loaded()
                self.groups[g].prefill.append(rid)
                self._launch(g)
            else:
                self._inbound[rid] = None
                self.env.start_kv(rid, head[1], self)

    def _need(self, rid: int) -> int:
        return kv_reservation(self.req.inp[rid], self.req.out[rid], True, self.limits.block_size)

    def kv_arrived(self, rid: int) -> None:
        self._inbound.pop(rid, None)
        g = self._least_loaded()
        self.groups[g].joins.append(rid)
        self._launch(g)

    def _least_loaded(self) -> int:
        return min(range(len(self.groups)), key=lambda i: (self.groups[i].load, i))

    # ------------------------------------------------------------------ the ring
    def _launch(self, g: int) -> None:
        grp = self.groups[g]
        if grp.in_flight:
            return
        r = self.req
        for rid in grp.joins:
            r.t_join[rid] = self.loop.now
            grp.batch.add(rid, r.inp[rid] + 1, r.out[rid] - 1, r.inp[rid] + r.out[rid])
        grp.joins.clear()
        if grp.prefill:
            take: list[int] = []
            step = compose_step(lambda: Offer(r.inp[grp.prefill[0]], True) if grp.prefill else None,
                                lambda: take.append(grp.prefill.pop(0)), token_budget=self.limits.token_budget,
                                max_seqs=self.max_batch, decodes=0, seqs=0)
            item = _Item(g, "prefill", take, len(take), 0.0, step.prompt_tokens)
        elif grp.batch.size:
            item = _Item(g, "decode", [], grp.batch.size, grp.batch.context, grp.batch.size)
        else:
            return
        grp.in_flight = True
        self._arrive(0, item)

    def _arrive(self, s: int, item: _Item) -> None:
        self._queue[s].append(item)
        if not self._busy_stage[s]:
            self._start(s)

    def _start(self, s: int) -> None:
        item = self._queue[s].popleft()
        stage = self.layout.stages[s]
        last = s == len(self.layout.stages) - 1
        now = self.loop.now
        if item.kind == "prefill":
            lens = [self.req.inp[i] for i in item.prefill]
            dur = self.cost.stage_prefill_time(stage, PrefillBatch.of(lens), last)
            self._exec[s] = (None, 0.0)
        else:
            dur = self.cost.stage_decode_time(stage, item.size, item.context, last)
            self._exec[s] = (now, dur)
        self._busy_stage[s] = True
        self._busy(now, now + dur)
        self.loop.schedule(now + dur, Priority.WORK, self._done, (s, item))

    def _done(self, arg) -> None:
        s, item = arg
        now = self.loop.now
        self._busy_stage[s] = False
        if item.kind == "decode":
            self._exec[s] = (None, 0.0)
            self._done_at[s][item.group] = now
        if self._queue[s]:  # the stage takes its next item as this one's output leaves
            self._start(s)
        S = len(self.layout.stages)
        d, e = self._hops[s]
        if s < S - 1:
            nbytes = item.tokens * self._act_bytes
            self.env.network.send(item.kind, [(d, e, nbytes)], lambda _t, item=item, s=s: self._arrive(s + 1, item))  # type: ignore[misc]
        else:  # sampled: tokens reach the user now; the ids go back round for the next iteration
            self._tokens(item)
            self.env.network.send("decode", [(d, e, TOKEN_ID_BYTES * item.size)],
                                  lambda _t, g=item.group: self._relaunch(g))  # type: ignore[misc]

    def _tokens(self, item: _Item) -> None:
        grp = self.groups[item.group]
        r = self.req
        if item.kind == "prefill":
            done = []
            for rid in item.prefill:
                self.env.first_token(rid)
                if r.out[rid] <= 1:
                    done.append(rid)
                else:
                    r.t_join[rid] = self.loop.now
                    grp.batch.add(rid, r.inp[rid] + 1, r.out[rid] - 1, r.inp[rid] + r.out[rid])
            self._finish_all(done)
        else:
            self._finish_all(grp.batch.advance(1))

    def _relaunch(self, g: int) -> None:
        self.groups[g].in_flight = False
        self._launch(g)

    def _finish_all(self, rids: list[int]) -> None:
        r = self.req
        for rid in rids:
            self.kv_add(-self._need(rid))
            self.admitted -= 1
            self.pred_sum -= r.pred[rid]
            self.served += 1
            self.env.finished(rid)
        if rids:
            self._admit()

    def busy_now(self) -> bool:
        return any(self._busy_stage)

    # ------------------------------------------------------------------ MoLink's view
    def _timing(self, s: int, now: float) -> DecodeTiming:
        start, dur = self._exec[s]
        back = next_decode_return([(t_p, self._round_trip(g)) for g, t_p in enumerate(self._done_at[s])
                                   if t_p is not None and self.groups[g].in_flight and self.groups[g].batch.size])
        return DecodeTiming(start, dur, *back) if back else DecodeTiming(start, dur)

    def _round_trip(self, g: int) -> float:
        """T_o + T_m of MoLink §4.2 for group ``g`` as it is now: its decode compute on every
        stage plus its activations (token ids on the closing hop) over every hop of the ring,
        priced by the cost model and the links — what the paper adds to t_p in case 3."""
        batch = self.groups[g].batch
        size = max(1, batch.size)
        ctx = batch.context if batch.size else 0.0
        stages = self.layout.stages
        times = [self.cost.stage_decode_time(st, size, ctx, i == len(stages) - 1) for i, st in enumerate(stages)]
        lat = [la for la, _ in self._hop_links]
        bw = [b for _, b in self._hop_links]
        return round_trip_time(times, lat, bw, self._act_bytes, TOKEN_ID_BYTES, size)

    # ------------------------------------------------------------------ snapshot
    def state(self, with_requests: bool = False, waits: bool = True) -> ReplicaState:
        running = sum(g.batch.size for g in self.groups)
        queued = len(self.waiting) + sum(len(g.prefill) + len(g.joins) for g in self.groups)
        generated = sum(g.batch.size * (g.batch.iteration + 1) - g.batch.join_sum for g in self.groups)
        ctx = int(sum(g.batch.context for g in self.groups))
        return ReplicaState(self.id, self.role, queued, running, self.queued_tokens,
                            self.queued_tokens + max(0.0, self.pred_sum - generated), ctx,
                            int(self.kv_used), int(self.kv_capacity),
                            self._views(running + queued) if with_requests else (), self.capacity_norm)

    def _views(self, listed: int):
        """The views as of now: ``Columns`` where there are many (Aladdin's threshold), else the
        objects, cheaper to build for a few."""
        if listed + len(self._inbound) < AladdinConstraints.columns_from:
            return self._requests()
        return KeptColumns(self._columns())

    def _requests(self) -> tuple[RunningRequest, ...]:
        """As ``_Decoding._requests``: running members (decode time since joining), then the rest."""
        r, now, env = self.req, self.loop.now, self.env
        out = []
        for g in self.groups:
            for rid, joined in g.batch.members.items():
                gen = g.batch.iteration - joined + 1
                out.append(RunningRequest(rid, r.inp[rid], gen, env.repredict(rid, gen), now - r.t_join[rid]))
        first = 1 if self.role == "decode" else 0  # decode replicas get prompts already prefilled
        rest = [rid for g in self.groups for rid in (*g.prefill, *g.joins)] + list(self._inbound)
        rest += [w if self.role == "colocated" else w[0] for w in self.waiting]
        out += [RunningRequest(rid, r.inp[rid], first, env.repredict(rid, first), 0.0, started=False) for rid in rest]
        return tuple(out)

    def _columns(self) -> Columns:
        """``_requests`` as ``Columns``: the same figures, and ``env.repredict`` asked the same."""
        r, now, ask = self.req, self.loop.now, self.env.repredict
        ids: list[int] = []
        gens: list[int] = []
        for g in self.groups:
            it1 = g.batch.iteration + 1
            ids += g.batch.members
            gens += [it1 - joined for joined in g.batch.members.values()]
        m = len(ids)
        first = 1 if self.role == "decode" else 0
        ids += [rid for g in self.groups for rid in (*g.prefill, *g.joins)] + list(self._inbound)
        ids += [w if self.role == "colocated" else w[0] for w in self.waiting]
        gens += [first] * (len(ids) - m)
        preds = [ask(rid, gen) for rid, gen in zip(ids, gens)]
        c = columns(ids, r.inp, gens, preds, r.t_join, now, m)
        if len(ids) > m:  # waiting ones: no decode time here
            c.dec_time[m:] = 0.0
        return c
