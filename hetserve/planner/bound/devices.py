"""The per-device LP: a relaxation of the cost model over device *kinds* (GPU type × site × machine),
read by ``planner.bound`` (its ``per_device_bound``, ``per_device_min_cost``, ``device_rates``) and,
for its kinds and per-device rates, by the group programme there.

A linear programme (scipy ``linprog``, HiGHS) over how many devices of each kind serve prefill,
decode or colocated replicas, meant as a relaxation of the cost model. **It is none for throughput capacities of
colocated replicas**: it prices a colocated request as its prompt plus its decode steps, while
the cost model's mixed steady state (prompts ride in decode steps and share their
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

"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hetserve.planner.bound.columns import ROLES
from hetserve.planner.bound.routes import RouteVars
from hetserve.planner.bound.rows import Rows


@dataclass(frozen=True)
class DeviceKind:
    """The devices of one GPU type on one machine, with the cost model's figures for one of them."""

    gpu: str
    site: str
    machine: str
    device: int  # a representative device (for network paths)
    count: int
    flops: float  # achieved FLOP/s of one device
    membw: float  # achieved bytes/s
    usable: float  # usable bytes
    usd_per_hour: float | None


def device_kinds(ctx, devices=None) -> list[DeviceKind]:
    """``ctx``'s devices (or only ``devices``) by GPU type, site and machine, in that order."""
    cost = ctx.cost
    groups: dict[tuple[str, str, str], list[int]] = {}
    for d in (ctx.cluster.devices if devices is None else [ctx.cluster.devices[i] for i in devices]):
        groups.setdefault((d.gpu.name, d.site, d.machine), []).append(d.index)
    out = []
    for (gpu, site, machine), idx in sorted(groups.items()):
        d = idx[0]
        out.append(DeviceKind(gpu, site, machine, d, len(idx), cost._flops[d], cost._membw[d], cost._memory[d],
                              ctx.cluster.devices[d].gpu.usd_per_hour))
    return out


def role_rates(ctx, k: DeviceKind) -> dict[str, list[float]]:
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
class DeviceLP:
    kinds: list
    A: object  # scipy sparse rows (CSR)
    rhs: np.ndarray
    names: list[str]
    prices: np.ndarray  # $/h of each variable (0 for the sums)
    served: np.ndarray  # coefficients of requests per T served (Fl + Cv)


def build_lp(ctx, budget_usd_per_hour: float | None = None, devices=None) -> DeviceLP:
    """The LP's constraints (``A x ≤ rhs``, x ≥ 0) for ``ctx``'s pool or only ``devices``."""
    kinds = device_kinds(ctx, devices)
    T = ctx.period_s
    nk = len(kinds)
    # variables: x[k, role] (3 per kind), then Pv, Dv, Cv, Fl, then (shared network only) u[m, m']:
    # requests' worth of KV cache (layer fractions) prefilled on machine m and decoded on m'
    nx = 3 * nk
    iP, iD, iC, iF = nx, nx + 1, nx + 2, nx + 3
    machines = sorted({k.machine for k in kinds})
    network = bool(getattr(ctx, "resources", None))
    routes = RouteVars(ctx, kinds, machines, nx + 4) if network else None
    nv = routes.nv if routes else nx + 4
    row = Rows(nv)

    rates = [role_rates(ctx, k) for k in kinds]
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
        _network_rows(kinds, rates, machines, routes, iF, row)
    prices = np.zeros(nv)
    for j, k in enumerate(kinds):  # (the u variables cost nothing)
        prices[3 * j:3 * j + 3] = k.usd_per_hour or 0.0
    if budget_usd_per_hour is not None:
        row({i: prices[i] for i in range(nx)}, float(budget_usd_per_hour), "budget")
    served = np.zeros(nv)
    served[iF] = served[iC] = 1.0
    return DeviceLP(kinds, row.sparse(), np.array(row.rhs), row.names, prices, served)


def _network_rows(kinds, rates, machines, routes, iF, row) -> None:
    """Shared NICs and pipes (the planner's capacity nodes): the flow splits into KV routes
    between machines (``routes.RouteVars``: requests' worth of KV, as layer fractions, prefilled
    on machine m and decoded on m'). What leaves m is at most m's prefill devices' rates (a group's
    layers on m run on m's devices, so the per-device bounds hold per machine), what arrives at m'
    at most its decode devices'; every route's KV bytes cross the resources on its path."""
    row({iF: 1.0, **{i: -1.0 for i in routes.all()}}, 0.0, "KV routes")
    by_machine: dict[str, list[int]] = {}
    for j, k in enumerate(kinds):
        by_machine.setdefault(k.machine, []).append(j)
    for m in machines:
        for t in range(2):
            row({**routes.leaving(m), **{3 * j: -rates[j]["prefill"][t] for j in by_machine[m]}}, 0.0, f"prefill on {m}")
            row({**routes.reaching(m), **{3 * j + 1: -rates[j]["decode"][t] for j in by_machine[m]}}, 0.0,
                f"decode on {m}")
    routes.rows(row)


def lp_counts(lp: DeviceLP, x) -> dict[tuple[str, str, str], float]:
    """Devices per (GPU, site, role) at the LP's solution ``x`` (fractional)."""
    out: dict[tuple[str, str, str], float] = {}
    for j, k in enumerate(lp.kinds):
        for r, role in enumerate(ROLES):
            if x[3 * j + r] > 1e-9:
                out[(k.gpu, k.site, role)] = out.get((k.gpu, k.site, role), 0.0) + float(x[3 * j + r])
    return out
