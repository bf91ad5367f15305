"""The rows of the bounds' programmes: named rows, and the shared-network rows of the group one.

``Rows`` collects named constraint rows (both bounds); ``resource_rows`` the NIC / pipe rows
(both bounds). The group programme's KV rows come in two forms:

* ``loose_rows`` (GPU-type columns, or machine columns without ``tie``): what leaves machine m
  is at most Σ over columns of y × the column's share on m (its ceiling capped by its devices on
  m at their per-device rates and by the layers they can hold), likewise what arrives — each
  machine's share bounded on its own, so a group's KV may leave or reach it through any of them;
* ``TiedRows`` (machine columns): flow variables ``f[j, r]`` ≤ ceiling × y[j, r] per column and
  role, and for a column spanning machines its KV at each machine ``a[j, r, m]`` with
  Σ_m a = f; what leaves / reaches machine m *equals* the flows of the columns there (the KV
  routes u carry exactly that), and ``bound_shares`` adds the rows tying a to f by where the
  layers must sit (``cut_rows``, added for the columns the solver uses).
"""

from __future__ import annotations

import numpy as np
from scipy.sparse import csr_array

from hetserve.planner.bound.columns import ROLES


class Rows:
    """Rows ``coefs · x ≤ bound`` of a programme over ``nv`` variables, each with a name (for the
    binding constraints reported): call with ({variable: coefficient}, bound, name)."""

    def __init__(self, nv: int):
        self.nv = nv
        self.coefs: list[dict[int, float]] = []
        self.rhs: list[float] = []
        self.names: list[str] = []

    def __call__(self, coefs: dict[int, float], bound: float, name: str) -> None:
        self.coefs.append({i: float(c) for i, c in coefs.items() if c})
        self.rhs.append(bound)
        self.names.append(name)

    def equal(self, coefs: dict[int, float], bound: float, name: str) -> None:
        """``coefs · x = bound`` as two rows."""
        self(coefs, bound, name)
        self({i: -c for i, c in coefs.items()}, -bound, name)

    @property
    def A(self) -> np.ndarray:
        out = np.zeros((len(self.coefs), self.nv))
        for r, c in enumerate(self.coefs):
            for i, v in c.items():
                out[r, i] += v
        return out

    def sparse(self, nv: int | None = None) -> csr_array:
        """The rows as a CSR matrix (``nv`` columns: more than ``self.nv`` when variables were
        added after these rows were written)."""
        data, cols, ptr = [], [], [0]
        for c in self.coefs:
            cols += list(c)
            data += list(c.values())
            ptr.append(len(cols))
        return csr_array((np.array(data, dtype=float), np.array(cols, dtype=int), np.array(ptr)),
                         shape=(len(self.coefs), nv or self.nv))


def resource_rows(ctx, kinds, iu: dict, row) -> None:
    """Shared NICs and pipes: the KV routes ``u[m, m']`` (variable index ``iu[(m, m')]``, requests'
    worth of KV from machine m to m') that cross a resource carry at most its capacity in bytes.
    ``kinds``: anything with ``machine`` and a representative ``device`` per machine."""
    kv_bytes = ctx.input_tokens * ctx.model.kv_bytes_per_token
    rep = {k.machine: k.device for k in kinds}
    crossing: dict[str, list[int]] = {}
    for (a, b), i in iu.items():
        if a != b:
            for r in ctx.cluster.path(rep[a], rep[b]).resources:
                if r.name in ctx.resource_cap:
                    crossing.setdefault(r.name, []).append(i)
    for name, idx in sorted(crossing.items()):
        row({i: kv_bytes for i in idx}, ctx.resource_cap[name], f"network {name}")


def by_machine(mk) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for k, kind in enumerate(mk):
        out.setdefault(kind.machine, []).append(k)
    return out


def per_device(rates) -> list[list[float]]:
    """Per machine kind: the old LP's per-device prefill and decode rates (the smaller of its two)."""
    return [[min(r["prefill"]), min(r["decode"])] for r in rates]


