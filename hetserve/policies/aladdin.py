"""Aladdin placement: best-fit online bin packing under SLO constraints, with re-balancing.

Paper: ``aladdin-slo-placement-scaling.md`` §4.2 (constraints (b)–(e), Algorithm 1) and §4.3
(Algorithm 2). A worker (replica) is a bin; a request is packed into the *fullest* worker — ranked
by ``capacity_norm``, the L2 norm of its batch size and its γ-weighted context — on which every
constraint still holds after adding it:

(b) ATGT: Σ_r (l_in + γ-weighted output) ≤ θ · l_d(b), with l_d(b) the decode-context limit of
    Eq. 4 for the batch size b after adding the request. γ ∈ [0, 1] is the strictness knob:
    γ = 0 checks only the first decode iteration, γ = 1 the last one. A running request that has
    already generated more than γ·prediction counts with what it holds now.
(c) TTFT: the wait for the prefill (or decode iteration) now running, ``prefill_wait_s``, plus the
    prefill batches of the queued prompts up to and including the one the new prompt joins
    (``token_budget`` prompt tokens to a batch, each priced by Eq. 2) ≤ TTFT SLO — for the new
    prompt and for the queued prompts it joins (it lengthens their batch): the oldest has already
    waited ``queued_age_s``, so the sum plus that age must fit the target too.
(d) prefill preempts decode (colocated workers only): t_pre(queued + l_in) ≤ θ · min_r slack_r,
    slack_r = ATGT·(l_gen,r − 1) − t_dec,r, the decode time request r has saved against its ATGT
    budget so far (t_dec: ``RunningRequest.decode_time_s``, time since it joined the batch; r over
    every request on the worker, waiting ones included). This literal rule is the default: a
    worker whose requests have just started takes no prompt, so prompts spread. ``project_slack``
    adds the saving still to come at the current iteration speed, (ATGT − t_iter)·(remaining
    predicted tokens); it packs tighter but spends savings before they exist: on the Azure trace
    at 10 req/s 5 % of requests then miss ATGT by ≤ 3 %, at every pool size
    (docs/experiments/aladdin_figures.md).
(e) KV over time: each request's footprint grows by one token per iteration until its
    (predicted) end, then drops to zero; the sum must stay within the KV pool at every future
    iteration. The peak is at t = 0 or just before some request ends, so it is checked there
    (sort + prefix sums, O(n log n) per worker).

When no worker is feasible Algorithm 1 opens a new bin; a fixed pool cannot, and
``stats["overflow"]`` counts the request (capacity planning reads that). The paper does not say
where it goes then. Under load it is nearly always (d) that fails everywhere — every worker holds a
request that has just joined and saved nothing yet — so the request goes, among the workers where
only (d) fails, to the one whose requests lose the least saved time to its prefill (the smallest
overdraft of (d): "the prefill time of new requests can not exceed the time that ongoing requests
have saved compared with the ATGT limit", §4.2 — exceeded where it is exceeded least); to the least
loaded worker when (b), (c) or (e) fail everywhere too. Sending every overflow to the least loaded
worker (``overflow="least_loaded"``, the earlier rule) stacks a burst's prompts on the worker with
the least context, one stall after another on the same short requests: on the bursty Azure trace at
15 req/s every ATGT miss of Aladdin's was a request stalled by 1–9 such prompts
(docs/experiments/aladdin_figures.md). When no
candidate has any constraint (prefill workers and no TTFT target) there is no bin to fill: the
request goes to the least loaded worker too (``stats["unbounded"]``) — packing would pile every
prompt on one worker.

Re-balancing (Algorithm 2), online: each worker carries an output-length error (l^e, b^e) —
requests that outlived their prediction (re-predicted by the predictor; they also enter the
constraints with the new prediction), requests that finished early (from ``on_finish``), and the
moves made so far. After best fit picks worker x, the request moves to the feasible worker y that
most reduces Σ_i |k2·l^e_i + c2·b^e_i| / √(k2² + c2²) (the distance of each worker's error line,
Eq. 4, from the origin), if any does. Ledger entries expire after ``error_ttl`` placements
(``policies.aladdin_rebalance.ErrorLedger``).

Cost per decision: each worker is first screened on its totals (batch size, context and queued
prompt tokens: lower bounds of what (b) sums, and (c) exactly); only a worker that passes gets its
per-request view. An overloaded worker — whose queue is what grows — is ruled out in O(1), so a
decision costs O(workers) plus the views of the workers still open, and a simulation stays linear
in requests under overload.

Coefficients come from ``hetserve.cost.fitted.PerformanceModel`` per replica: fitted from
measurements, or from the analytic cost model (``models_from_cost``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from hetserve.cost.fitted import PerformanceModel
from hetserve.policies.aladdin_models import models_from_cost  # noqa: F401  (re-exported)
from hetserve.policies.aladdin_rebalance import ErrorLedger
from hetserve.policies.base import ReplicaState, RequestInfo
from hetserve.policies.predictor import OutputPredictor
from hetserve.specs.workload import SLO

CONSTRAINTS = ("atgt", "ttft", "preempt", "kv")


@dataclass(frozen=True)
class Check:
    """Which constraints hold for one (request, worker) pair."""

    atgt: bool = True
    ttft: bool = True
    preempt: bool = True
    kv: bool = True

    @property
    def ok(self) -> bool:
        return self.atgt and self.ttft and self.preempt and self.kv


@dataclass
class _View:
    """Per-request arrays of one worker (the new request not included)."""

    l_in: np.ndarray
    gen: np.ndarray
    pred: np.ndarray  # predicted total output (re-predicted when outlived)
    started: np.ndarray
    dec_time: np.ndarray
    under_l: float  # Σ (re-prediction - old prediction) over outlived requests
    under_b: int


class AladdinPlacement:
    """Best-fit placement under Aladdin's SLO constraints (a ``PlacementPolicy``).

    ``models``: a ``PerformanceModel`` per replica id (or one for all). ``slo``: the TTFT and ATGT
    (``tpot_s``) targets; a missing target switches its constraint off. ``predictor``: predicts and
    re-predicts output lengths and learns from ``on_finish``; None trusts
    ``RequestInfo.predicted_output_tokens`` (oracle runs) and doubles outlived predictions.
    Running time per decision: O(Σ_workers n_w log n_w) with per-request views.
    """

    name = "aladdin"
    needs_requests = True  # asks callers for per-request views in the snapshots

    def __init__(self, models: Mapping[str, PerformanceModel] | PerformanceModel, slo: SLO, *,
                 gamma: float = 0.5, theta: float = 1.0, predictor: OutputPredictor | None = None,
                 rebalance: bool = True, project_slack: bool = False, error_ttl: int = 64,
                 token_budget: int = 4096, overflow: str = "least_overdraft"):
        if not 0.0 <= gamma <= 1.0:
            raise ValueError(f"gamma must be in [0, 1], got {gamma}")
        if not 0.0 < theta <= 1.0:
            raise ValueError(f"theta must be in (0, 1], got {theta}")
        if error_ttl < 1:
            raise ValueError("error_ttl must be at least 1")
        if token_budget < 1:
            raise ValueError("token_budget must be at least 1")
        if overflow not in ("least_overdraft", "least_loaded"):
            raise ValueError(f"overflow must be 'least_overdraft' or 'least_loaded', got {overflow!r}")
        self.overflow = overflow
        self.token_budget = int(token_budget)
        self.models = models
        self.slo = slo
        self.gamma, self.theta = float(gamma), float(theta)
        self.predictor = predictor
        self.rebalance = rebalance
        self.project_slack = project_slack
        self.error_ttl = int(error_ttl)
        self._placed: dict[int, tuple[str, float]] = {}  # request id -> (replica, prediction)
        self._repred: dict[int, float] = {}  # re-predictions made here (own predictor only)
        self._errors = ErrorLedger(self.model_for, self.error_ttl)  # Algorithm 2's re-balancing
        self._tick = 0
        self.stats = {"placed": 0, "overflow": 0, "moved": 0, "unbounded": 0}

    # ---------------------------------------------------------------- model lookup
    def model_for(self, replica_id: str) -> PerformanceModel:
        if isinstance(self.models, PerformanceModel):
            return self.models
        try:
            return self.models[replica_id]
        except KeyError:
            raise KeyError(f"Aladdin has no performance model for replica {replica_id!r}") from None

    def predict(self, request: RequestInfo) -> float:
        if self.predictor is not None:
            return max(1.0, float(self.predictor.predict(request.id, request.input_tokens, 0)))
        return max(1.0, float(request.predicted_output_tokens))

    def _repredict(self, rid: int, l_in: int, gen: int) -> float:
        if self.predictor is not None:
            return float(self.predictor.predict(rid, l_in, gen))
        return float(max(2 * gen, gen + 1))

    # ---------------------------------------------------------------- per-worker view
    def _view(self, r: ReplicaState) -> _View:
        """Per-request arrays of ``r``. Without a predictor of its own the policy reads each
        request's current prediction from the snapshot (the caller re-predicts); either way a
        request that reached its prediction is re-predicted here, and any rise over the prediction
        made at placement counts as under-estimation error.

        Callers that list requests (the simulator) list every request on the replica, waiting
        ones with ``started=False``. A caller that keeps only aggregates (the serving layer) lists
        none or some; the requests it counts but does not list are filled in as even shares of
        its totals (prompt tokens waiting, tokens still to generate)."""
        reqs = r.requests
        n = len(reqs)
        l_in, gen = np.zeros(n), np.zeros(n)
        pred, started, dec = np.zeros(n), np.zeros(n, bool), np.zeros(n)
        under_l, under_b = 0.0, 0
        for k, q in enumerate(reqs):
            placed = self._placed.get(q.id)
            p_orig = placed[1] if placed else max(1.0, float(q.predicted_output_tokens))
            if self.predictor is not None:
                p = self._repred.get(q.id, p_orig)
            else:
                p = max(1.0, float(q.predicted_output_tokens))
            if q.started and q.generated_tokens >= p:  # outlived its prediction: predict again
                p = max(self._repredict(q.id, q.input_tokens, q.generated_tokens), q.generated_tokens + 1.0)
                if self.predictor is not None:
                    self._repred[q.id] = p
            if q.started and p > p_orig:
                under_l += p - p_orig
                under_b += 1
            l_in[k], gen[k], pred[k] = q.input_tokens, q.generated_tokens, p
            started[k], dec[k] = q.started, q.decode_time_s
        missing = r.load - n
        if missing > 0:  # aggregate-only callers: even shares of the totals
            left = max(0.0, r.outstanding_tokens - r.queued_prefill_tokens - float(np.sum(np.maximum(pred - gen, 0))))
            if n == 0:
                extra_in = float(r.context_tokens + r.queued_prefill_tokens) / missing
            else:
                extra_in = float(r.queued_prefill_tokens) / missing
            l_in = np.append(l_in, np.full(missing, extra_in))
            gen = np.append(gen, np.zeros(missing))
            pred = np.append(pred, np.full(missing, max(1.0, left / missing)))
            started = np.append(started, np.zeros(missing, bool))
            dec = np.append(dec, np.zeros(missing))
        return _View(l_in, gen, pred, started, dec, under_l, under_b)

    def _batch(self, r: ReplicaState, v: _View) -> int:
        return max(r.load, len(v.l_in))

    def _weighted_context(self, v: _View) -> float:
        return float(np.sum(v.l_in + np.maximum(v.gen, self.gamma * v.pred)))

    def capacity_norm(self, r: ReplicaState, v: _View | None = None) -> float:
        """Aladdin's load metric: ‖(batch, Σ(l_in + γ·l_out))‖₂, each scaled by the worker's own
        limit (batch at which Eq. 4 leaves no context; its KV pool) so unlike workers compare."""
        m = self.model_for(r.id)
        if r.role == "prefill":  # a prefill worker's load is its prompt backlog, in TTFT budgets
            t = m.prefill.time(r.outstanding_tokens) if r.outstanding_tokens > 0 else 0.0
            return t / self.slo.ttft_s if self.slo.ttft_s is not None else t
        v = v or self._view(r)
        return self._norm(r, m, self._batch(r, v), self._weighted_context(v))

    def rough_norm(self, r: ReplicaState) -> float:
        """``capacity_norm`` from the snapshot's totals alone (no per-request view): the context
        of the running batch and the queued prompts plus γ of the output still predicted. Ranks
        workers when none is feasible, where an exact view of every queue would cost O(queue)."""
        if r.role == "prefill":
            return self.capacity_norm(r)
        m = self.model_for(r.id)
        out_left = max(0.0, r.outstanding_tokens - r.queued_prefill_tokens)
        return self._norm(r, m, r.load, r.context_tokens + r.queued_prefill_tokens + self.gamma * out_left)

    def _norm(self, r: ReplicaState, m: PerformanceModel, b: float, ctx: float) -> float:
        kv_cap = r.kv_capacity_tokens or m.kv_capacity_tokens
        b_max = math.inf
        if self.slo.tpot_s is not None and m.decode.c2 > 0:
            b_max = max(1.0, (self.slo.tpot_s - m.decode.c3) / m.decode.c2)
        c_max = kv_cap if kv_cap > 0 else math.inf
        if self.slo.tpot_s is not None:
            c_max = min(c_max, max(1.0, m.decode.context_limit(1, self.slo.tpot_s)))
        fb = b / b_max if math.isfinite(b_max) else 0.0
        fc = ctx / c_max if math.isfinite(c_max) else 0.0
        if fb == 0.0 and fc == 0.0:
            return float(b + ctx) * 1e-12  # no limits known: raw load, only for ordering
        return math.hypot(fb, fc)

    # ---------------------------------------------------------------- constraints (ask before doing)
    def prefill_batches_time(self, m: PerformanceModel, tokens: float) -> float:
        """Time to prefill ``tokens`` queued prompt tokens run FIFO in batches of at most
        ``token_budget`` tokens (each batch pays Eq. 2's constant c1)."""
        if tokens <= 0:
            return 0.0
        nb = max(1, math.ceil(tokens / self.token_budget))
        return nb * m.prefill.time(tokens / nb)

    def ttft_estimate(self, request: RequestInfo, r: ReplicaState, m: PerformanceModel | None = None) -> float:
        """Constraint (c)'s TTFT of ``request`` on ``r``: the running prefill's (or decode
        iteration's) rest, then the queued prompts' batches and the one it joins."""
        m = m or self.model_for(r.id)
        return r.prefill_wait_s + self.prefill_batches_time(m, r.queued_prefill_tokens + request.input_tokens)

    def screen(self, request: RequestInfo, r: ReplicaState, pred: float) -> Check:
        """Constraints (b) and (c) from the snapshot's totals, O(1): (b) with lower bounds of the
        batch and the γ-weighted context (so a worker it rules out, the full check rules out too),
        (c) exactly. (d) and (e) need the per-request view and pass here."""
        m = self.model_for(r.id)
        atgt = ttft = True
        if r.role in ("decode", "colocated") and self.slo.tpot_s is not None:
            ctx = r.context_tokens + r.queued_prefill_tokens + request.input_tokens + self.gamma * pred
            atgt = ctx <= self.theta * m.decode.context_limit(r.load + 1, self.slo.tpot_s)
        if r.role in ("prefill", "colocated") and self.slo.ttft_s is not None:
            ttft = self.ttft_estimate(request, r, m) + r.queued_age_s <= self.slo.ttft_s
        return Check(atgt=atgt, ttft=ttft)

    def overdraft(self, request: RequestInfo, r: ReplicaState, pred: float, v: _View,
                  m: PerformanceModel | None = None) -> float:
        """Constraint (d)'s excess in seconds: the prefill of the queued prompts and ``request`` minus
        θ · the least ATGT time any request on ``r`` has saved (≤ 0: (d) holds). 0 on workers
        (d) does not apply to."""
        T = self.slo.tpot_s
        if r.role != "colocated" or T is None or not len(v.l_in):
            return 0.0
        m = m or self.model_for(r.id)
        # every request on the worker — waiting ones too: they start decoding before this
        # prompt's prefill runs, and the stall lands in their ATGT as well
        # ATGT budget of the tokens made since joining the batch (the first one came with the
        # prefill) minus the decode time spent on them
        slack = T * np.maximum(v.gen - 1.0, 0.0) - v.dec_time
        if self.project_slack:  # what each will still save, at the γ-point iteration time
            b = self._batch(r, v) + 1
            ctx = self._weighted_context(v) + request.input_tokens + self.gamma * pred
            t_iter = m.decode.time(b, ctx)
            slack = slack + (T - t_iter) * np.maximum(v.pred - v.gen, 0.0)
        new_tokens = r.queued_prefill_tokens + request.input_tokens
        return self.prefill_batches_time(m, new_tokens) - self.theta * float(slack.min())

    def check(self, request: RequestInfo, r: ReplicaState, pred: float | None = None,
              view: _View | None = None) -> Check:
        """Constraints (b)–(e) for putting ``request`` on ``r``."""
        m = self.model_for(r.id)
        v = view or self._view(r)
        pred = self.predict(request) if pred is None else pred
        decodes = r.role in ("decode", "colocated")
        prefills = r.role in ("prefill", "colocated")
        atgt = ttft = preempt = kv = True
        theta, T = self.theta, self.slo.tpot_s
        if decodes and T is not None:  # (b)
            b = self._batch(r, v) + 1
            ctx = self._weighted_context(v) + request.input_tokens + self.gamma * pred
            atgt = ctx <= theta * m.decode.context_limit(b, T)
        if prefills and self.slo.ttft_s is not None:  # (c)
            ttft = self.ttft_estimate(request, r, m) + r.queued_age_s <= self.slo.ttft_s
        if r.role == "colocated" and T is not None and len(v.l_in):  # (d)
            preempt = self.overdraft(request, r, pred, v, m) <= 0.0
        cap = r.kv_capacity_tokens or m.kv_capacity_tokens
        if decodes and cap > 0:  # (e)
            kv = self.kv_peak(m, v, request.input_tokens, pred) <= cap
        return Check(atgt, ttft, preempt, kv)

    def can_place(self, request: RequestInfo, r: ReplicaState) -> bool:
        return self.check(request, r).ok

    @staticmethod
    def kv_peak(m: PerformanceModel, v: _View, new_in: int = 0, new_pred: float = 0.0) -> float:
        """Peak KV (pool tokens) over all future iterations, the new request included if given."""
        foot = v.l_in + v.gen
        rem = np.maximum(v.pred - v.gen, 0.0)
        if new_in or new_pred:
            foot = np.append(foot, float(new_in))
            rem = np.append(rem, float(new_pred))
        if not len(foot):
            return 0.0
        foot = np.array([m.kv.tokens_equivalent(f) for f in foot]) if m.kv.j else foot
        order = np.argsort(-rem, kind="stable")
        rem_s, pre = rem[order], np.cumsum(foot[order])
        k = np.arange(1, len(rem_s) + 1)
        # at t = rem_s[k-1] the first k requests (rem ≥ t) are all still alive
        return float(max(pre[-1], np.max(pre + k * rem_s)))

    # ---------------------------------------------------------------- decision
    def bounded(self, r: ReplicaState) -> bool:
        """Whether any constraint limits what ``r`` takes: TTFT for a prefill worker; ATGT or the KV
        pool for a decoding one. A worker with none has no bin size, so best fit cannot pack it."""
        if r.role != "prefill":
            if self.slo.tpot_s is not None or (r.kv_capacity_tokens or self.model_for(r.id).kv_capacity_tokens) > 0:
                return True
        return r.role != "decode" and self.slo.ttft_s is not None

    def _least_loaded(self, request: RequestInfo, cands: Sequence[ReplicaState], norms: list[float]) -> int:
        """The worker to use when packing cannot decide: a prefill worker by its predicted finish of
        this prompt (backlog + prompt on its own prefill law); others by capacity_norm."""
        def key(i: int) -> tuple:
            r = cands[i]
            if r.role == "prefill":
                load = self.model_for(r.id).prefill.time(r.outstanding_tokens + request.input_tokens)
            else:
                load = norms[i]
            return (load, -r.capacity_norm, i)
        return min(range(len(cands)), key=key)

    def choose(self, request: RequestInfo, candidates: Sequence[ReplicaState], now: float) -> str:
        """Algorithm 1: the fullest feasible worker; then Algorithm 2's re-balancing move.

        Two fallbacks for a fixed pool: no feasible worker (Algorithm 1 would open a bin) and no
        worker with any constraint at all (e.g. prefill workers without a TTFT target, where
        "fullest first" would send every prompt to one worker): the least loaded worker."""
        self._tick += 1
        pred = self.predict(request)
        if not any(self.bounded(r) for r in candidates):
            self.stats["unbounded"] += 1
            x = self._least_loaded(request, candidates, [self.rough_norm(r) for r in candidates])
        else:
            # the O(1) screen first: only workers it leaves open get a per-request view
            open_ = [i for i, r in enumerate(candidates) if self.screen(request, r, pred).ok]
            views = {i: self._view(candidates[i]) for i in open_}
            norms = {i: self.capacity_norm(candidates[i], views[i]) for i in open_}
            order = sorted(open_, key=lambda i: (-norms[i], -candidates[i].capacity_norm, i))
            checks = {i: self.check(request, candidates[i], pred, views[i]) for i in order}
            feasible = [i for i in order if checks[i].ok]
            if feasible:
                x = feasible[0]
                if self.rebalance and len(feasible) > 1:
                    x = self._rebalance(x, feasible, candidates, views, pred)
            else:
                self.stats["overflow"] += 1
                x = self._overflow(request, candidates, pred, views, checks)
        chosen = candidates[x].id
        self._placed[request.id] = (chosen, pred)
        self.stats["placed"] += 1
        return chosen

    def _overflow(self, request: RequestInfo, cands: Sequence[ReplicaState], pred: float,
                  views: Mapping[int, _View], checks: Mapping[int, Check]) -> int:
        """No feasible worker, and a fixed pool cannot open a bin (Algorithm 1, line 12). With
        ``overflow="least_overdraft"``: among the workers where only (d) fails, the one whose
        ongoing requests lose the least saved ATGT time to the prefill (smallest overdraft); the
        least loaded worker when there is none. ``"least_loaded"``: always the least loaded."""
        if self.overflow == "least_overdraft":
            only_d = [i for i, c in checks.items() if c.atgt and c.ttft and c.kv]
            if only_d:
                return min(only_d, key=lambda i: (self.overdraft(request, cands[i], pred, views[i]), i))
        return self._least_loaded(request, cands, [self.rough_norm(r) for r in cands])

    # ---------------------------------------------------------------- re-balancing (Algorithm 2)
    def _rebalance(self, x: int, feasible: list[int], cands: Sequence[ReplicaState], views: Mapping[int, _View],
                   pred: float) -> int:
        unders = {i: (views[i].under_l, views[i].under_b) for i in feasible}
        best = self._errors.move(x, feasible, [r.id for r in cands], unders, pred, self._tick)
        if best != x:
            self.stats["moved"] += 1
        return best

    def on_finish(self, request_id: int, input_tokens: int, output_tokens: int) -> None:
        """Learn the output length; a request that ended before its prediction marks its worker
        as over-estimated (Algorithm 2, lines 10–13)."""
        if self.predictor is not None:
            self.predictor.observe(request_id, input_tokens, output_tokens)
        self._repred.pop(request_id, None)
        placed = self._placed.pop(request_id, None)
        if placed is not None and output_tokens < placed[1]:
            self._errors.finished_early(placed[0], self._tick, output_tokens, placed[1])
