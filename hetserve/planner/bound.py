"""An upper bound on the throughput any placement of the pool can reach under the cost model.

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
types (TP groups across machines allowed at the type's best link), K lowered if needed.
HiGHS stops after ``GROUP_NODE_LIMIT`` branch-and-bound nodes (deterministic) and its *dual*
bound is used, so an unfinished search still gives a bound; a plan's bound also stops where its
time limit does (``time_limit_s``: looser then, and flagged ``cut_short``). Scope: layouts whose TP groups are
devices of one class (same machine and GPU type) — every layout the planners build
(``LayoutSearch``); a hand-written plan with a TP group across machines or GPU types is covered
only by the per-device LP.

**Under SLO objectives** (goodput / cost: ``ctx.slo`` set) ``upper_bound`` is the smaller of the
group programme solved *without* the SLOs (``throughput_context``) and the per-device LP. Both
count requests per T (tokens/s = requests per T × mean output / T, the same conversion for
goodput and throughput, so the units match). The group programme holds because every SLO
capacity is at most the throughput capacity of the same replica (``planner.slo`` caps decode and
colocated ones there; prefill's is T / TTFT × a load cap ≤ 1), the plan's flow network is the
same (KV edges and shared links do not depend on the SLOs), and a plan's value only grows with
its replicas' capacities. The per-device LP holds under SLOs (unlike for throughput, below):
the SLO capacity prices a colocated request exactly as the LP does, stand-alone TTFT plus
O / (tokens/s) at a batch no larger than the engine cap, and caps it lower still.

**2. Per-device LP** (``per_device_bound``; also ``device_rates``; ``upper_bound`` only under SLO
objectives, or where the programme has no columns). A linear programme (scipy ``linprog``,
HiGHS) over how many devices of each kind (GPU type × site) serve prefill, decode or colocated
replicas, meant as a relaxation of the cost model. **It is none for throughput capacities of
colocated replicas**: it prices a colocated request as its prompt plus its decode steps, while
the cost model's mixed steady state (issue 9: prompts ride in decode steps and share their
weight reads) costs less, and exact search beats it on several pools (aladdin-v100 and the
island pools of bench_planner with llama-2-7b: up to 1.35×; see ``tests/planner/test_bound_groups.py``).
``planner.objectives`` still reads its device counts as a *heuristic* guide to which GPUs to
rent (milliseconds), never as a bound. Its rows:

* **compute** and **memory bandwidth** (roofline). A stage's time per layer is at least its
  work over its TP group's summed FLOP/s or bytes/s (the cost model paces a TP group by its
  slowest device, so the sum over the group is an over-estimate), and Σ layers = L, so:

  - prefill capacity (T / TTFT of the mean prompt) ≤ T·F_g / (L·F1) and ≤ T·M_g / (L·B1), with
    F1, B1 the FLOPs and bytes of one layer for one prompt and F_g, M_g the group's sums;
    also ≤ T·τ·f_max / (L·F1) per group (one stage is at most a TP group of τ devices), and a
    group must hold the weights, so the prefill groups number at most U_p / W;
  - decode tokens/s ≤ F_g / (L·(2P + 4q·c̄)) and ≤ b·M_g / (L·(W_l + b·c̄·kv)) at the engine's
    batch cap b (``Efficiency.max_batch``; the fraction grows with b), c̄ = I + O/2 tokens of
    context per request; a pipeline of m micro-batches reads its weights m ≥ 1 times a step;
  - a colocated request costs TTFT + O / (tokens/s): the same terms added, and the mixed
    compute-plus-bandwidth ones bounded by tangent planes of the concave T / (a/F + b/M).

  These are per-device additive, hence linear in the device counts.
* **prefill / decode balance**: the disaggregated part serves at most min(Σ prefill, Σ decode).
* **shared network** (when the cluster has shared NICs and pipes): the KV flow splits into
  machine-to-machine parts, each bounded by the prefill / decode rates of the machines at its
  ends; every part loads the NICs and pipes on its path with its KV bytes (``_network_rows``).
* **budget**: Σ price × devices used ≤ the budget, when one is set.

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

import dataclasses
import time
from dataclasses import dataclass

import numpy as np
from scipy.optimize import linprog

from hetserve.planner import bound_groups
from hetserve.planner.bound_network import Rows, resource_rows

ROLES = ("prefill", "decode", "colocated")
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


@dataclass(frozen=True)
class _Kind:
    gpu: str
    site: str
    machine: str
    device: int  # a representative device (for network paths)
    count: int
    flops: float  # achieved FLOP/s of one device
    membw: float  # achieved bytes/s
    usable: float  # usable bytes
    usd_per_hour: float | None


def _kinds(ctx, devices=None) -> list[_Kind]:
    cost = ctx.cost
    groups: dict[tuple[str, str, str], list[int]] = {}
    for d in (ctx.cluster.devices if devices is None else [ctx.cluster.devices[i] for i in devices]):
        groups.setdefault((d.gpu.name, d.site, d.machine), []).append(d.index)
    out = []
    for (gpu, site, machine), idx in sorted(groups.items()):
        d = idx[0]
        out.append(_Kind(gpu, site, machine, d, len(idx), cost._flops[d], cost._membw[d], cost._memory[d],
                         ctx.cluster.devices[d].gpu.usd_per_hour))
    return out


def _rates(ctx, k: _Kind) -> dict[str, list[float]]:
    """Per-device upper bounds (requests per T) of each role: one list of linear rates per role;
    a group's capacity is at most the sum over its devices of every one of them."""
    m, T = ctx.model, ctx.period_s
    I, O = max(1, round(ctx.input_tokens)), ctx.output_tokens
    L, P, q, kv = m.num_layers, m.params_per_layer, m.q_dim, m.kv_bytes_per_token_per_layer
    W_l = m.bytes_per_layer
    b = ctx.cost.eff.max_batch
    cbar = ctx.input_tokens + O / 2
    F1 = 2.0 * P * I + 2.0 * q * I * I
    B1 = W_l + I * kv
    a1, b1 = L * F1, L * B1  # prefill: seconds × FLOP/s, seconds × bytes/s
    a2 = O * L * (2.0 * P + 4.0 * q * cbar)  # decode of one request's output
    b2 = O * L * (W_l / b + cbar * kv)
    f, bw = k.flops, k.membw
    colocated = [T * f / (a1 + a2), T * bw / (b1 + b2)]
    return {
        "prefill": [T * f / a1, T * bw / b1],
        "decode": [T * f / a2, T * bw / b2],
        "colocated": colocated,
        "_mixed": [a1, a2, b1, b2],
    }


