"""The group-column programme of ``planner.bound``: integer numbers of groups per composition.

Variables: ``y[j, r]`` — how many groups of composition ``j`` (device counts per kind, at most
K devices; ``bound_columns``) serve in role ``r`` (integers); ``z[g, r]`` — devices of kind ``g``
in groups of more than K devices, and their groups and capacities (``big_rows``); ``x[k, r]`` — devices of each
machine kind (the old LP's kinds) in prefill / decode; ``F`` — requests per T through the
prefill → decode network; ``u[m, m']`` — its KV prefilled on machine m and decoded on m'; with
machine columns and shared links, the KV variables of ``bound_network.TiedRows``.

Rows (every real plan, read as the groups it holds, satisfies them — hence a bound):

* devices per kind; the big groups' rows (``big_rows``: K + 1 devices a group, decode groups by
  their stage count);
* F ≤ Σ prefill ceilings, F ≤ Σ decode ceilings (columns' ``ColumnBounds`` values, big groups'
  per-group / per-device ceilings);
* shared network: Σ u = F; u × KV bytes ≤ each NIC / pipe on the path. GPU-type columns
  (``bound_network.loose_rows``): what leaves machine m is at most the prefill capacity there
  (per machine kind the old per-device rates), likewise what arrives. Machine columns
  (``bound_network.TiedRows``): what leaves / reaches m *equals* the KV of the groups there — a
  one-machine group's whole flow, a spread group's KV on m (``a[j, r, m]``, Σ_m a = its flow,
  a ≤ its ceiling capped by the layers and per-device rates there), big groups' flow there;
  KV kept on m is bounded by what can stay (a request from a one-machine prefill group into a
  spread decode group keeps on its machine at most the share of the layers the decode group's
  devices there can hold, and the mirror image); and ``bound_shares``'s lines tie a spread
  group's KV on each machine to its flow (serving more needs more of the layers where memory
  and speed are); ``bound_sources`` prices the KV per source (flow levels of the tied spread
  columns with share boxes, the one-machine groups' flow split by partner, and the KV between a
  one-machine group and every set of other machines at least what those partners send). Spread
  columns get these rows lazily: first as the loose per-machine sums,
  then tied once the LP or the MILP uses them (rounds; each round's programme is a relaxation
  of the fully tied one, so each value is a bound — the last MILP's dual bound is returned);
* budget: Σ price × devices ≤ B.

Objective F + Σ colocated ceilings. Solved by HiGHS (``scipy.optimize.milp``) with a node limit
(deterministic: the same pool gives the same bound on any machine), a 0.2 % gap and a time
limit as a safety net, or the caller's deadline (``solve``'s, a plan's time limit); the bound returned is the solver's dual bound (valid whether or not it
proved the optimum), and never above the LP relaxation's value. Columns another column
dominates (no more devices of any kind, at least the ceiling and the machine shares) are fixed
at zero: a plan using one can use the other (not for spread columns in prefill / decode under
tied KV rows: a smaller group cannot always send its KV the same way).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
from scipy.sparse import csr_array, diags
from scipy.sparse import vstack as sparse_vstack

from hetserve.planner.bound.big_rows import BigVars, big_integers, big_rows
from hetserve.planner.bound.columns import ROLES, ColumnBounds, Kind
from hetserve.planner.bound.milp import dual_bound, run_milp, solve_lp
from hetserve.planner.bound.routes import RouteVars
from hetserve.planner.bound.rows import Rows, TiedRows, dominated, loose_rows, shares
from hetserve.planner.bound.shares import facets, share_ceilings
from hetserve.planner.bound.sources import SourceRows, levels

GROUP_K = 8  # columns: groups of at most this many devices (at least the largest TP degree)
MAX_COLUMNS = 2000  # compositions per programme; past it, GPU types instead of machines, then a smaller K
MAX_ALL_COLUMNS = 1000  # every composition of the pool as a column (no big groups) while they are at most this many


@dataclass
class Columns:
    comps: list[tuple[int, ...]]  # counts per column kind
    caps: np.ndarray  # (columns, 3) requests per T
    kind_of: list[int]  # machine kind (old LP kind) -> column kind
    machine_kinds: bool  # column kinds are machine kinds (one-to-one)
    big_stages: list[tuple[int, int]]  # (column kind, TP degree) a big group's fastest stage may be
    big_pf: np.ndarray  # ceiling of one big prefill group whose fastest stage is of each stage kind
    big_col: np.ndarray  # ceiling of one big colocated group whose best stage is of each stage kind
    big_dec: np.ndarray  # per-device decode rate of each column kind in a big group
    big_dec_stages: np.ndarray  # (stage kinds, stage-count buckets): per-device decode rate (``big_rows``)
    K: int
    counts: list[int]
    prices: list[float]
    big_colocated_columns: bool  # compositions past K devices are columns too (colocated only)


def columns(ctx, mk) -> Columns | None:
    """The column kinds, compositions and ceilings for ``mk`` (the machine kinds in play):
    machine kinds when their compositions of at most K devices number at most
    ``MAX_COLUMNS``, else GPU types (the best link of each type), K lowered until they fit."""
    members = _members(ctx)
    machine = [_column_kind(ctx, [k], members) for k in mk]
    by_type: dict[tuple, list] = {}
    for k in mk:
        by_type.setdefault((k.gpu, k.flops, k.membw, k.usable), []).append(k)
    t_max = max((t for t in ctx.layouts.tp_ok if t <= max(k.count for k in mk)), default=1)
    k_cap = max(GROUP_K, t_max)
    for kinds, kind_of in ((machine, list(range(len(mk)))),
                           ([_column_kind(ctx, ks, members) for ks in by_type.values()],
                            [list(by_type).index((k.gpu, k.flops, k.membw, k.usable)) for k in mk])):
        counts = [k.count for k in kinds]
        K = min(k_cap, sum(counts))
        while K >= t_max:
            comps = _compositions(counts, K, MAX_COLUMNS)
            if comps is not None:
                break
            K -= 1
        else:
            continue
        # colocated: every composition of the pool as a column when they are few (those past K
        # devices priced by ``ColumnBounds.relaxed``), so no colocated group is "big"
        every = _compositions(counts, sum(counts), MAX_ALL_COLUMNS) if K < sum(counts) and K == k_cap else None
        if every is not None:
            comps = comps + [c for c in every if sum(c) > K]
        cb = ColumnBounds(ctx, kinds)
        # a group that leaves devices idle counts as the composition of those it uses
        small = [c for c in comps if sum(c) <= k_cap]
        exact = dict(zip(small, cb.exact_many(small)))  # their structures priced together
        caps = np.array([exact[c] if sum(c) <= k_cap else cb.relaxed(c) for c in comps]).reshape(len(comps), 3)
        big_stages, big_pf, big_col, big_dec = cb.big()  # K ≥ t_max: a big group has ≥ 2 stages
        prices = [float(mk[kind_of.index(g)].usd_per_hour or 0.0) for g in range(len(kinds))]
        return Columns(comps, caps, kind_of, kinds is machine, big_stages, np.array(big_pf), np.array(big_col),
                       np.array(big_dec), cb.big_decode(big_stages), K, counts, prices, every is not None)
    return None


def _members(ctx) -> dict[tuple[str, str], list[int]]:
    """(machine, GPU type) -> its devices' indices (what ``_column_kind`` reads of a kind)."""
    out: dict[tuple[str, str], list[int]] = {}
    for d in ctx.cluster.devices:
        out.setdefault((d.machine, d.gpu.name), []).append(d.index)
    return out


