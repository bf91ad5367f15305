"""``eft`` placement: the replica that, by the plan, finishes its backlog plus this request first.

Replicas of a heterogeneous plan differ several-fold in speed, and in how a prompt token compares
with an output token. Counting requests (``jsq``) or raw tokens sends a slow replica as much as a
fast one; both leave the fast replicas part idle and the slow ones with a long queue, so a
saturated run delivers far less than the plan's estimate and the queue drains late.

Each replica i gets two prices, in seconds of its own time when saturated:

* ``a_i`` per prompt token and ``b_i`` per output token, with ``a_i·s_in + b_i·s_out = T_i``, the
  time per request the plan gives it: ``period_s / flow_requests_per_period`` from the plan's
  ``estimate`` (``capacity_requests_per_period`` where there is no flow), so placement follows the
  plan's own flow, which already respects the links the replica's KV and activations cross;
  without a figure in the plan, the cost model's capacity at the mean lengths;
* the split between the two follows the cost model on a colocated replica (a prompt token is
  priced as what it adds to a saturated decode step, an output token as that step over the batch),
  all on the prompt for a prefill replica, all on the output for a decode one.

A request goes to the candidate with the least ``prompt tokens·a_i + output tokens·b_i`` over its
backlog (the snapshot's queued prompt tokens and outstanding output tokens) with the request's own
tokens added, i.e. the earliest expected finish of everything placed there. The request's own part
makes an idle fast replica win over an idle slow one. Ties go round robin, as in ``lot``.

A prefill replica hands a request on once its prompt is done, and the decode replicas behind it
are not among placement's candidates (their snapshots are not shown to it). So the policy books
each request it sends to a prefill replica on that replica's KV routes (output tokens by route
weight, priced at each decode replica's ``b_d``) until ``on_finish``, and ranks a prefill replica
by the later of its own backlog and that decode backlog (its own backlog breaks ties). Without the
booking a mixed plan's prefill replicas look idle and draw far more than their decode replicas
serve. A booked request counts its whole predicted output until it finishes, an overestimate of
the running ones by what they have made.

Where no prices can be set (no plan figure and no cost model, or a candidate the context does not
know) every candidate is ranked by ``(outstanding tokens + the request's) / capacity_norm`` instead,
so the ranking never mixes the two scales.

A decision costs O(candidates), but in a large fleet most of that is one numpy expression: each
candidate's key is bounded from below by figures its snapshot holds while kept, and only those a
bound cannot rule out are priced one by one (``_Bounds``).
"""

from __future__ import annotations

from itertools import compress, count, repeat
from operator import is_not
from typing import Any, Sequence

import numpy as np

from hetserve.policies.base import ReplicaState, RequestInfo
from hetserve.policies.placement import PolicyContext, register_placement

# Mean lengths when neither the plan's estimate nor the workload gives them (round numbers of the
# Azure conversation trace's order): they only set how a colocated replica's time splits.
FALLBACK_INPUT_TOKENS = 1024.0
FALLBACK_OUTPUT_TOKENS = 256.0

# From this many candidates ``_least`` bounds every key at once (``_Bounds``) and prices one by one
# only those the bounds cannot rule out; below it the array calls cost more than pricing them all.
VECTORIZE_FROM = 48
# A bound's margin under the key it bounds: room for their operations' different rounding (a few
# ulps; nothing summed is negative).
_SHRINK = 1.0 - 1e-9


def mean_lengths(ctx: PolicyContext) -> tuple[float, float]:
    """(prompt, output) tokens per request the prices assume: the plan's, else the workload's."""
    est = ctx.plan.estimate if ctx.plan is not None and isinstance(ctx.plan.estimate, dict) else {}
    tin, tout = est.get("mean_input_tokens"), est.get("mean_output_tokens")
    if not (isinstance(tin, (int, float)) and tin > 0 and isinstance(tout, (int, float)) and tout > 0):
        if ctx.workload is not None and len(ctx.workload):
            tin, tout = ctx.workload.mean_input, ctx.workload.mean_output
        else:
            tin, tout = FALLBACK_INPUT_TOKENS, FALLBACK_OUTPUT_TOKENS
    return max(1.0, float(tin)), max(1.0, float(tout))


def _planned_seconds(ctx: PolicyContext, rid: str) -> float | None:
    """Seconds per request the plan's estimate gives replica ``rid`` (None: no figure)."""
    est = ctx.plan.estimate if ctx.plan is not None and isinstance(ctx.plan.estimate, dict) else {}
    info = (est.get("replicas") or {}).get(rid) or {}
    period = est.get("period_s")
    if not isinstance(period, (int, float)) or period <= 0:
        return None
    for key in ("flow_requests_per_period", "capacity_requests_per_period"):
        share = info.get(key)
        if isinstance(share, (int, float)) and share > 0:
            return float(period) / float(share)
    return None


