"""An upper bound on the throughput any pool layout of the pool can reach under the cost model.

Exact search stops at 8 GPUs; this answers "how good is this plan?" for any pool size. Two
relaxations; ``upper_bound`` returns the first, proven for every plan the planners build
(exact search and hexgen2 included, mixed plans too):

**1. Group columns** (``group_bound``; ``bound_columns`` and ``bound_groups``). A plan is a set of
groups, each with a composition (devices per kind) and a role. For every composition of at most
K devices (K = ``bound_groups.GROUP_K``, at least the largest TP degree a class allows) ``ColumnBounds`` computes
a ceiling per role that no layout of such a group beats — every TP split enumerated, layer splits
relaxed to reals under the cost model's own memory rule (so the decode batch is limited by the
KV memory left after the weights, which is what makes small replicas slow), the cost model's
per-layer times with its all-reduces, ``m = min(S, b)`` weight reads per decode step, and at
least one hand-off per machine change (proof term by term in ``bound_columns``). A group using
more than K devices has S ≥ 2 stages; it gets a per-group ceiling (prefill, colocated: the
prompt passes its fastest stage type's time L times) and per-device decode rates. A mixed-integer
programme then counts whole groups: devices per kind, prefill / decode balance, the shared-network
rows and the budget. Where the columns are machines, a group spread over machines takes (or
sends) each request's KV on each machine in proportion to the layers it holds there
(``bound_network.TiedRows``, ``bound_shares``): the KV crossing each pipe is tied to where the
layers must sit to reach the group's flow, and a request from a one-machine group keeps on its
machine at most the share of the layers the other group's devices there can hold. Kinds are
machine classes while their compositions number ≤ ``bound_groups.MAX_COLUMNS``; past that, GPU
types (a group's devices of a type may sit on any of its machines; a TP group is priced at the
type's best in-box link, as the kernel model prices the one-machine TP groups in scope), K lowered
if needed.
HiGHS stops after ``GROUP_NODE_LIMIT`` branch-and-bound nodes (deterministic) and its *dual*
bound is used, so an unfinished search still gives a bound; a plan's bound also stops where its
time limit does (``time_limit_s``: looser then, and flagged ``cut_short``). Scope: layouts whose TP groups are
devices of one class (same machine and GPU type) — every layout the planners build
(``LayoutSearch``); a hand-written plan with a TP group across machines or GPU types is covered
only by the per-device LP.

**Under SLO objectives** (goodput / cost: ``ctx.slo`` set) ``upper_bound`` is the smaller of the
group programme solved *without* the SLOs (``PlanContext.without_slo``) and the per-device LP. Both
count requests per T (tokens/s = requests per T × mean output / T, the same conversion for
goodput and throughput, so the units match). The group programme holds because every SLO
capacity is at most the throughput capacity of the same replica (``planner.slo`` caps decode and
colocated ones there; prefill's is T / TTFT × a load cap ≤ 1), the plan's flow network is the
same (KV edges and shared links do not depend on the SLOs), and a plan's value only grows with
its replicas' capacities. The per-device LP holds under SLOs (unlike for throughput, below):
the SLO capacity prices a colocated request exactly as the LP does, stand-alone TTFT plus
O / (tokens/s) at a batch no larger than the engine cap, and caps it lower still.

**2. Per-device LP** (``per_device_bound``; also ``device_rates``; ``upper_bound`` only under SLO
objectives, or where the programme has no columns): a linear programme over how many devices of
each kind serve prefill, decode or colocated replicas; its rows and why it is no bound for
colocated throughput: ``bound_devices``.

What the per-device LP leaves out: TP all-reduces and pipeline hand-offs, KV memory limiting the
decode batch below the cap, the integrality of groups and the tie of KV to layers — the group
columns keep all four (the tie where columns are machines). Both leave out the activation /
all-reduce traffic of groups across machines. The group programme prices the KV between a
one-machine group and a spread one per source (``bound_sources``: flow levels with share boxes
for the tied columns, memory shares for the others), but still routes by machine totals the KV
between two spread groups and that of groups past K (a transport relaxation of the layer overlap).
Running time: the LP milliseconds; the group programme a few seconds (``bench_planner bound``
prints it).

The cheapest device set for a rate (a lower bound on its price from this bound): ``planner.min_cost``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from scipy.optimize import linprog
from scipy.sparse import csr_array
from scipy.sparse import vstack as sparse_vstack

from hetserve.planner.bound import groups as bound_groups
from hetserve.planner.bound.columns import ROLES
from hetserve.planner.bound.devices import build_lp, device_kinds, lp_counts, role_rates

GROUP_NODE_LIMIT = 500  # HiGHS's MILP: past it its dual bound (still a bound) is used; deterministic
GROUP_TIME_LIMIT_S = 60.0  # per MILP run, a safety net only (wall time would make the bound depend on the load)


@dataclass(frozen=True)
class Bound:
    """The LP's optimum: tokens/s, requests per T, and the device counts per kind and role."""

    tokens_per_s: float
    requests_per_period: float
    counts: dict[tuple[str, str, str], float]  # (gpu, site, role) -> devices (fractional)
    binding: tuple[str, ...]  # names of the constraints with no slack at the optimum
    # group programme only, when its columns are machine kinds: the column groups of its best
    # integer point as ({"machine/gpu": devices}, role, how many) — a plan the planner can score
    incumbent: tuple = ()
    # the caller's time (``time_limit_s``) ran out before the solver finished: still a bound, a
    # looser one than the programme gives with the time it needs
    cut_short: bool = False
    wall_s: float = 0.0  # the solve's (a cached bound keeps its own)

    def to_dict(self) -> dict:
        return {"tokens_per_s": round(self.tokens_per_s, 3), "binding": list(self.binding)}


