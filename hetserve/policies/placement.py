"""Placement policies: which replica takes a newly arrived request.

Each policy is a pure decision over ``ReplicaState`` snapshots (``hetserve.policies.base``), so
the simulator and the runtime call the same objects. Baselines here:

==========  ==================================================================================
``rr``      round robin over the candidates, in their order
``jsq``     join the shortest queue: fewest queued + running requests (ties: fewer outstanding
            tokens, then round robin among the tied)
``lot``     least outstanding tokens per unit of capacity (``outstanding_tokens / capacity_norm``)
``po2``     power of two choices: two distinct candidates drawn with a seeded RNG, the less
            loaded one wins (ties: fewer outstanding tokens, then the first drawn)
``eft``     the default (``DEFAULT_PLACEMENT``): least expected finish time of the replica's
            backlog plus the request, each replica's tokens priced by the plan's own flow through
            it (``hetserve.policies.finish_time``)
==========  ==================================================================================

The registry maps a name to a factory called with one ``PolicyContext``, built by
``PolicyContext.for_plan`` wherever a plan is simulated or served. Other modules add names with
``register_placement``; ``eft`` (``hetserve.policies.finish_time``) and ``aladdin``
(``hetserve.policies.aladdin_route``) are imported on first use (each module calls
``register_placement`` when imported).
"""

from __future__ import annotations

import importlib
import random
from dataclasses import dataclass, field
from itertools import compress, repeat
from operator import eq
from typing import Any, Callable, Sequence

from hetserve.compiled import mypyc_attr
from hetserve.policies.base import PlacementPolicy, ReplicaState, RequestInfo
from hetserve.policies.outstanding import LeastLoaded, SnapshotsLeastLoaded, first_least

# The request placement every caller uses unless told otherwise (simulate, serve, compare, the
# experiments): the plan's own prices per replica, so a heterogeneous plan delivers what it promised.
DEFAULT_PLACEMENT = "eft"
# From this many tied candidates ``jsq`` reads the outstanding tokens of only those whose lower
# bound (``ReplicaState.outstanding_at_least``) does not rule them out; below it it reads them all.
BOUND_FROM = 8


@dataclass(frozen=True)
class PolicyContext:
    """What a policy factory may use to build its policy (all optional but ``seed``).

    ``cost`` is the shared ``CostModel``; ``layouts`` maps replica id to its ``ReplicaLayout``;
    ``slo`` is the workload's ``SLO``; ``plan`` the ``Plan``; ``workload`` the ``Workload`` (for
    statistics only: a policy must not peek at future requests); ``predictor`` the caller's
    output-length predictor (``hetserve.policies.predictor.OutputPredictor``), whose predictions
    reach the policies through ``RequestInfo.predicted_output_tokens``. Build it with ``for_plan``.
    """

    seed: int = 0
    slo: Any = None
    cost: Any = None
    plan: Any = None
    layouts: dict[str, Any] = field(default_factory=dict)
    workload: Any = None
    options: dict[str, Any] = field(default_factory=dict)
    predictor: Any = None

    @classmethod
    def for_plan(cls, plan: Any, cluster: Any, model: Any, workload: Any = None, *, slo: Any = None,
                 seed: int = 0, options: dict[str, Any] | None = None, efficiency: Any = None,
                 predictor: Any = None, cost: Any = None, layouts: dict[str, Any] | None = None
                 ) -> "PolicyContext":
        """The context of ``plan`` on ``cluster`` for ``model``: the one way the simulator, the
        server and capacity planning build it, so a policy name means the same decision in each.

        ``efficiency``: the cost model's ``Efficiency`` (a calibration), for a ``CostModel`` built
        here; ``cost``: one already built for this cluster and model (the simulator's memoised
        one) instead; not both. ``layouts``: replica id -> layout, default every replica's.
        ``predictor`` must follow ``OutputPredictor`` (``predict(request_id, input_tokens,
        generated_tokens=0)``, ``observe(request_id, input_tokens, output_tokens)``); TypeError if not.
        """
        from hetserve.cost.analytic import CostModel
        from hetserve.policies.predictor import check_predictor

        if getattr(plan, "model", model.name) != model.name:
            raise ValueError(f"plan is for model {plan.model!r}, not {model.name!r}")
        if cost is not None and efficiency is not None:
            raise ValueError("give a cost model or an efficiency to build one, not both")
        if predictor is not None:
            check_predictor(predictor)
        return cls(seed=seed, slo=slo, cost=cost if cost is not None else CostModel(cluster, model, efficiency),
                   plan=plan, layouts=dict(layouts) if layouts is not None else
                   {r.id: r.layout(cluster) for r in plan.replicas},
                   workload=workload, options=dict(options or {}), predictor=predictor)


@mypyc_attr(allow_interpreted_subclasses=True)
class _Base:
    name = "base"

    def on_finish(self, request_id: int, input_tokens: int, output_tokens: int) -> None:
        return None


@mypyc_attr(allow_interpreted_subclasses=True)
class RoundRobin(_Base):
    name = "rr"
    reads_waits = False  # the candidates' order alone

    def __init__(self, ctx: PolicyContext | None = None):
        self._next = 0

    def choose(self, request: RequestInfo, candidates: Sequence[ReplicaState], now: float) -> str:
        c = candidates[self._next % len(candidates)]
        self._next += 1
        return c.id


