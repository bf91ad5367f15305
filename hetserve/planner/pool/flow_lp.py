"""The linear programme of the max flow with capacity nodes (``flow.solve_with_resources``), built
as arrays.

Columns: every KV edge (p-major: prefill i, decode j is column i·D + j), then every colocated
group. Rows: a node row per prefill and decode group, then a row per finite shared resource some
column loads, in name order. A column's entry on a resource row is the bytes one of its requests
puts there: its KV's (``edge_load``), then the prefill group's own (``node_load``), then the
decode group's, summed in that order; each resource row is divided by its largest entry (rows in
requests keep the programme well scaled).

The same programme, entry for entry and bit for bit, is what a dictionary filled column by column
gives; built from arrays it costs a pass over the columns' KV loads instead of a dictionary entry
per (resource, column) pair, which on pools of thousands of GPUs was a second per programme.

``solve_programme`` solves it: whole, or past ``RESTRICT_COLUMNS`` columns by column generation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.optimize import linprog
from scipy.sparse import csr_array
from scipy.sparse import vstack as sparse_vstack


@dataclass
class ResourceProgramme:
    """The programme's constraint matrix (CSC), right-hand sides and column bounds."""

    matrix: object  # scipy sparse, (P + D + R) × (P·D + C)
    rhs: np.ndarray
    bounds: list[tuple[float, float]]
    names: list[str]  # the resource rows' names, in row order (after the P + D node rows)
    tops: np.ndarray  # each resource row's scale: its largest bytes per request