def _modelled_seconds(cost: Any, layout: Any, role: str, tin: float, tout: float) -> float | None:
    """Seconds per request of a saturated replica under the cost model (None: it cannot run)."""
    if role == "prefill":
        t = cost.ttft(layout, max(1, round(tin)))
        return t if t > 0 else None
    if role == "decode":
        _, tokens_per_s = cost.decode_throughput(layout, tin, tout)
        return tout / tokens_per_s if tokens_per_s > 0 else None
    per_period = cost.colocated_capacity(layout, tin, tout, 1.0)
    return 1.0 / per_period if per_period > 0 else None


def _prompt_share(cost: Any, layout: Any, tin: float, tout: float) -> float | None:
    """Share of a colocated replica's time per request spent on its prompt: a prompt token costs
    what it adds to a saturated decode step, an output token that step over its batch."""
    from hetserve.cost.analytic import PrefillBatch

    batch = cost.max_decode_batch(layout, tin + tout)
    if batch <= 0:
        return None
    context = batch * (tin + tout / 2)
    step = cost.decode_step_time(layout, batch, context)
    mixed = cost.mixed_step_time(layout, batch, context, PrefillBatch(1, tin, tin * tin))  # type: ignore[arg-type]
    prompt, output = max(0.0, mixed - step), step / batch * tout
    return prompt / (prompt + output) if prompt + output > 0 else None


def replica_prices(ctx: PolicyContext) -> dict[str, tuple[float, float]]:
    """Replica id -> (seconds per prompt token, seconds per output token), for every replica of
    ``ctx.plan`` that has a plan figure or a cost-model one (module docstring)."""
    if ctx.plan is None:
        return {}
    tin, tout = mean_lengths(ctx)
    prices: dict[str, tuple[float, float]] = {}
    for r in ctx.plan.replicas:
        layout = ctx.layouts.get(r.id)
        modelled = ctx.cost is not None and layout is not None
        seconds = _planned_seconds(ctx, r.id)
        if seconds is None and modelled:
            seconds = _modelled_seconds(ctx.cost, layout, r.role, tin, tout)
        if seconds is None:
            continue
        share: float | None
        if r.role == "prefill":
            share = 1.0
        elif r.role == "decode":
            share = 0.0
        else:  # without the cost model, a prompt token and an output token cost the same
            share = _prompt_share(ctx.cost, layout, tin, tout) if modelled else None
            if share is None:
                share = tin / (tin + tout)
        prices[r.id] = (share * seconds / tin, (1.0 - share) * seconds / tout)  # type: ignore[operator]
    return prices


def backlog_tokens(c: ReplicaState, request: RequestInfo | None = None) -> tuple[float, float]:
    """(prompt tokens, output tokens) a replica has still to process, with ``request`` placed on it."""
    if c.role == "prefill":
        prompt, output = c.outstanding_tokens, 0.0
    else:
        prompt = float(c.queued_prefill_tokens)
        output = max(0.0, c.outstanding_tokens - c.queued_prefill_tokens)
    if request is not None:
        if c.role != "decode":
            prompt += request.input_tokens
        if c.role != "prefill":
            output += request.predicted_output_tokens
    return prompt, output