def upper_bound(ctx, budget_usd_per_hour: float | None = None, devices=None,
                node_limit: int = GROUP_NODE_LIMIT, time_limit_s: float | None = None) -> Bound:
    """The group-column programme for ``ctx`` (all devices, or only ``devices``); the per-device
    LP only where the programme has no columns. Not the smaller of the two: the per-device LP
    prices a colocated request as a prompt plus its decode steps, and the cost model's mixed
    steady state (prompts riding in decode steps) beats that, so on some pools exact search
    exceeds it (aladdin-v100 with llama-2-7b: 1,998 against 1,862 tokens/s). Under SLO
    objectives: the smaller of the programme without the SLOs and the per-device LP (both hold
    there; module docstring). ``time_limit_s``: the programme's solver stops there, with a looser
    bound (``Bound.cut_short``; ``group_bound``)."""
    if ctx.slo is None:
        groups = group_bound(ctx, budget_usd_per_hour, devices, node_limit, time_limit_s)
        return groups if groups is not None else per_device_bound(ctx, budget_usd_per_hour, devices)
    lp = per_device_bound(ctx, budget_usd_per_hour, devices)
    groups = group_bound(ctx.without_slo(), budget_usd_per_hour, devices, node_limit, time_limit_s)
    return lp if groups is None or lp.requests_per_period <= groups.requests_per_period else groups


def per_device_bound(ctx, budget_usd_per_hour: float | None = None, devices=None) -> Bound:
    """The per-device LP alone (``_build``)."""
    lp = build_lp(ctx, budget_usd_per_hour, devices)
    res = linprog(-lp.served, A_ub=lp.A, b_ub=lp.rhs, bounds=[(0, None)] * len(lp.served), method="highs")
    if res.status != 0:  # pragma: no cover - the LP is always feasible (all zeros) and bounded
        raise RuntimeError(f"upper-bound LP failed: {res.message}")
    req = -float(res.fun)
    # binding = a constraint whose relaxation would raise the optimum (non-zero dual value)
    duals = np.abs(res.ineqlin.marginals)
    binding = tuple(dict.fromkeys(n for n, y in zip(lp.names, duals) if y > 1e-9))
    return Bound(ctx.tokens_per_s(req), req, lp_counts(lp, res.x), binding)


# planning a pool prices its bound more than once: the bound and the time it was given (None: all
# it needed)
_CACHE: dict[tuple, tuple[Bound | None, float | None]] = {}
_CACHE_SIZE = 64


def _fingerprint(ctx, budget, devices, node_limit) -> tuple:
    """Everything the group bound reads: devices, links, shared resources, model, workload means,
    efficiencies and how each GPU type is priced, period, budget (clusters built in tests share names, so not the name)."""
    c = ctx.cluster
    devs = tuple((d.gpu.name, d.machine, d.site, d.memory_bytes, d.gpu.fp16_flops, d.gpu.mem_bandwidth,
                  d.gpu.usd_per_hour) for d in c.devices)
    return (devs, c.latency.tobytes(), c.bandwidth.tobytes(), tuple(sorted(ctx.resource_cap.items())),
            repr(ctx.model), ctx.input_tokens, ctx.output_tokens, ctx.period_s, repr(ctx.cost.eff),
            tuple(sorted(ctx.cost.pricing().items())),  # kernel-model or roofline prices
            budget, None if devices is None else tuple(devices), node_limit, bound_groups.GROUP_K,
            bound_groups.MAX_COLUMNS)