@mypyc_attr(allow_interpreted_subclasses=True)
class JoinShortestQueue(_Base):
    name = "jsq"
    reads_waits = False  # loads and outstanding tokens only
    picks_least_loaded = True  # the load is the first key (``PlacementPolicy.picks_least_loaded``)

    def __init__(self, ctx: PolicyContext | None = None):
        self._next = 0

    def choose(self, request: RequestInfo, candidates: Sequence[ReplicaState], now: float) -> str:
        # the load summed in place of the ``ReplicaState.load`` property, the least loaded picked
        # out in C (``compress``), without a key tuple per candidate
        loads = [c.queued_requests + c.running_requests for c in candidates]
        least = list(compress(candidates, map(eq, loads, repeat(min(loads)))))
        self._next += 1
        return _fewest_tokens(SnapshotsLeastLoaded(least, now), self._next)

    def choose_lowest(self, request: RequestInfo, least: LeastLoaded, now: float) -> str:
        """``choose`` given only the least loaded candidates, in candidate order."""
        self._next += 1
        return _fewest_tokens(least, self._next)


def _fewest_tokens(least: LeastLoaded, turn: int) -> str:
    """JSQ among the least loaded (in candidate order): the fewest outstanding tokens, ties round
    robin (decision ``turn`` takes tie ``turn`` mod their number). Outstanding tokens may cost work
    to read (a simulator's running batch): from ``BOUND_FROM`` candidates on, only those whose
    lower bound is at most the tokens of the one of least bound are read."""
    n = least.size
    if n == 1:
        return least.id(0)
    positions: list[int] | None = None
    if n >= BOUND_FROM:
        k = least.least_bound()
        tokens = least.tokens(k)
        if tokens >= least.bound(k):  # else a snapshot below its own floor: no bound holds, read them all
            positions = least.bounded_by(tokens)
    if positions is None:
        positions = [j for j in range(n)]
    outstanding = [least.tokens(j) for j in positions]
    fewest = outstanding[first_least(outstanding)]
    tied = [j for j, t in zip(positions, outstanding) if t == fewest]
    return least.id(tied[turn % len(tied)])


@mypyc_attr(allow_interpreted_subclasses=True)
class LeastOutstandingTokens(_Base):
    name = "lot"
    reads_waits = False  # outstanding tokens and capacity only

    def __init__(self, ctx: PolicyContext | None = None):
        self._next = 0

    def choose(self, request: RequestInfo, candidates: Sequence[ReplicaState], now: float) -> str:
        # each candidate's key worked out once, the least ones picked out in C (``compress``)
        keys = [c.outstanding_tokens / (c.capacity_norm if c.capacity_norm > 0 else 1.0) for c in candidates]
        tied = list(compress(candidates, map(eq, keys, repeat(min(keys)))))
        self._next += 1
        return tied[self._next % len(tied)].id


@mypyc_attr(allow_interpreted_subclasses=True)
class PowerOfTwo(_Base):
    name = "po2"
    reads_waits = False  # loads and outstanding tokens only

    def __init__(self, ctx: PolicyContext | None = None):
        self._rng = random.Random(ctx.seed if ctx else 0)

    def choose(self, request: RequestInfo, candidates: Sequence[ReplicaState], now: float) -> str:
        if len(candidates) == 1:
            return candidates[0].id
        a, b = self._rng.sample(range(len(candidates)), 2)
        ca, cb = candidates[a], candidates[b]
        return (cb if (cb.load, cb.outstanding_tokens) < (ca.load, ca.outstanding_tokens) else ca).id


PlacementFactory = Callable[[PolicyContext], PlacementPolicy]

PLACEMENT_POLICIES: dict[str, PlacementFactory] = {
    "rr": RoundRobin,
    "jsq": JoinShortestQueue,
    "lot": LeastOutstandingTokens,
    "po2": PowerOfTwo,
}

# Names whose module registers them when imported (kept lazy: they may pull in heavier code).
_LAZY_PLACEMENT = {"aladdin": "hetserve.policies.aladdin_route", "eft": "hetserve.policies.finish_time"}


def register_placement(name: str, factory: PlacementFactory) -> None:
    """Add (or replace) a placement policy under ``name``."""
    PLACEMENT_POLICIES[name] = factory


def placement_names() -> list[str]:
    return sorted(set(PLACEMENT_POLICIES) | set(_LAZY_PLACEMENT))


def make_placement(name: str, ctx: PolicyContext | None = None) -> PlacementPolicy:
    """Build the placement policy called ``name`` (ValueError naming the choices if unknown)."""
    if name not in PLACEMENT_POLICIES and name in _LAZY_PLACEMENT:
        try:
            importlib.import_module(_LAZY_PLACEMENT[name])
        except ImportError as exc:
            raise ValueError(f"placement policy {name!r} is not available ({exc})") from exc
    if name not in PLACEMENT_POLICIES:
        raise ValueError(f"unknown placement policy {name!r}; choose one of {', '.join(placement_names())}")
    return PLACEMENT_POLICIES[name](ctx or PolicyContext())
