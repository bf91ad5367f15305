"""Host contention: CPU worker slots sharing a host's cores, and the serving front end beside them.

A cluster file may say that a machine's worker slots share ``cpu_cores`` cores (the CPU demo: four
"GPUs" on a 2-core box), and, with ``cpu_host``, that several machines' slots share one host's
(``demo-tiny``'s two boxes emulated on one computer). Work a replica starts there runs ``slowdown`` times slower than alone —
its computing part: the TP collectives' fixed cost is members waiting for each other and is not
stretched (``on_host``):

    k = the workers computing on the host now (this replica's, the other busy replicas', the front end's share)
    slowdown = max(k / c, 1 + (s − 1)(k − 1), 1)        (c cores, s the measured slow-down per extra worker)

*Workers computing now* counts the stages that can be busy at once: a replica of S stages with
``m`` micro-batches in flight keeps ``min(S, m)`` stages busy, and ``m`` is at most its running
sequences (one sequence is one micro-batch), so a pipeline decoding one request keeps one stage
busy, not all of them (counting every stage over-predicts a lightly loaded pipeline's TTFT and
TPOT by about a fifth), and a lone
micro-batch keeps busy the TP group of the stage it computes on, weighted by the time it spends
there (``computing_tp``: 1.16 workers on that plan, not the stages' mean TP of 1.5).

*A pipeline's prompt step beside its decoding micro-batches* is priced stage by stage
(``pipeline_step_beside``): on each stage the prompt shares the cores with the other micro-batches'
work on the other stages, for as long as that work lasts, rather than with every stage's workers
for the whole step. And with two or more micro-batches in flight the TP collectives are stretched
too (``Decoding._meeting``): the other stages compute beside a TP group's meeting.

*The front end* (the coordinator, the HTTP/SSE server and, as ``hetserve compare`` and
``predict/run`` run it, the replaying client: one Python process) also computes on the host: it
spends ``frontend_request_cpu_s`` CPU seconds per request (HTTP, tokenisation, placement),
``frontend_step_cpu_s`` per engine step (the coordinator takes the result, schedules and sends the
next step) and ``frontend_token_cpu_s`` per output token (its SSE event, the client's parse).
It joins ``k`` with its utilisation ``u ≤ 1`` (one process): 1 while it works off the requests that
arrived (each adds its CPU seconds to a backlog), plus the step and token rates of the decoding
replicas now times their costs. ``hetserve calibrate`` measures both costs (the CPU time of the
process that serves and replays its HTTP probes); both default to 0, and nothing of this applies
to devices without ``cpu_cores`` (GPUs), so the planner's and GPU simulations are unchanged.

*The front end is also one serial server* (one GIL): a replica's next step is dispatched through
it (the transport's reader thread, the coordinator, the sender thread), so whenever other work holds
the GIL the step waits. ``dispatch_wait`` charges each step a replica starts
``frontend_dispatch_s × min(1, u_other)``, ``u_other`` the front end's utilisation by work that is
not the replica's own: the requests' recent rate and the other replicas' steps and tokens. The
replica's own tokens are streamed while its next step computes, in phase, and ``stream_overhead_s``
prices them per sequence; each decoding step also waits their fixed part, ``stream_step_overhead_s``.
``hetserve calibrate``'s GIL probe measures ``frontend_dispatch_s`` and its HTTP decode probes the
stream's two parts. Both waits apply on any host (the GIL is not the cores) wherever they are set;
they default to 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hetserve.cost.layout import micro_batches_of

# the window (s) over which the front end's request rate is taken: a few arrivals at the rates served here
REQUEST_WINDOW_S = 0.5


@dataclass(frozen=True)
class FrontEndCost:
    """CPU the serving front end spends (seconds; ``hetserve calibrate`` measures them)."""

    request_cpu_s: float = 0.0  # per request: HTTP request, tokenisation, placement, stream set-up
    step_cpu_s: float = 0.0  # per engine step: the coordinator takes the result, schedules, sends the next
    token_cpu_s: float = 0.0  # per output token: its handle, the SSE event, the client's parse
    # seconds a replica's next step waits for the front end (one GIL) per unit of the front end's
    # utilisation by other work: the GIL's dispatch delay (``hetserve calibrate`` measures it)
    dispatch_s: float = 0.0
    # seconds a decoding step's tokens take the front end to stream beyond their per-sequence cost
    # (the step's fixed part of the SSE events): the replica's next step waits for it
    stream_step_s: float = 0.0

    def __post_init__(self) -> None:
        if min(self.request_cpu_s, self.step_cpu_s, self.token_cpu_s, self.dispatch_s, self.stream_step_s) < 0:
            raise ValueError("front-end CPU costs must be non-negative")

    @property
    def zero(self) -> bool:
        return self.request_cpu_s == 0 and self.step_cpu_s == 0 and self.token_cpu_s == 0


def on_host(seconds: float, waiting: float, slowdown: float) -> float:
    """A cost-model time as a host sharing its cores runs it: the computing part stretched by the
    slow-down, ``waiting`` (the TP collectives' fixed cost: members meeting, not computing) not.
    Members waiting in a collective hold no core: stretching that wait too over-predicts a TP
    group's TPOT on a shared host by about a fifth."""
    if seconds < waiting:  # at most ``seconds`` (as ``min`` picks)
        waiting = seconds
    return (seconds - waiting) * slowdown + waiting


def pipeline_step_beside(cost, layout, prompts, other_b: float, other_context: float, others: int,
                         slowdown) -> float:
    """A pipeline's step carrying ``prompts`` beside ``others`` decoding micro-batches of ``other_b``
    sequences (``other_context`` tokens) each, as a host sharing its cores runs it, priced stage by
    stage. On stage i the step computes with that stage's TP group while each other micro-batch
    computes on the other stages, for at most its own time there; ``slowdown(k)`` is the host's
    factor with ``k`` of the replica's workers computing. Before stage i the step waits for an other
    micro-batch that holds that stage's worker (each worker runs its steps in turn): it is there
    ``d_i / cycle`` of the time (``cycle``: its way round all stages) and has half of ``d_i`` left on
    average, so the step waits ``d_i² / (2 · cycle)`` there (``_residual_wait``), not ``d_i / 2`` —
    that priced the other micro-batch as sitting on every stage the step reaches.

    Priced stage by stage rather than as one step with every stage's worker busy throughout
    (``busy_workers``), which over-prices a prompt step beside decodes by a quarter or more on an
    asymmetric pipeline (``bench/predict`` measures both against served steps)."""
    stages = layout.stages
    last = len(stages) - 1
    p = [cost.stage_prefill_time(s, prompts, i == last) for i, s in enumerate(stages)]
    d = [cost.stage_decode_time(s, other_b, other_context, i == last) for i, s in enumerate(stages)]
    total = 0.0
    for i, stage in enumerate(stages):
        beside = sum(stages[j].tp * min(1.0, d[j] / p[i]) for j in range(len(stages)) if j != i) if p[i] > 0 else 0.0
        total += on_host(p[i], cost.collectives_time(stage), slowdown(stage.tp + others * beside))
        total += others * _residual_wait(d, i)
        if i < last:
            total += cost.pp_handoff_time(stage, stages[i + 1], prompts.tokens)
    return total


def _residual_wait(stage_times: list[float], i: int) -> float:
    """What a step reaching stage ``i`` at a random moment waits there for one other micro-batch that
    goes round the stages taking ``stage_times`` on each: it is on stage ``i`` for that share of its
    cycle, with half of its time there left on average."""
    cycle = sum(stage_times)
    return stage_times[i] ** 2 / (2 * cycle) if cycle > 0 else 0.0


def busy_workers(rep, micro_batches: int | None) -> float:
    """Worker processes of ``rep`` computing at once: the busy stages' TP groups. A replica of S
    stages keeps ``min(S, micro-batches, sequences in flight)`` stages busy: every one with S micro-batches
    in flight, fewer at the TP its micro-batches compute on (``computing_tp``)."""
    stages = rep.layout.stages
    S = len(stages)
    if S == 1:
        return float(stages[0].tp)
    inflight = rep.inflight()
    m = max(1, min(S, micro_batches_of(micro_batches, S), inflight))
    if m >= S:
        return float(sum(s.tp for s in stages))
    return min(float(len(rep.layout.devices)), m * rep.computing_tp())


def computing_tp(cost, layout) -> float:
    """The TP degree of the stage a lone micro-batch computes on, averaged over its way round the
    stages by the time it computes on each (a one-sequence decode; the collectives' fixed cost is
    waiting, ``on_host``). A TP-2 stage of 2 layers before a TP-1 stage of 6 keeps about 1.2
    workers busy, where the mean over stages says 1.5: the lone micro-batch spends most of its
    time on the longer stage."""
    stages = layout.stages
    last = len(stages) - 1
    t = [max(0.0, cost.stage_decode_time(s, 1, 1, i == last) - cost.collectives_time(s)) for i, s in enumerate(stages)]
    total = sum(t)
    if total <= 0:
        return sum(s.tp for s in stages) / len(stages)
    return sum(s.tp * x for s, x in zip(stages, t)) / total


class HostContention:
    """Who computes on each host with ``cpu_cores`` (replicas and the front end) and the slow-down
    that gives the work a replica starts now. One per simulation."""

    def __init__(self, replicas, cluster, loop, contention_slowdown: float = 1.0,
                 frontend: FrontEndCost | None = None, micro_batches: int | None = None):
        self.loop, self.s, self.micro_batches = loop, contention_slowdown, micro_batches
        self.frontend = frontend or FrontEndCost()
        self.on_host: dict[str, list] = {}
        self.cores: dict[str, int] = {}
        for rep in replicas:
            dev = cluster.devices[rep.layout.devices[0]]
            if dev.cpu_cores is None:
                continue
            rep.host = dev.cpu_host
            self.cores[dev.cpu_host] = dev.cpu_cores
            self.on_host.setdefault(dev.cpu_host, []).append(rep)
        # The front end runs beside the first replica of the plan (the CLI serves from there); only
        # a host with CPU worker slots feels it.
        first = cluster.devices[replicas[0].layout.devices[0]] if replicas else None
        self.frontend_host = first.cpu_host if first is not None and first.cpu_cores is not None else None
        self._backlog_until = 0.0  # when the front end has worked off the requests that arrived
        self.replicas = list(replicas)
        # the requests' CPU of the last REQUEST_WINDOW_S (decaying): the front end's request rate
        self._req_work, self._req_t = 0.0, 0.0

    def on_arrival(self) -> None:
        """A request reached the replicas (after the request overhead): its per-request CPU joins the
        front end's backlog from now, not from the HTTP arrival: the front end's per-request work
        (the stream's set-up, the first token's event) overlaps the prompt's prefill."""
        if self.frontend.request_cpu_s <= 0:
            return
        now = self.loop.now
        self._backlog_until = max(now, self._backlog_until) + self.frontend.request_cpu_s
        self._req_work = self._req_work * math.exp((self._req_t - now) / REQUEST_WINDOW_S) + self.frontend.request_cpu_s
        self._req_t = now

    def changed(self, rep) -> None:
        """``rep`` started or ended a piece of work on its host: every other replica there re-prices
        what it is running (a decode segment, from its next iteration boundary), so the slow-down
        follows who computes beside it instead of staying what it was when the segment started. A
        decode segment runs until its next finish or join, hundreds of ms: on the prefill-decode plan
        a prefill starting beside a running segment (30 ms) was never felt by it, nor its end."""
        host = getattr(rep, "host", None)
        if host is None:
            return
        for other in self.on_host[host]:
            if other is not rep:
                other.reprice()

    def dispatch_wait(self, rep, decodes: bool = True) -> float:
        """Seconds ``rep``'s next step waits for the front end: ``dispatch_s`` times the front end's
        utilisation by work that is not ``rep``'s own (the requests' recent rate, the other
        replicas' steps and tokens), at most 1, plus, where the step ``decodes``, ``stream_step_s``: its
        own tokens are streamed per sequence while its next step computes
        (calibration's ``stream_overhead_s`` prices that), but each step's events also cost a fixed
        part first. Calibration measures it as the intercept of served − engine TPOT over the batch
        sizes: 0.9-1.8 ms on the CPU demo, where the slope is 0.04-0.06 ms per sequence. A prompt
        step's first token is the request overhead's (``request_overhead_s``). On a pipeline the
        wait is on the ring's latency, which a second micro-batch hides
        (``CostModel.decode_step_time``)."""
        fe = self.frontend
        stream = fe.stream_step_s if decodes else 0.0
        if fe.dispatch_s <= 0:
            return stream
        now = self.loop.now
        u = self._req_work * math.exp((self._req_t - now) / REQUEST_WINDOW_S) / REQUEST_WINDOW_S
        for r in self.replicas:
            if r is not rep:
                steps, tokens = r.step_rate()
                u += fe.step_cpu_s * steps + fe.token_cpu_s * tokens
        return fe.dispatch_s * min(1.0, u) + stream

    def frontend_load(self, rep=None) -> float:
        """The front end's utilisation now (0..1): its request backlog, plus the decoding replicas'
        steps and tokens per second times the CPU each costs it. ``rep``, the replica whose work is
        being priced, counts at the rate its next steps run (``Replica.pending_step_rate``): at
        the start of its segment its batch is not running yet, and counted as idle, the front end's
        work for its own steps would never slow them (a one-replica pipeline near saturation would
        be predicted faster than served)."""
        if self.frontend_host is None or self.frontend.zero:
            return 0.0
        u = 1.0 if self._backlog_until > self.loop.now else 0.0
        fe = self.frontend
        if fe.token_cpu_s > 0 or fe.step_cpu_s > 0:
            for reps in self.on_host.values():
                for r in reps:
                    steps, tokens = r.pending_step_rate() if r is rep else r.step_rate()
                    u += fe.step_cpu_s * steps + fe.token_cpu_s * tokens
        return min(1.0, u)

    def slowdown(self, rep, own_workers: float | None = None) -> float:
        """Factor on the work ``rep`` starts now (1 off CPU worker slots); ``own_workers``: ``rep``'s
        own workers computing then, where the caller counts them (``pipeline_step_beside``)."""
        host = getattr(rep, "host", None)
        if host is None:
            return 1.0
        mb = self.micro_batches
        k = busy_workers(rep, mb) if own_workers is None else own_workers
        k += sum(busy_workers(o, mb) for o in self.on_host[host] if o is not rep and o.busy_now())
        if host == self.frontend_host:
            k += self.frontend_load(rep)
        return max(k / self.cores[host], 1.0 + (self.s - 1.0) * (k - 1.0), 1.0)
