"""Aladdin's constraints (b)–(e) for putting one request on one worker (§4.2), and the
per-request view of a worker that they read.

They are the "can I?" half of ``policies.aladdin.AladdinPlacement``, asked before best fit decides
where a request goes; kept apart from that decision (ranking, overflow, re-balancing) so each
reads on its own; ``AladdinConstraints`` is mixed into the placement class. The constraints:

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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from hetserve.cost.fitted import PerformanceModel
from hetserve.policies.base import ReplicaState, RequestInfo

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


class AladdinConstraints:
    """Constraints (b)–(e) and the per-worker view, mixed into ``AladdinPlacement``, which holds
    what they read: ``model_for``, ``predict``, ``slo``, ``gamma``, ``theta``, ``token_budget``,
    ``project_slack``, ``predictor`` and its records ``_placed`` and ``_repred``."""

    columns_from = 8  # the least requests on a worker for which ``_view`` reads columns

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
        cols = getattr(reqs, "columns", None)
        # the simulator's views as arrays: the same figures, with no loop over the requests but a
        # fixed cost in numpy calls, which a loop over a few requests undercuts
        if cols is not None and r.load >= self.columns_from:
            l_in, gen, pred, started, dec, under_l, under_b = self._from_columns(cols())
        else:
            l_in, gen, pred, started, dec, under_l, under_b = self._from_requests(reqs)
        n = len(l_in)
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

    def _from_requests(self, reqs) -> tuple:
        """The view's arrays and under-estimation (Σ rise, count) from ``RunningRequest`` objects."""
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
        return l_in, gen, pred, started, dec, under_l, under_b

    def _from_columns(self, c) -> tuple:
        """``_from_requests`` from columns (``ids``, and ``l_in``, ``gen``, ``pred``, ``started``,
        ``dec_time``: the ``RunningRequest`` fields as arrays), looping only over the requests
        outlived or under-estimated, in order: the same arrays, sums and re-predictions."""
        ids, started, gen = c.ids, c.started, c.gen
        if not ids:
            return c.l_in, gen, c.pred, started, c.dec_time, 0.0, 0
        q_pred = np.fmax(c.pred, 1.0)  # max(1.0, predicted), NaN giving 1.0 as there
        get = self._placed.get
        p_orig = np.array([e[1] if (e := get(i)) else -1.0 for i in ids], float)
        unplaced = p_orig == -1.0  # placed predictions are ≥ 1
        p_orig[unplaced] = q_pred[unplaced]
        if self.predictor is not None:
            rp = self._repred.get
            pred = np.array([rp(i, o) for i, o in zip(ids, p_orig.tolist())], float)
        else:
            pred = q_pred
        for k in np.flatnonzero(started & (gen >= pred)).tolist():  # outlived: predict again
            g = int(gen[k])
            p = max(self._repredict(ids[k], int(c.l_in[k]), g), g + 1.0)
            if self.predictor is not None:
                self._repred[ids[k]] = p
            pred[k] = p
        under_l, under_b = 0.0, 0
        for k in np.flatnonzero(started & (pred > p_orig)).tolist():
            under_l += float(pred[k]) - float(p_orig[k])
            under_b += 1
        return c.l_in, gen, pred, started, c.dec_time, under_l, under_b

    def _batch(self, r: ReplicaState, v: _View) -> int:
        return max(r.load, len(v.l_in))

    def _weighted_context(self, v: _View) -> float:
        return float(np.sum(v.l_in + np.maximum(v.gen, self.gamma * v.pred)))

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