@dataclass
class _LP:
    kinds: list
    A: np.ndarray
    rhs: np.ndarray
    names: list[str]
    prices: np.ndarray  # $/h of each variable (0 for the sums)
    served: np.ndarray  # coefficients of requests per T served (Fl + Cv)


def _build(ctx, budget_usd_per_hour: float | None = None, devices=None) -> _LP:
    """The LP's constraints (``A x ≤ rhs``, x ≥ 0) for ``ctx``'s pool or only ``devices``."""
    kinds = _kinds(ctx, devices)
    T = ctx.period_s
    nk = len(kinds)
    # variables: x[k, role] (3 per kind), then Pv, Dv, Cv, Fl, then (shared network only) u[m, m']:
    # requests' worth of KV cache (layer fractions) prefilled on machine m and decoded on m'
    nx = 3 * nk
    iP, iD, iC, iF = nx, nx + 1, nx + 2, nx + 3
    machines = sorted({k.machine for k in kinds})
    network = bool(getattr(ctx, "resources", None))
    pairs = [(a, b) for a in machines for b in machines] if network else []
    iu = {pair: nx + 4 + j for j, pair in enumerate(pairs)}
    nv = nx + 4 + len(pairs)
    row = Rows(nv)

    rates = [_rates(ctx, k) for k in kinds]
    for j, k in enumerate(kinds):
        row({3 * j + r: 1.0 for r in range(3)}, float(k.count), f"devices {k.gpu}@{k.site}")
    sums = {"prefill": iP, "decode": iD, "colocated": iC}
    labels = {0: "compute", 1: "memory bandwidth"}
    for r, role in enumerate(ROLES):
        for t in range(2):
            row({sums[role]: 1.0, **{3 * j + r: -rates[j][role][t] for j in range(nk)}}, 0.0, f"{role} {labels[t]}")
    # prefill: each group ≤ one TP group of the fastest kind; groups ≤ usable memory / weights
    m = ctx.model
    tau = max(ctx.layouts.tp_ok[-1] if ctx.layouts.tp_ok else 1, 1)
    tau = min(tau, max(ctx.class_counts))
    I = max(1, round(ctx.input_tokens))
    F1 = 2.0 * m.params_per_layer * I + 2.0 * m.q_dim * I * I
    per_group = T * tau * max(k.flops for k in kinds) / (m.num_layers * F1)
    row({iP: 1.0, **{3 * j: -per_group * k.usable / m.weight_bytes for j, k in enumerate(kinds)}}, 0.0,
        "prefill groups (memory) × one TP group each")
    # colocated: tangent planes of T / (a/F + b/M) at each kind's (f, m) and at the pool's
    a1, a2, b1, b2 = rates[0]["_mixed"]
    points = [(k.flops, k.membw) for k in kinds] + [(sum(k.flops * k.count for k in kinds),
                                                     sum(k.membw * k.count for k in kinds))]
    for a, bb in ((a1, b2), (a2, b1)):
        for F0, M0 in points:
            g = T / (a / F0 + bb / M0) ** 2
            gF, gM = g * a / F0 ** 2, g * bb / M0 ** 2
            row({iC: 1.0, **{3 * j + 2: -(gF * k.flops + gM * k.membw) for j, k in enumerate(kinds)}}, 0.0,
                "colocated compute + bandwidth")
    row({iF: 1.0, iP: -1.0}, 0.0, "prefill capacity")
    row({iF: 1.0, iD: -1.0}, 0.0, "decode capacity")
    if network:
        _network_rows(ctx, kinds, rates, machines, iu, iF, row)
    prices = np.zeros(nv)
    for j, k in enumerate(kinds):  # (the u variables cost nothing)
        prices[3 * j:3 * j + 3] = k.usd_per_hour or 0.0
    if budget_usd_per_hour is not None:
        row({i: prices[i] for i in range(nx)}, float(budget_usd_per_hour), "budget")
    served = np.zeros(nv)
    served[iF] = served[iC] = 1.0
    return _LP(kinds, row.A, np.array(row.rhs), row.names, prices, served)