def _column_kind(ctx, ks, members: dict[tuple[str, str], list[int]] | None = None) -> Kind:
    """A column kind from machine kinds of one device type: the best link between two of its
    devices (α lowest, β highest) stands for every TP group of them (``members``: ``_members``,
    when the caller has it)."""
    members = _members(ctx) if members is None else members
    devs = sorted({i for k in ks for i in members.get((k.machine, k.gpu), ())})
    alpha, beta = math.inf, 0.0
    if len(devs) > 1:
        pairs = np.ix_(devs, devs)
        other = ~np.eye(len(devs), dtype=bool)
        alpha = float(ctx.cluster.latency[pairs][other].min())
        beta = float(ctx.cluster.bandwidth[pairs][other].max())
    k = ks[0]
    return Kind("+".join(x.machine for x in ks) + "/" + k.gpu, sum(x.count for x in ks), k.flops, k.membw, k.usable,
                0.0 if alpha == math.inf else alpha, beta or 1.0, k.machine, k.device if len(ks) == 1 else -1, k.gpu)


def _compositions(counts, K, limit):
    """Every count vector ≤ ``counts`` with 1…K devices, or None past ``limit`` of them."""
    out: list[tuple[int, ...]] = []

    def rec(i, left, acc):
        if len(out) > limit:
            return
        if i == len(counts):
            if sum(acc):
                out.append(tuple(acc))
            return
        for n in range(min(counts[i], left) + 1):
            rec(i + 1, left - n, acc + [n])

    rec(0, K, [])
    return None if len(out) > limit else out