def group_bound(ctx, budget_usd_per_hour: float | None = None, devices=None,
                node_limit: int = GROUP_NODE_LIMIT, time_limit_s: float | None = None) -> Bound | None:
    """The group-column programme alone (None when the pool has no columns to offer, or under
    SLO objectives: ``upper_bound`` passes ``PlanContext.without_slo()``); cached by everything it reads.
    ``time_limit_s`` caps the solver's runs together (None: ``GROUP_TIME_LIMIT_S`` each); a bound
    they cut short is solved again by a call with more time."""
    if ctx.slo is not None:  # SLO capacities price colocated replicas by another formula
        return None
    key = _fingerprint(ctx, budget_usd_per_hour, devices, node_limit)
    hit = _CACHE.get(key)
    if hit is not None and _serves(hit, time_limit_s):
        return hit[0]
    if len(_CACHE) >= _CACHE_SIZE:
        _CACHE.pop(next(iter(_CACHE)))
    bound = _group_bound(ctx, budget_usd_per_hour, devices, node_limit, time_limit_s)
    _CACHE[key] = (bound, time_limit_s)
    return bound


def _serves(entry: tuple[Bound | None, float | None], wanted_s: float | None) -> bool:
    """A cached bound serves a call unless its solver was cut short and the call gives it more time."""
    bound, given_s = entry
    more_time = given_s is not None and (wanted_s is None or wanted_s > given_s)
    return bound is None or not bound.cut_short or not more_time


_COLUMNS: dict[tuple, object] = {}  # a pool's columns, shared by its budgets (min_cost's bisection)


def _group_bound(ctx, budget_usd_per_hour, devices, node_limit, time_limit_s) -> Bound | None:
    started = time.perf_counter()
    deadline = None if time_limit_s is None else started + time_limit_s
    mk = device_kinds(ctx, devices)
    key = _fingerprint(ctx, None, devices, None)
    if key not in _COLUMNS:
        if len(_COLUMNS) >= _CACHE_SIZE:
            _COLUMNS.pop(next(iter(_COLUMNS)))
        _COLUMNS[key] = bound_groups.columns(ctx, mk)
    cols = _COLUMNS[key]
    if cols is None:
        return None
    rates = [role_rates(ctx, k) for k in mk]
    relaxed, best, binding, used, incumbent, cut = bound_groups.solve(ctx, mk, rates, cols, budget_usd_per_hour,
                                                                      node_limit, GROUP_TIME_LIMIT_S, deadline)
    counts: dict[tuple[str, str, str], float] = {}
    for (g, role), n in used.items():
        k = mk[cols.kind_of.index(g)]
        site = k.site if cols.machine_kinds else "*"
        counts[(k.gpu, site, role)] = counts.get((k.gpu, site, role), 0.0) + n
    plan = ()
    if cols.machine_kinds:
        plan = tuple(({mk[g].machine + "/" + mk[g].gpu: n for g, n in enumerate(comp) if n}, role, count)
                     for comp, role, count in incumbent)
    return Bound(ctx.tokens_per_s(best), best, counts, binding, plan, cut, time.perf_counter() - started)


def per_device_min_cost(ctx, requests_per_period: float, devices=None) -> tuple[float, dict] | None:
    """The per-device LP minimising price for the rate: (usd per hour, device counts), or None
    when the LP cannot serve that much. A floor on the price only under SLO capacities (module
    docstring); ``planner.min_cost`` uses it there."""
    lp = build_lp(ctx, None, devices)
    A = sparse_vstack([lp.A, csr_array(-lp.served[None, :])])
    rhs = np.append(lp.rhs, -requests_per_period)
    res = linprog(lp.prices, A_ub=A, b_ub=rhs, bounds=[(0, None)] * len(lp.served), method="highs")
    if res.status != 0:
        return None
    return float(res.fun), lp_counts(lp, res.x)


def device_rates(ctx) -> dict[tuple[str, str], float]:
    """Per-device requests per T a device of each kind can add at best (the LP's loosest rate of
    its best role), for ranking kinds by value per dollar."""
    out = {}
    for k in device_kinds(ctx):
        r = role_rates(ctx, k)
        out[(k.gpu, k.site)] = max(out.get((k.gpu, k.site), 0.0), max(min(r[role]) for role in ROLES))
    return out