def _network_rows(ctx, kinds, rates, machines, iu, iF, row) -> None:
    """Shared NICs and pipes (issue 9's capacity nodes): the flow splits into u[m, m'] — the
    requests' worth of KV (as layer fractions) prefilled on machine m and decoded on m'. What
    leaves m is at most m's prefill devices' rates (a group's layers on m run on m's devices, so
    the per-device bounds hold per machine), what arrives at m' at most its decode devices';
    u[m, m'] × KV bytes per request crosses every resource on the path m → m'."""
    row({iF: 1.0, **{i: -1.0 for i in iu.values()}}, 0.0, "KV routes")
    by_machine: dict[str, list[int]] = {}
    for j, k in enumerate(kinds):
        by_machine.setdefault(k.machine, []).append(j)
    for m in machines:
        for t in range(2):
            row({**{iu[(m, b)]: 1.0 for b in machines}, **{3 * j: -rates[j]["prefill"][t] for j in by_machine[m]}},
                0.0, f"prefill on {m}")
            row({**{iu[(a, m)]: 1.0 for a in machines}, **{3 * j + 1: -rates[j]["decode"][t] for j in by_machine[m]}},
                0.0, f"decode on {m}")
    resource_rows(ctx, kinds, iu, row)


def _counts(lp: _LP, x) -> dict[tuple[str, str, str], float]:
    out: dict[tuple[str, str, str], float] = {}
    for j, k in enumerate(lp.kinds):
        for r, role in enumerate(ROLES):
            if x[3 * j + r] > 1e-9:
                out[(k.gpu, k.site, role)] = out.get((k.gpu, k.site, role), 0.0) + float(x[3 * j + r])
    return out


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
    groups = group_bound(throughput_context(ctx), budget_usd_per_hour, devices, node_limit, time_limit_s)
    return lp if groups is None or lp.requests_per_period <= groups.requests_per_period else groups