class _Bounds:
    """Lower bounds on the ``finish_s`` keys of many candidates. A colocated or decode candidate's
    key is at least ``queued prompt·a + (x + predicted output)·b + input tokens·pa`` with ``x`` its
    output backlog on the least outstanding tokens its snapshot allows now (``outstanding_floor``,
    ``outstanding_drain``), ``pa`` its ``a`` (colocated) or 0 (decode): fields that hold while the
    snapshot is kept. A prefill candidate (whose outstanding tokens have no floor) gets -inf.
    The figures are kept by position and read again only where the candidate there is another
    object than at the last decision (a caller keeping snapshots hands the same ones back)."""

    # a position's figures, the rows of ``_at``: queued prompt·a; b; pa; the output backlog on the
    # floor (0 at least); on the drain, ``drained - rate·now`` (``drained`` with the drain's start in)
    FIGURES = ("qa", "b", "pa", "floor", "drained", "rate")
    _PREFILL = (float("-inf"), 0.0, 0.0, 0.0, float("-inf"), 0.0)

    def __init__(self) -> None:
        self._seen: list[Any] = []
        self._at = np.empty((len(self.FIGURES), 0))

    def of(self, candidates: Sequence[ReplicaState], rows: dict[str, tuple[Any, ...]], inp: float,
           pred: float, now: float) -> Any:
        """The bounds (an array in candidate order, each to be eased by ``_SHRINK``) at ``now`` for
        a request of ``inp`` prompt tokens and ``pred`` predicted output tokens; None if a candidate
        has no ``rows`` entry (no price)."""
        if not self._update(candidates, rows):
            return None
        qa, b, pa, floor, drained, rate = self._at
        x = np.fmax(floor, drained - rate * now)  # fmax: no drain (0·inf at now = inf) leaves the floor
        x += pred
        x *= b
        x += qa
        x += inp * pa
        return x

    def _update(self, candidates: Sequence[ReplicaState], rows: dict[str, tuple[Any, ...]]) -> bool:
        n, seen = len(candidates), self._seen
        changed: Any
        if len(seen) != n:
            self._seen = seen = [None] * n
            self._at = np.empty((len(self.FIGURES), n))
            changed = range(n)
        else:
            changed = list(compress(count(), map(is_not, candidates, seen)))
        at = self._at
        for i in changed:
            c = candidates[i]
            row = rows.get(c.id)
            if row is None:
                self._seen = []
                return False
            if c.role == "prefill":
                at[:, i] = self._PREFILL
            else:
                a, b = row[0], row[1]
                queued = float(c.queued_prefill_tokens)
                floor = c.outstanding_floor - queued
                since, drained, rate = c.outstanding_drain or (0.0, float("-inf"), 0.0)
                at[:, i] = (queued * a, b, a if c.role != "decode" else 0.0, floor if floor > 0.0 else 0.0,
                            drained - queued + rate * since, rate)
            seen[i] = c
        return True


