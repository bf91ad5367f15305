"""Aladdin placement: best-fit online bin packing under SLO constraints, with re-balancing.

Paper: ``aladdin-slo-placement-scaling.md`` §4.2 (constraints (b)–(e), Algorithm 1) and §4.3
(Algorithm 2). A worker (replica) is a bin; a request is packed into the *fullest* worker — ranked
by ``capacity_norm``, the L2 norm of its batch size and its γ-weighted context — on which every
constraint still holds after adding it.

The constraints (b)–(e), and the per-request view of a worker they read, are written out in
``policies.aladdin_constraints`` and mixed in here; this module holds the decision.

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
from typing import Mapping, Sequence

from hetserve.cost.fitted import PerformanceModel
from hetserve.policies.aladdin_constraints import AladdinConstraints, Check, _View
from hetserve.policies.aladdin_rebalance import ErrorLedger
from hetserve.policies.base import ReplicaState, RequestInfo
from hetserve.policies.predictor import OutputPredictor
from hetserve.specs.workload import SLO


class AladdinPlacement(AladdinConstraints):
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

    # ---------------------------------------------------------------- load metric (best fit's ranking)
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