def shares(ctx, mk, rates, cols, machines) -> np.ndarray:
    """(columns, prefill / decode, machines): requests per T of a group's KV that can leave
    (prefill) or reach (decode) machine m — at most its ceiling, the per-device rates of its
    devices on m, and its ceiling × the share of the layers those devices can hold."""
    m_, eff = ctx.model, ctx.cost.eff
    act = eff.activation_buffers * eff.activation_tokens * m_.hidden * m_.dtype_bytes
    room = [max(0.0, k.usable - act) / (m_.bytes_per_layer * m_.num_layers) for k in mk]
    pd = per_device(rates)
    on = by_machine(mk)
    out = np.zeros((len(cols.comps), 2, len(machines)))
    for j, comp in enumerate(cols.comps):
        for mi, m in enumerate(machines):
            held = sum(comp[cols.kind_of[k]] * room[k] for k in on[m])
            for r in range(2):
                here = sum(comp[cols.kind_of[k]] * pd[k][r] for k in on[m])
                if here > 0:
                    out[j, r, mi] = min(cols.caps[j, r], here, cols.caps[j, r] * min(1.0, held))
    return out


def dominated(cols, share: np.ndarray | None, spread: np.ndarray | None = None) -> np.ndarray:
    """(columns, roles) True where another column uses no more devices of any kind, has at
    least the ceiling and (prefill / decode) at least the share on every machine: any plan using
    the first can use the second instead and satisfy every row, so the first is left out. With
    tied KV rows (``spread``: columns across machines) a spread column is never left out in
    prefill / decode: a smaller one cannot always send its KV the same way."""
    comps = np.array(cols.comps, dtype=float)
    out = np.zeros((len(comps), 3), dtype=bool)
    for j in range(len(comps)):
        fewer = (comps <= comps[j]).all(axis=1)
        fewer[j] = False
        for r in range(3):
            if r < 2 and spread is not None and spread[j]:
                continue
            ok = fewer & (cols.caps[:, r] >= cols.caps[j, r])
            if share is not None and r < 2:
                ok &= (share[:, r, :] >= share[j, r, :]).all(axis=1)
            out[j, r] = ok.any()
    return out


def loose_rows(ctx, mk, rates, cols, machines, routes, iF, iy, iz, ix, big, row, share) -> None:
    """KV routes (``routes.RouteVars``) with each machine's share bounded on its own (see the
    module docstring)."""
    nk, nj = len(mk), len(cols.comps)
    row({iF: 1.0, **{i: -1.0 for i in routes.all()}}, 0.0, "KV routes")
    # x[k, r] (GPU-type columns only): machine-kind devices in prefill (r = 0) / decode (r = 1)
    for g in range(len(cols.counts) if not cols.machine_kinds else 0):
        members = [k for k in range(nk) if cols.kind_of[k] == g]
        for r in range(2):
            c = {ix + 2 * k + r: 1.0 for k in members}
            for j in range(nj):
                if cols.comps[j][g]:
                    c[iy + 3 * j + r] = -float(cols.comps[j][g])
            if big:
                c[iz + 3 * g + r] = -1.0
            row.equal(c, 0.0, f"machine devices of kind {g} ({ROLES[r]})")
    on = by_machine(mk)
    pd = per_device(rates)
    for mi, m in enumerate(machines):
        for r in range(2):
            flow = routes.leaving(m) if r == 0 else routes.reaching(m)
            role = ROLES[r]
            if not cols.machine_kinds:  # GPU-type columns: the machines' devices per role, per-device rates
                row({**flow, **{ix + 2 * k + r: -pd[k][r] for k in on[m]}}, 0.0, f"{role} on {m}")
                continue
            c = dict(flow)  # machine columns: each group's share on m (these imply the per-device rows)
            for j in range(nj):
                if share[j, r, mi] > 0:
                    c[iy + 3 * j + r] = -share[j, r, mi]
            if big:
                for k in on[m]:
                    c[iz + 3 * cols.kind_of[k] + r] = -pd[k][r]
            row(c, 0.0, f"{role} on {m} (groups)")
    routes.rows(row)