class ExpectedFinishTime:
    """Least expected finish time of the backlog plus the request, priced by the plan (module doc)."""

    name = "eft"
    needs_requests = False
    reads_waits = False  # backlog tokens and the plan's prices only

    def __init__(self, ctx: PolicyContext | None = None):
        ctx = ctx or PolicyContext()
        self.prices = replica_prices(ctx)
        # prefill replica -> [(decode replica, route weight)]: where its requests' outputs go
        self.routes: dict[str, list[tuple[str, float]]] = {}
        if ctx.plan is not None:
            for r in ctx.plan.replicas:
                if r.role == "prefill":
                    out: list[Any] = [(k.dst, k.weight) for k in ctx.plan.routes_from(r.id) if k.weight > 0]
                    total = sum(w for _, w in out)
                    if out and all(d in self.prices for d, _ in out):
                        self.routes[r.id] = [(d, w / total) for d, w in out]
        self._decoding: dict[str, float] = {}  # decode replica -> output tokens expected there
        self._sent: dict[int, tuple[str, float]] = {}  # request -> (prefill replica, predicted output)
        self._next = 0
        self._bounds = _Bounds()
        # replica -> what ``finish_s`` reads of the prices and routes for it, looked up once per
        # candidate by ``_least``: (a, b, 0.0·b, first route, second route, routes) with each route
        # as (decode replica, weight, its b); the first two where it has one or two, else its list
        # (None: no such route). The prices and routes are fixed once the policy is built.
        self._rows: dict[str, tuple[Any, ...]] = {}
        for rid, (a, b) in self.prices.items():
            out = [(d, w, self.prices[d][1]) for d, w in self.routes[rid]] if rid in self.routes else []
            few = len(out) <= 2
            self._rows[rid] = (a, b, 0.0 * b, out[0] if few and out else None, out[1] if few and len(out) == 2 else None,
                               None if few else out)

    def _book(self, src: str, output_tokens: float) -> None:
        """Book ``output_tokens`` (negative: release them) on the decode replicas behind ``src``."""
        for d, w in self.routes[src]:
            self._decoding[d] = self._decoding.get(d, 0.0) + w * output_tokens

    def _decode_s(self, src: str, output_tokens: float) -> float:
        """Expected seconds the decode replicas behind ``src`` hold with ``output_tokens`` more on
        them, by route weight."""
        return sum(w * (self._decoding.get(d, 0.0) + output_tokens) * self.prices[d][1] for d, w in self.routes[src])

    def finish_s(self, request: RequestInfo, c: ReplicaState) -> tuple[float, float] | None:
        """Seconds until ``c`` would have finished everything placed on it, ``request`` included,
        and the part of that on ``c`` itself (the tie-break); None: no price for ``c``. A prefill
        replica's request is finished only once decoded: the decode replicas behind it, whose
        snapshots placement does not see, hold what this policy has sent them."""
        price = self.prices.get(c.id)
        if price is None:
            return None
        prompt, output = backlog_tokens(c, request)
        own = prompt * price[0] + output * price[1]
        if c.id in self.routes:
            return max(own, self._decode_s(c.id, request.predicted_output_tokens)), own
        return own, own

    def _key(self, c: ReplicaState, row: tuple[Any, ...], inp: float, pred: float,
             best: float) -> tuple[float, float] | None:
        """``finish_s(request, c)`` with ``row`` (``_rows[c.id]``), worked out with its operations in
        its order (the same floats); None where it surely exceeds ``best``: a routed candidate
        whose decode seconds alone exceed it (its own backlog is not read), or one whose own
        seconds on its ``outstanding_floor`` do (its outstanding tokens are not read)."""
        a, b, zb, r1, r2, out = row
        booked = self._decoding
        if r1 is not None:  # _decode_s(c.id, pred): sum of one or two terms, 0 + each in turn
            dec = 0 + r1[1] * (booked.get(r1[0], 0.0) + pred) * r1[2]
            if r2 is not None:
                dec = dec + r2[1] * (booked.get(r2[0], 0.0) + pred) * r2[2]
            if dec > best:
                return None
        elif out is not None:
            dec = sum([w * (booked.get(d, 0.0) + pred) * bd for d, w, bd in out])
            if dec > best:
                return None
        else:
            dec = None
        role = c.role
        if role == "prefill":  # backlog_tokens(c, request): (outstanding + prompt, 0.0)
            own = (c.outstanding_tokens + inp) * a + zb
        else:
            queued = c.queued_prefill_tokens
            prompt = float(queued) + inp if role != "decode" else float(queued)
            x = c.outstanding_floor - queued  # own's operations on the floor: no more than own
            if prompt * a + ((x if x > 0.0 else 0.0) + pred) * b > best:
                return None
            x = c.outstanding_tokens - queued
            own = prompt * a + ((x if x > 0.0 else 0.0) + pred) * b
        return (own if dec is None or not dec > own else dec), own

    def _least(self, request: RequestInfo, candidates: Sequence[ReplicaState],
               now: float = float("inf")) -> list[ReplicaState] | None:
        """The candidates of the least ``finish_s`` key at ``now`` (the snapshots' clock; inf: any
        moment), in candidate order; None if one has no price.

        The least key and its ties are those ``min`` over ``finish_s``'s pairs gives (``_key``:
        the same floats, never NaN). From ``VECTORIZE_FROM`` candidates on, the one of least bound
        (``_Bounds``) is priced first, then only those whose bound is at most its key."""
        rows, inp, pred = self._rows, request.input_tokens, request.predicted_output_tokens
        best = best_own = float("inf")
        tied: list[int] = []
        look: Any = None  # (position, a bound on its key) to look at; None: every candidate, unbounded
        if len(candidates) >= VECTORIZE_FROM:
            bounds = self._bounds.of(candidates, rows, inp, pred, now)
            if bounds is None:
                return None
            at = int(bounds.argmin())
            c = candidates[at]
            first = self._key(c, rows[c.id], inp, pred, best)
            assert first is not None  # nothing exceeds inf
            if bounds[at] * _SHRINK <= first[0]:  # else a snapshot below its own floor: no bound holds
                (best, best_own), tied = first, [at]
                nearby = np.flatnonzero(bounds * _SHRINK <= best)
                look = ((i, b) for i, b in zip(nearby.tolist(), (bounds[nearby] * _SHRINK).tolist()) if i != at)
        elif any(c.id not in rows for c in candidates):
            return None
        if look is None:
            look = zip(range(len(candidates)), repeat(float("-inf")))
        for i, bound in look:
            if bound > best:
                continue
            c = candidates[i]
            k = self._key(c, rows[c.id], inp, pred, best)
            if k is None or k[0] > best:
                continue
            key, own = k
            if key < best or own < best_own:
                best, best_own, tied = key, own, [i]
            elif own == best_own:
                tied.append(i)
        return [candidates[i] for i in sorted(tied)]

    def choose(self, request: RequestInfo, candidates: Sequence[ReplicaState], now: float) -> str:
        if not candidates:
            raise ValueError("no candidate to place the request on")
        tied = self._least(request, candidates, now)
        if tied is None:  # one scale for every candidate: the snapshot's own
            keys = [sum(backlog_tokens(c, request)) / (c.capacity_norm if c.capacity_norm > 0 else 1.0)
                    for c in candidates]
            best = min(keys)
            tied = [c for c, k in zip(candidates, keys) if k == best]
        self._next += 1
        chosen = tied[self._next % len(tied)].id
        if chosen in self.routes:
            self._sent[request.id] = (chosen, request.predicted_output_tokens)
            self._book(chosen, request.predicted_output_tokens)
        return chosen

    def on_finish(self, request_id: int, input_tokens: int, output_tokens: int) -> None:
        sent = self._sent.pop(request_id, None)
        if sent is not None:
            self._book(sent[0], -sent[1])


register_placement("eft", ExpectedFinishTime)