def build_programme(net, edges: list[tuple[int, int]]) -> ResourceProgramme:
    """The programme of ``net`` (a ``flow.FlowNetwork``) over the KV columns ``edges`` (every
    prefill × decode pair, p-major; empty when either side is) and its colocated groups."""
    P, D, C = len(net.prefill), len(net.decode), len(net.colocated)
    E = len(edges)
    cols = E + C
    finite = {r for r, c in net.resource_cap.items() if math.isfinite(c)}
    ends = (net.prefill + net.decode) if edges else []
    used: set[str] = set()
    edge_loads = [net.edge_load.get(e) for e in edges]
    for load in edge_loads:
        if load:
            used.update(load)
    used.update(r for g in ends + net.colocated for r in net.node_load.get(g, ()))
    names = sorted(used & finite)
    R = len(names)
    index = {r: i for i, r in enumerate(names)}

    # (row, column, bytes) triples in summation order: KV, prefill's own, decode's own, colocated
    rows: list[np.ndarray] = []
    cs: list[np.ndarray] = []
    vals: list[np.ndarray] = []
    stage: list[np.ndarray] = []
    er: list[int] = []
    ec: list[int] = []
    ev: list[float] = []
    row_of = index.get
    for j, load in enumerate(edge_loads):
        if load:
            for r, b in load.items():
                i = row_of(r)
                if i is not None:
                    er.append(i)
                    ec.append(j)
                    ev.append(b)
    rows.append(np.asarray(er, dtype=np.int64))
    cs.append(np.asarray(ec, dtype=np.int64))
    vals.append(np.asarray(ev, dtype=float))
    stage.append(np.zeros(len(er), dtype=np.int8))
    span = np.arange(D, dtype=np.int64)
    for i, p in enumerate(net.prefill if edges else ()):
        for r, b in net.node_load.get(p, {}).items():
            if r in index:
                rows.append(np.full(D, index[r], dtype=np.int64))
                cs.append(i * D + span)
                vals.append(np.full(D, b))
                stage.append(np.ones(D, dtype=np.int8))
    down = np.arange(P, dtype=np.int64) * D
    for j, d in enumerate(net.decode if edges else ()):
        for r, b in net.node_load.get(d, {}).items():
            if r in index:
                rows.append(np.full(P, index[r], dtype=np.int64))
                cs.append(down + j)
                vals.append(np.full(P, b))
                stage.append(np.full(P, 2, dtype=np.int8))
    for k, c in enumerate(net.colocated):
        for r, b in net.node_load.get(c, {}).items():
            if r in index:
                rows.append(np.array([index[r]], dtype=np.int64))
                cs.append(np.array([E + k], dtype=np.int64))
                vals.append(np.array([b]))
                stage.append(np.zeros(1, dtype=np.int8))
    rr, cc, vv = _sum_in_order(np.concatenate(rows), np.concatenate(cs), np.concatenate(vals),
                               np.concatenate(stage), cols)
    keep = vv != 0.0
    rr, cc, vv = rr[keep], cc[keep], vv[keep]
    tops = np.zeros(R)
    np.maximum.at(tops, rr, vv)
    vv = vv / tops[rr]
    rhs = np.asarray([net.node_cap[g] for g in net.prefill + net.decode]
                     + [net.resource_cap[r] / tops[i] for i, r in enumerate(names)], dtype=float)
    k = np.arange(E)
    node_rows = csr_array((np.ones(2 * E), (np.concatenate([k // D, P + k % D]) if D else k,
                                            np.concatenate([k, k]) if D else k)), shape=(P + D, cols))
    matrix = sparse_vstack([node_rows, csr_array((vv, (rr, cc)), shape=(R, cols))], format="csc")
    bounds = [(0.0, min(net.edge_cap.get(e, 0.0), 1e15)) for e in edges]
    bounds += [(0.0, net.node_cap[c]) for c in net.colocated]
    return ResourceProgramme(matrix, rhs, bounds, names, tops)


def _sum_in_order(rr: np.ndarray, cc: np.ndarray, vv: np.ndarray, stage: np.ndarray, cols: int):
    """One entry per (row, column): its terms added left to right in ``stage`` order (each stage
    holds a (row, column) at most once), as a dictionary accumulating them in that order would."""
    if not len(rr):
        return rr, cc, vv
    key = rr * max(cols, 1) + cc
    order = np.lexsort((stage, key))
    key, vv = key[order], vv[order]
    starts = np.flatnonzero(np.concatenate(([True], key[1:] != key[:-1])))
    ends = np.append(starts[1:], len(key))
    total = vv[starts].copy()
    for extra in (1, 2):
        more = ends - starts > extra
        total[more] = total[more] + vv[starts[more] + extra]
    first = key[starts]
    return first // max(cols, 1), first % max(cols, 1), total


# A programme with more columns than this is solved by column generation (``solve_programme``):
# on pools of thousands of GPUs most KV columns cross a slow site pipe and carry nothing, and
# HiGHS spends its time on them. Smaller programmes are solved whole (well under a second), so
# their routes stay those HiGHS picks on the whole programme.
RESTRICT_COLUMNS = 20_000
SEED_COLUMNS = 8  # a restricted programme starts from each group's this many widest KV columns
REDUCED_COST_TOL = 1e-9  # a column whose reduced cost is above this joins the restricted programme


def solve_programme(lp: ResourceProgramme, P: int, D: int):
    """(x, HiGHS's row marginals) of max Σx over ``lp`` (KV columns p-major over P × D, then
    colocated ones): the whole programme at once, or, past ``RESTRICT_COLUMNS``, by column
    generation. That one starts from every group's ``SEED_COLUMNS`` widest KV columns (largest
    upper bound, ties by index) and every colocated column, prices every column with the
    restricted optimum's duals and adds each whose reduced cost 1 − Aᵀλ is positive, until none
    is: its optimum is then the whole programme's (a feasible primal and a dual feasible for every
    column), and its duals bound every column. Columns outside the restricted set carry 0. The
    result depends only on the programme, not on what was solved before."""
    cols = lp.matrix.shape[1]
    if cols <= RESTRICT_COLUMNS or P == 0 or D == 0:
        res = _linprog(lp.matrix, lp.rhs, lp.bounds)
        return np.maximum(res.x, 0.0), np.asarray(res.ineqlin.marginals, dtype=float)
    upper = np.fromiter((b[1] for b in lp.bounds), float, cols)
    chosen = np.zeros(cols, dtype=bool)
    chosen[P * D:] = True
    kv = upper[:P * D].reshape(P, D)
    k = min(SEED_COLUMNS, D)
    widest = np.argsort(-kv, axis=1, kind="stable")[:, :k]
    chosen[(np.arange(P)[:, None] * D + widest).ravel()] = True
    k = min(SEED_COLUMNS, P)
    widest = np.argsort(-kv, axis=0, kind="stable")[:k, :]
    chosen[(widest * D + np.arange(D)[None, :]).ravel()] = True
    matrix = lp.matrix  # CSC: column slices are cheap
    while True:
        idx = np.flatnonzero(chosen)
        res = _linprog(matrix[:, idx], lp.rhs, np.column_stack((np.zeros(len(idx)), upper[idx])))
        marginals = np.asarray(res.ineqlin.marginals, dtype=float)
        reduced = 1.0 - matrix.T @ np.maximum(-marginals, 0.0)
        more = (reduced > REDUCED_COST_TOL) & (upper > 0) & ~chosen
        if not more.any():
            x = np.zeros(cols)
            x[idx] = np.maximum(res.x, 0.0)
            return x, marginals
        chosen |= more


def _linprog(matrix, rhs, bounds):
    res = linprog(-np.ones(matrix.shape[1]), A_ub=matrix, b_ub=rhs, bounds=bounds, method="highs")
    if res.status != 0:
        raise RuntimeError(f"max flow with capacity nodes: the LP solver failed ({res.message})")
    return res