def solve(ctx, mk, rates, cols: Columns, budget: float | None, node_limit: int, time_limit: float,
          deadline: float | None = None):
    """(LP relaxation value, MILP dual bound, binding row names of the relaxation, devices per
    (kind, role), the solver's best integer point as (composition, role, groups), whether the
    solver stopped at its time limit). ``time_limit`` caps each MILP run; ``deadline``
    (``time.perf_counter()``), when given, caps them all together: a run it cuts short still
    gives a dual bound, only a looser one."""
    nj, ng, nk = len(cols.comps), len(cols.counts), len(mk)
    big = sum(cols.counts) > cols.K
    machines = sorted({k.machine for k in mk})
    network = bool(getattr(ctx, "resources", None))
    tie_kv = network and cols.machine_kinds
    pairs = [(a, b) for a in machines for b in machines] if tie_kv else []
    iy = 0
    iz = iy + 3 * nj
    ns = len(cols.big_stages)
    bv = BigVars(iz + (3 * ng if big else 0), ns)  # big groups' variables (``big_rows``)
    ib, iC = bv.n, bv.C
    ix = bv.end if big else bv.n
    iF = ix + (2 * nk if network and not cols.machine_kinds else 0)
    iu = {p: iF + 1 + i for i, p in enumerate(pairs)}
    # tied KV rows read routes per machine pair (pools of few machines); loose ones by site (``routes``)
    routes = RouteVars(ctx, mk, machines, iF + 1) if network and not tie_kv else None
    nv = routes.nv if routes else iF + 1 + len(pairs)
    row = Rows(nv)

    comps = np.array(cols.comps, dtype=float).reshape(nj, ng)
    for g in range(ng):
        c = {iy + 3 * j + r: comps[j, g] for j in range(nj) for r in range(3) if comps[j, g]}
        if big:
            c.update({iz + 3 * g + r: 1.0 for r in range(3)})
        row(c, float(cols.counts[g]), f"devices of kind {g}")
    if big:
        big_rows(cols, bv, iz, row)
    for r, name in ((0, "prefill capacity"), (1, "decode capacity")):
        c = {iF: 1.0, **{iy + 3 * j + r: -cols.caps[j, r] for j in range(nj)}}
        if big and r == 0:
            c.update({ib + 3 * s: -cols.big_pf[s] for s in range(ns)})
        if big and r == 1:
            c[bv.D] = -1.0
        row(c, 0.0, name)
    share = shares(ctx, mk, rates, cols, machines) if network and cols.machine_kinds else None
    if network and not tie_kv:
        loose_rows(ctx, mk, rates, cols, machines, routes, iF, iy, iz, ix, big, row, share)
    if budget is not None:
        c = {}
        for g in range(ng):
            for j in range(nj):
                for r in range(3):
                    c[iy + 3 * j + r] = c.get(iy + 3 * j + r, 0.0) + comps[j, g] * cols.prices[g]
            if big:
                for r in range(3):
                    c[iz + 3 * g + r] = cols.prices[g]
        row(c, float(budget), "budget")
    obj = np.zeros(nv)
    obj[iF] = 1.0
    for j in range(nj):
        obj[iy + 3 * j + 2] = cols.caps[j, 2]
    if big:
        obj[iC] = 1.0
    upper = np.full(nv, np.inf)
    ties = _Ties(ctx, mk, rates, cols, machines, nv, big, share, (iu, iF, iy, iz, ib, bv.D)) if tie_kv else None
    upper[iy:iy + 3 * nj] = np.where(dominated(cols, share, ties.spread if ties else None).ravel(), 0.0, np.inf)
    for j, comp in enumerate(cols.comps):
        if sum(comp) > cols.K:  # a colocated column only; prefill / decode groups this large are "big"
            upper[iy + 3 * j:iy + 3 * j + 2] = 0.0
    if big and cols.big_colocated_columns:  # every colocated group is a column
        upper[ib + 2:iC:3] = 0.0
        upper[iz + 2:ib:3] = 0.0
    integrality = np.zeros(nv)
    integrality[iy:iy + 3 * nj] = 1
    if big:  # whole big groups too
        integrality[big_integers(bv)] = 1

    def programme():  # the rows (and the variables' bounds) with the columns tied so far
        parts, n, integers = ([row], nv, []) if ties is None else ties.rows(row)
        pad = n - nv
        whole = np.concatenate([integrality, np.zeros(pad)])
        whole[integers] = 1
        return (_matrix(parts, n), np.concatenate([obj, np.zeros(pad)]), np.concatenate([upper, np.full(pad, np.inf)]),
                whole, [name for p in parts for name in p.names])

    # the spread columns the solver uses get tied KV rows and layer-share cuts, a round at a
    # time: every round's programme is a relaxation of the fully tied one, so each value is a bound
    # (stopped early: a looser one); the deadline stops these rounds as it stops the MILP's
    lp, relaxed, cut = None, math.inf, False
    for _ in range(_CUT_ROUNDS):
        matrix, c_, up_, _, names = programme()
        lp = solve_lp(c_, matrix, up_)
        relaxed = min(relaxed, -float(lp.fun))
        if not (ties and ties.add(lp.x)):
            break
        if deadline is not None and time.perf_counter() >= deadline:
            cut = True  # ties added but not solved as an LP: the MILP below still takes them
            break
    duals = np.abs(lp.ineqlin.marginals)
    binding = tuple(dict.fromkeys(n for n, y in zip(names, duals) if y > 1e-9))
    best, res, last, still, earlier = relaxed, None, math.inf, 0, math.inf
    for _ in range(_CUT_ROUNDS_MILP if ties else 1):
        if res is not None and deadline is not None and time.perf_counter() >= deadline:
            cut = True  # the rounds so far were each a relaxation of the tied programme: a bound
            break
        (A, rhs), c_, up_, int_, _ = programme()
        res, stopped = run_milp(-c_, A, rhs, int_, up_, node_limit, time_limit, deadline, heuristics=ties is not None)
        cut = cut or stopped
        earlier = min(earlier, dual_bound(res))
        value = -float(res.fun) if res.fun is not None else math.inf
        still = still + 1 if value >= last * (1 - 1e-3) else 0
        # stop when no untied column is in use, or after _PATIENCE rounds that moved the optimum
        # by < 0.1 % (het2: a round that does not move it can be followed by one that does)
        if not (ties and res.x is not None and still < _PATIENCE and ties.add(res.x)):
            break
        last = value
    # the last programme is the tightest; its dual bound is the bound (no smaller one of an
    # earlier, looser round is taken: a solver's dual bound that undercut a later one would be
    # a numerical slip, not a proof) — unless the time cut a run short: then an earlier round's
    # finished search can be tighter than the last one's, and each is a bound
    best = min(best, earlier if cut else dual_bound(res))
    x = res.x if res.x is not None else lp.x
    used: dict[tuple[int, str], float] = {}
    for j in range(nj):
        for r in range(3):
            if x[iy + 3 * j + r] > 1e-9:
                for g in range(ng):
                    if comps[j, g]:
                        used[(g, ROLES[r])] = used.get((g, ROLES[r]), 0.0) + comps[j, g] * x[iy + 3 * j + r]
    incumbent = []  # the solver's best integer point: (composition, role, how many groups)
    if res.x is not None:
        for j in range(nj):
            for r in range(3):
                if res.x[iy + 3 * j + r] > 0.5:
                    incumbent.append((cols.comps[j], ROLES[r], int(round(res.x[iy + 3 * j + r]))))
    return relaxed, best, binding, used, incumbent, cut


