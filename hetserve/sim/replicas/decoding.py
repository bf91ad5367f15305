"""``Decoding``: continuous batching with iteration boundaries on demand (decode and colocated).

The running requests are a ``DecodeBatch`` (one event per change of membership, not per token).
Whatever must happen between iterations (admissions, a prefill, a pre-emption) asks for the next
iteration boundary (``_request_boundary``); the subclass's ``_after_boundary`` decides what runs
next. KV admission is a strategy object (``self.kv``, see ``kv.py``).
"""

from __future__ import annotations

from hetserve.policies.base import RunningRequest
from hetserve.cost.decode import DecodeRound
from hetserve.cost.layout import micro_batches_of
from hetserve.sim.batch import DecodeBatch
from hetserve.sim.events import Priority
from hetserve.sim.hosts import on_host
from hetserve.sim.replicas.base import Replica
from hetserve.sim.replicas.columns import Columns, RequestColumns, columns
from hetserve.sim.replicas.kv import make_kv_admission


class Decoding(Replica):
    def __init__(self, env, index, spec, layout) -> None:
        super().__init__(env, index, spec, layout)
        self._slow = 1.0  # host contention on the running segment (env.slowdown at its start)
        self._wait = 0.0  # the front end's dispatch wait per iteration (env.dispatch_wait at its start)
        # the wait and (one micro-batch in flight: ``_meeting``) the TP collectives' fixed cost are not
        # computing: host contention does not stretch them
        self._collectives = sum(self.cost.collectives_time(s) for s in layout.stages)
        # batch size -> (its decode round, ``_meeting`` of it): what ``_step_time`` reads of the batch
        # size, which the replica's layout and limits fix (at most ``max_batch`` entries)
        self._priced: dict[int, tuple[DecodeRound, float]] = {}
        self.batch = DecodeBatch(self._step_time)
        self.max_batch = self.limits.max_batch
        self.admitted = 0  # sequences (a request's choices each) holding KV and not finished
        self._version = 0
        self._next: float | None = None  # time of the boundary event now scheduled
        self._paused = False  # a prefill (or mixed iteration) is running; boundaries wait for it
        self._paused_until = 0.0  # when the running prefill (mixed iteration, recompute) ends
        self.pred_sum = 0.0  # Σ predicted output of admitted requests, all their choices
        # ``env.repredict``'s last answer per request listed here (``_columns``): it changes only
        # when asked with ``generated`` ≥ it, and only this replica asks while a request is here;
        # a request leaving (finished, pre-empted) is forgotten, so one coming back is asked again
        self._preds: dict[int, float] = {}
        self.kv = make_kv_admission(self, self.limits.paged)
        # When a list: (start, end, decode rids, prompt rids) per iteration, in order (tests compare
        # it step by step with the runtime's coordinator trace).
        self.trace: list[tuple[float, float, tuple[int, ...], tuple[int, ...]]] | None = None
        # with ``trace``: (index of the next iteration in ``trace``, ids pre-empted, latest first)
        self.preempt_trace: list[tuple[int, tuple[int, ...]]] = []

    def _step_time(self, batch: int, context: float) -> float:
        """One decode iteration of ``batch`` sequences reading ``context`` tokens as this host runs it:
        the cost model's ``decode_step_time`` (its round at the batch, priced at the context) with
        the front end's wait, stretched by host contention but for ``_meeting``."""
        round_, meeting = self._priced_at(batch)
        return on_host(round_.at(context, self._wait / self._slow), meeting, self._slow)

    def _priced_at(self, batch: int) -> tuple[DecodeRound, float]:
        """(the cost model's decode round of ``batch`` sequences, ``_meeting`` of it), kept per batch size."""
        priced = self._priced.get(batch)
        if priced is None:
            priced = self._priced[batch] = (self.cost.decode_round(self.layout, batch, self.limits.micro_batches),
                                            self._meeting(batch))
        return priced

    def _meeting(self, batch: int) -> float:
        """The part of a decode iteration of ``batch`` sequences that host contention does not
        stretch: the TP collectives' fixed cost while one micro-batch computes (its members meet;
        nothing of the replica computes beside them). With two or more micro-batches in flight the
        other stages compute beside a TP group's collectives, and its members wait for cores too.
        Left unstretched there, an asymmetric pipeline's token interval with two sequences is
        predicted short while one sequence's is right."""
        stages = len(self.layout.stages)
        if stages > 1 and min(stages, micro_batches_of(self.limits.micro_batches, stages), batch) > 1:
            return 0.0
        return self._collectives

    @property
    def preemptions(self) -> int:
        return self.kv.preemptions

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

    def _pause(self, until: float) -> None:
        """A prefill (or mixed iteration, or recompute) starts at a boundary and runs until
        ``until``: decoding waits for it, and a boundary event already scheduled (e.g. by an
        admission a moment ago) is void — the pause's own end re-runs ``_after_boundary``."""
        self._paused = True
        self._paused_until = until
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
            if self.trace is not None:
                members = tuple(b.members)
                self.trace.extend((b.t0 + b.elapsed(i), b.t0 + b.elapsed(i + 1), members, ())
                                  for i in range(j))
            self.kv.at_boundary(j)
            self._finish_all(b.advance(j))
        self._after_boundary()

    def _start_segment(self) -> None:
        if self.batch.size == 0:
            return
        limit = self.kv.segment_limit()
        self._slow = self.env.slowdown(self)
        self._wait = self.env.dispatch_wait(self)
        end = self.batch.start(self.loop.now, limit)
        self._version += 1
        self._next = end
        self.loop.schedule(end, Priority.WORK, self._on_boundary, (self._version, self.batch.k))

    def _join(self, rid: int) -> None:
        r = self.req
        if r.t_join[rid] != r.t_join[rid]:  # NaN: first time (a re-join keeps it: ATGT counts the stall)
            r.t_join[rid] = self.loop.now
        g = self.kv.join(rid)
        self.batch.add(rid, r.inp[rid] + g, r.out[rid] - g, r.inp[rid] + r.out[rid], r.choices[rid])

    def _finish_all(self, rids: list[int]) -> None:
        r = self.req
        for rid in rids:
            self.kv.finish(rid)
            self.admitted -= r.choices[rid]
            self.pred_sum -= r.pred[rid] * r.choices[rid]
            self._preds.pop(rid, None)
            self.served += 1
            self.env.finished(rid)
        self.kv.after_finish()
        if rids:
            self._admit()

    def _preempt(self) -> None:
        """At a boundary, before anything is admitted: make room for the next iteration's KV."""
        victims = self.kv.make_room(self._prefilling_ids())
        if victims:
            for rid in victims:
                self._preds.pop(rid, None)
            if self.trace is not None:
                self.preempt_trace.append((len(self.trace), tuple(victims)))
            self._requeue(victims)

    def _prefilling_ids(self) -> list[int]:
        """Admitted prompts not yet in the batch that a pre-emption may take back (chunked prefill)."""
        return []

    def _requeue(self, victims: list[int]) -> None:  # pragma: no cover - overridden
        """Send pre-empted requests (latest arrival first) where they are recomputed."""
        raise NotImplementedError

    def _first_tokens(self, rids: list[int]) -> None:
        """``rids``' prefills (or recomputes) sampled a token: each joins the batch, or ends with it."""
        r, kv = self.req, self.kv
        done = []
        for rid in rids:
            made = kv.made(rid)
            if not made:
                self.env.first_token(rid)
            if made + 1 >= r.out[rid]:
                done.append(rid)
                kv.never_joins(rid)
            else:
                self._join(rid)
        self._finish_all(done)

    def _admit(self) -> None:  # pragma: no cover - overridden
        pass

    def _after_boundary(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def reprice(self) -> None:
        """Cut the running segment at its next iteration boundary; the next segment is priced with
        the host as it is then (``sim.hosts.HostContention.changed``)."""
        if self.batch.active:
            self._request_boundary()

    def busy_now(self) -> bool:
        return self.batch.active or self._paused

    def inflight(self) -> int:
        return self.batch.size + len(getattr(self, "_chunking", ())) + len(getattr(self, "_prefilling", ()))

    def step_rate(self) -> tuple[float, float]:
        return self.pending_step_rate() if self.batch.active else (0.0, 0.0)

    def pending_step_rate(self) -> tuple[float, float]:
        """Between segments the batch is stopped: the next one runs about as fast as the last
        did, at the batch's size now (0 before its first segment)."""
        b = self.batch
        return (1.0 / b.a, b.size / b.a) if b.a > 0 and b.size > 0 else (0.0, 0.0)

    def _requests(self) -> tuple[RunningRequest, ...]:
        """Per-request views for policies that ask for them (``needs_requests``): the running batch
        (``decode_time_s`` = time since joining it, the time ATGT counts), then the requests placed
        here that are not running yet (``started=False``: waiting for prefill, KV or a slot)."""
        b, r, now, env = self.batch, self.req, self.loop.now, self.env
        it = b.iteration + b.iterations_done(now)
        out = []
        for rid, joined in b.members.items():
            gen = it - joined + 1
            out.append(RunningRequest(rid, r.inp[rid], gen, env.repredict(rid, gen), now - r.t_join[rid]))
        for rid, gen in self._not_started():
            dt = now - r.t_join[rid]  # a pre-empted request has been decoding; others: NaN -> 0
            out.append(RunningRequest(rid, r.inp[rid], gen, env.repredict(rid, gen), dt if dt == dt else 0.0,
                                      started=False))
        return tuple(out)

    def _columns(self) -> Columns:
        """``_requests`` as ``Columns``: the same figures, ``env.repredict`` asked (``_preds``)
        wherever its answer could differ from the last one."""
        b, r, now, ask = self.batch, self.req, self.loop.now, self.env.repredict
        it1 = b.iteration + b.iterations_done(now) + 1
        ids = list(b.members)
        gens = [it1 - joined for joined in b.members.values()]
        m = len(ids)
        for rid, gen in self._not_started():
            ids.append(rid)
            gens.append(gen)
        known = self._preds
        preds = list(map(known.get, ids))
        for k, (p, gen) in enumerate(zip(preds, gens)):
            if p is None or gen >= p:  # asked where ``_requests`` would change the answer, in order
                preds[k] = known[ids[k]] = ask(ids[k], gen)
        return columns(ids, r.inp, gens, preds, r.t_join, now, m)  # type: ignore[arg-type]

    def _not_started(self):  # pragma: no cover - overridden
        """(rid, tokens generated so far) of the requests placed here and not in the batch."""
        return ()

    def _prefill_wait(self) -> float:
        """Seconds until a prefill could start here: the rest of the prefill (mixed iteration,
        recompute) now running, or of the decode iteration now running (prefill waits for its
        boundary); 0 when idle."""
        now, b = self.loop.now, self.batch
        if self._paused:
            return max(0.0, self._paused_until - now)
        if b.active:
            return max(0.0, b.t0 + b.elapsed(b.boundary_at_or_after(now)) - now)
        return 0.0

    def _snapshot_requests(self, with_requests: bool):
        return RequestColumns(self._requests, self._columns, self.loop) if with_requests else ()