class TiedRows:
    """The tied KV rows of machine columns (module docstring), for the spread columns in ``tied``
    (the others keep the loose rows, summed per machine). Variables from index ``start``:
    f[j, r] (r = prefill, decode) of every one-machine or tied column, a[j, r, m] and x[j, r, m]
    of the tied ones on each of their machines, B[r, m] (big groups' flow at m), loose[r, m]
    (the untied spread columns' KV at m), g[r, m] (one-machine groups' flow kept on m)."""

    def __init__(self, ctx, mk, cols, machines, start: int, big: bool, tied=()):
        self.machines = machines
        on = by_machine(mk)
        self.where = [sorted({mi for mi, m in enumerate(machines) for k in on[m] if comp[cols.kind_of[k]]})
                      for comp in cols.comps]
        self.spread = np.array([len(w) > 1 for w in self.where])
        self.tied = sorted(int(j) for j in tied)
        self.loose = [int(j) for j in np.flatnonzero(self.spread) if int(j) not in set(self.tied)]
        m_, eff = ctx.model, ctx.cost.eff
        act = eff.activation_buffers * eff.activation_tokens * m_.hidden * m_.dtype_bytes
        room = [max(0.0, k.usable - act) / (m_.bytes_per_layer * m_.num_layers) for k in mk]
        # the largest share of the layers a column's devices on machine m can hold
        self.held = [[min(1.0, sum(comp[cols.kind_of[k]] * room[k] for k in on[m])) for m in machines]
                     for comp in cols.comps]
        nm = len(machines)
        i = start
        self.i_f: dict[tuple[int, int], int] = {}
        for j in [j for j in range(len(cols.comps)) if not self.spread[j]] + self.tied:
            for r in range(2):
                self.i_f[(j, r)] = i
                i += 1
        self.i_a: dict[tuple[int, int, int], int] = {}
        self.i_x: dict[tuple[int, int, int], int] = {}
        for j in self.tied:
            for r in range(2):
                for mi in self.where[j]:
                    self.i_a[(j, r, mi)], self.i_x[(j, r, mi)] = i, i + 1
                    i += 2
        self.i_B = i
        i += 2 * nm if big else 0
        self.i_L = i
        self.i_g = i + 2 * nm
        self.nv = i + 4 * nm
        self.big = big

    def f(self, j: int, r: int) -> int:
        return self.i_f[(j, r)]

    def at(self, j: int, r: int, mi: int) -> int:
        """The variable carrying column j's role-r KV at machine ``mi``."""
        return self.i_a[(j, r, mi)] if self.spread[j] else self.f(j, r)

    def rows(self, ctx, mk, rates, cols, iu, iF, iy, iz, ib, iD, row, share) -> None:
        machines = self.machines
        on = by_machine(mk)
        pd = per_device(rates)
        row({iF: 1.0, **{i: -1.0 for i in iu.values()}}, 0.0, "KV routes")
        for (j, r), i in self.i_f.items():
            row({i: 1.0, iy + 3 * j + r: -cols.caps[j, r]}, 0.0, f"{ROLES[r]} flow ≤ ceilings")
        for j in self.tied:
            for r in range(2):
                row.equal({self.f(j, r): 1.0, **{self.at(j, r, mi): -1.0 for mi in self.where[j]}}, 0.0,
                          f"{ROLES[r]} KV of a spread group, summed over its machines")
                for mi in self.where[j]:
                    row({self.at(j, r, mi): 1.0, iy + 3 * j + r: -share[j, r, mi]}, 0.0,
                        f"{ROLES[r]} on {machines[mi]} (groups)")
        for r in range(2):  # the untied spread columns: their shares on each machine, their ceilings in all
            for mi, m in enumerate(machines):
                row({self.i_L + 2 * mi + r: 1.0, **{iy + 3 * j + r: -share[j, r, mi] for j in self.loose
                                                    if mi in self.where[j]}}, 0.0, f"{ROLES[r]} on {m} (groups)")
            row({**{self.i_L + 2 * mi + r: 1.0 for mi in range(len(machines))},
                 **{iy + 3 * j + r: -cols.caps[j, r] for j in self.loose}}, 0.0, f"{ROLES[r]} of spread groups")
        for mi, m in enumerate(machines):
            for r in range(2):
                c = {i: 1.0 for p, i in iu.items() if p[r] == m}
                for j in range(len(cols.comps)):
                    if (j, r) in self.i_f and mi in self.where[j]:
                        c[self.at(j, r, mi)] = -1.0
                c[self.i_L + 2 * mi + r] = -1.0
                if self.big:
                    c[self.i_B + 2 * mi + r] = -1.0
                    row({self.i_B + 2 * mi + r: 1.0, **{iz + 3 * cols.kind_of[k] + r: -pd[k][r] for k in on[m]}}, 0.0,
                        f"{ROLES[r]} on {m} (big groups)")
                row.equal(c, 0.0, f"{ROLES[r]} KV on {m}")
        if self.big:
            row({**{self.i_B + 2 * mi: 1.0 for mi in range(len(machines))},
                 **{ib + 3 * s: -cols.big_pf[s] for s in range(len(cols.big_stages))}}, 0.0, "big prefill flow")
            row({**{self.i_B + 2 * mi + 1: 1.0 for mi in range(len(machines))}, iD: -1.0}, 0.0, "big decode flow")
        self.local_rows(cols, iu, row)
        resource_rows(ctx, mk, iu, row)

    def local_rows(self, cols, iu, row) -> None:
        """KV that stays on its machine. A request prefilled by a group on one machine p and
        decoded by a group spread over machines keeps on p only the share of its KV for the
        layers the decode group holds there, at most what its devices on p can hold
        (``held``); symmetrically for a spread prefill group feeding a group on one machine.
        So u[p, p] ≤ (KV spread prefill groups send from p) + (big groups' and untied spread
        groups' KV on p) + g[p] + Σ_j held[j, p]·x[j, p], with g[p] the flow from p's
        one-machine prefill groups to p's one-machine decode groups, x[j, p] their flow into
        tied spread decode column j, together at most p's one-machine prefill flow, and
        Σ_p x[j, p] ≤ f[j] (and the mirror image for decode)."""
        machines = self.machines
        single = [[j for j in range(len(cols.comps)) if not self.spread[j] and self.where[j] == [mi]]
                  for mi in range(len(machines))]
        for r in range(2):  # r: the role of the spread column (decode: r = 1, its sources prefill)
            o = 1 - r
            for mi, m in enumerate(machines):
                c = {iu[(m, m)]: 1.0, self.i_g + 2 * mi + r: -1.0,
                     self.i_L + 2 * mi: -1.0, self.i_L + 2 * mi + 1: -1.0}
                for (j, rr, mm), i in self.i_a.items():
                    if rr == o and mm == mi:
                        c[i] = -1.0
                if self.big:  # big groups' KV on m: any of it may stay there
                    c[self.i_B + 2 * mi] = c[self.i_B + 2 * mi + 1] = -1.0
                for j in self.tied:
                    if mi in self.where[j]:
                        c[self.i_x[(j, r, mi)]] = -self.held[j][mi]
                row(c, 0.0, f"local KV on {m}")
                own = {self.f(j, o): -1.0 for j in single[mi]}
                row({self.i_g + 2 * mi + r: 1.0, **{self.i_x[(j, r, mi)]: 1.0 for j in self.tied
                                                    if mi in self.where[j]}, **own}, 0.0,
                    f"one-machine {ROLES[o]} flow on {m}")
                row({self.i_g + 2 * mi + r: 1.0, **{self.f(j, r): -1.0 for j in single[mi]}}, 0.0,
                    f"one-machine {ROLES[r]} flow on {m}")
            for j in self.tied:
                row({**{self.i_x[(j, r, q)]: 1.0 for q in self.where[j]}, self.f(j, r): -1.0}, 0.0,
                    f"{ROLES[r]} flow of a spread group by source")

    def cut_rows(self, j: int, r: int, mi: int, lines, iy: int, row) -> None:
        """``a[j, r, m] ≥ s·f[j, r] − t·y[j, r]`` for each (s, t) of ``bound_shares.facets``."""
        y, f, a = iy + 3 * j + r, self.f(j, r), self.at(j, r, mi)
        for s, t in lines:
            row({f: s, y: -t, a: -1.0}, 0.0, f"{ROLES[r]} KV on {self.machines[mi]} by layers")