def throughput_context(ctx):
    """``ctx`` without its SLOs: the same pool, model, workload, period and efficiencies, with
    throughput capacities (what bounds goodput; ``ctx`` itself when it has no SLOs)."""
    if ctx.slo is None:
        return ctx
    from hetserve.planner.context import PlanContext  # (the context reads the planner's layers)

    options = dataclasses.replace(ctx.options, objective="throughput", slo_ttft_s=None, slo_tpot_s=None,
                                  rate=None, budget_usd_per_hour=None)
    return PlanContext(ctx.cluster, ctx.model, ctx.workload, options)


def per_device_bound(ctx, budget_usd_per_hour: float | None = None, devices=None) -> Bound:
    """The per-device LP alone (``_build``)."""
    lp = _build(ctx, budget_usd_per_hour, devices)
    res = linprog(-lp.served, A_ub=lp.A, b_ub=lp.rhs, bounds=[(0, None)] * len(lp.served), method="highs")
    if res.status != 0:  # pragma: no cover - the LP is always feasible (all zeros) and bounded
        raise RuntimeError(f"upper-bound LP failed: {res.message}")
    req = -float(res.fun)
    # binding = a constraint whose relaxation would raise the optimum (non-zero dual value)
    duals = np.abs(res.ineqlin.marginals)
    binding = tuple(dict.fromkeys(n for n, y in zip(lp.names, duals) if y > 1e-9))
    return Bound(ctx.tokens_per_s(req), req, _counts(lp, res.x), binding)


# planning a pool prices its bound more than once: the bound and the time it was given (None: all
# it needed)
_CACHE: dict[tuple, tuple[Bound | None, float | None]] = {}
_CACHE_SIZE = 64


def _fingerprint(ctx, budget, devices, node_limit) -> tuple:
    """Everything the group bound reads: devices, links, shared resources, model, workload means,
    efficiencies, period, budget (clusters built in tests share names, so not the name)."""
    c = ctx.cluster
    devs = tuple((d.gpu.name, d.machine, d.site, d.memory_bytes, d.gpu.fp16_flops, d.gpu.mem_bandwidth,
                  d.gpu.usd_per_hour) for d in c.devices)
    return (devs, c.latency.tobytes(), c.bandwidth.tobytes(), tuple(sorted(ctx.resource_cap.items())),
            repr(ctx.model), ctx.input_tokens, ctx.output_tokens, ctx.period_s, repr(ctx.cost.eff),
            budget, None if devices is None else tuple(devices), node_limit, bound_groups.GROUP_K,
            bound_groups.MAX_COLUMNS)


def group_bound(ctx, budget_usd_per_hour: float | None = None, devices=None,
                node_limit: int = GROUP_NODE_LIMIT, time_limit_s: float | None = None) -> Bound | None:
    """The group-column programme alone (None when the pool has no columns to offer, or under
    SLO objectives: ``upper_bound`` passes ``throughput_context``); cached by everything it reads.
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
    mk = _kinds(ctx, devices)
    key = _fingerprint(ctx, None, devices, None)
    if key not in _COLUMNS:
        if len(_COLUMNS) >= _CACHE_SIZE:
            _COLUMNS.pop(next(iter(_COLUMNS)))
        _COLUMNS[key] = bound_groups.columns(ctx, mk)
    cols = _COLUMNS[key]
    if cols is None:
        return None
    rates = [_rates(ctx, k) for k in mk]
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
    lp = _build(ctx, None, devices)
    A = np.vstack([lp.A, -lp.served])
    rhs = np.append(lp.rhs, -requests_per_period)
    res = linprog(lp.prices, A_ub=A, b_ub=rhs, bounds=[(0, None)] * len(lp.served), method="highs")
    if res.status != 0:
        return None
    return float(res.fun), _counts(lp, res.x)


def device_rates(ctx) -> dict[tuple[str, str], float]:
    """Per-device requests per T a device of each kind can add at best (the LP's loosest rate of
    its best role), for ranking kinds by value per dollar."""
    out = {}
    for k in _kinds(ctx):
        r = _rates(ctx, k)
        out[(k.gpu, k.site)] = max(out.get((k.gpu, k.site), 0.0), max(min(r[role]) for role in ROLES))
    return out