_CUT_ROUNDS = 12  # LP rounds of layer-share cuts for the spread columns in use (each: a bound)
_CUT_ROUNDS_MILP = 8  # then MILP rounds, while its best integer point uses an untied column
_PATIENCE = 2  # ... and the optimum moved by ≥ 0.1 % in one of the last two rounds


class _Ties:
    """Which spread columns have tied KV rows (``TiedRows``) and their layer-share lines
    (``bound_shares``), computed once per column when the solver first uses it."""

    def __init__(self, ctx, mk, rates, cols, machines, nv, big, share, idx):
        self.ctx, self.mk, self.rates, self.cols, self.machines, self.nv = ctx, mk, rates, cols, machines, nv
        self.big, self.share, self.idx = big, share, idx
        members = _members(ctx)
        self.cb = ColumnBounds(ctx, [_column_kind(ctx, [k], members) for k in mk])
        self.kind_machine = [machines.index(k.machine) for k in mk]
        untied = TiedRows(ctx, mk, cols, machines, nv, big)
        self.spread, self.held = untied.spread, untied.held
        self.lines: dict[tuple[int, int, int], list] = {}
        self.levels: dict[tuple[int, int], tuple] = {}  # bound_sources.levels per tied column and role
        self.tied: set[int] = set()

    def rows(self, base: Rows) -> tuple[list[Rows], int, list[int]]:
        """The rows with the columns tied so far: (row blocks, variables, integer variables)."""
        iu, iF, iy, iz, ib, iD = self.idx
        tie = TiedRows(self.ctx, self.mk, self.cols, self.machines, self.nv, self.big, self.tied)
        net = Rows(tie.nv)
        tie.rows(self.ctx, self.mk, self.rates, self.cols, iu, iF, iy, iz, ib, iD, net, self.share)
        for (j, r, mi), lines in sorted(self.lines.items()):
            tie.cut_rows(j, r, mi, lines, iy, net)
        if not self.levels:
            return [base, net], tie.nv, []
        src = SourceRows(tie, self.cols, self.levels, tie.nv)
        by_source = Rows(src.nv)
        src.rows(iu, iy, by_source)
        return [base, net, by_source], src.nv, src.integers

    def add(self, x) -> bool:
        """Tie every spread column used in prefill or decode in ``x`` that is not yet; True if any."""
        iy = self.idx[2]
        new = [int(j) for j in np.flatnonzero(self.spread) if int(j) not in self.tied
               and max(x[iy + 3 * j], x[iy + 3 * j + 1]) > 1e-9]
        for j in new:
            self.tied.add(j)
            comp = self.cols.comps[j]
            where = sorted({self.kind_machine[k] for k in range(len(comp)) if comp[self.cols.kind_of[k]]})
            le, ge = [], []
            for mi in where:
                on_m = [self.kind_machine[k] == mi for k in range(len(comp))]
                le.append(share_ceilings(self.cb, comp, on_m))
                ge.append(share_ceilings(self.cb, comp, on_m, at_least=True))
                for r in range(2):
                    self.lines[(j, r, mi)] = facets(self.cols.caps[j, r], le[-1][r])
            for r in range(2):
                self.levels[(j, r)] = levels(self.cols.caps[j, r], np.array([c[r] for c in le]),
                                             np.array([c[r] for c in ge]), [self.held[j][mi] for mi in where])
        return bool(new)


def _matrix(parts: list[Rows], nv: int):
    """The rows as one sparse matrix over ``nv`` variables, each row scaled so its largest
    coefficient is 1 (capacities ~1e4, KV bytes ~1e11: HiGHS wants numbers near 1)."""
    A = sparse_vstack([p.sparse(nv) for p in parts]).tocsr()
    rhs = np.concatenate([np.array(p.rhs, dtype=float) for p in parts])
    scale = np.array([max((abs(v) for v in c.values()), default=1.0) for p in parts for c in p.coefs])
    scale = np.maximum(scale, 1e-12)
    return csr_array(diags(1.0 / scale) @ A), rhs / scale
