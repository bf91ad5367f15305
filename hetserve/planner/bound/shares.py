"""Where a group's layers sit ties where its KV goes: the group programme's layer-share cuts.

In the cost model a request's KV moves by layers (``CostModel.kv_transfer_pairs``): a decode
group whose stages on machine m hold l_m of the L layers receives l_m / L of every request's KV
on m, and a prefill group sends l_m / L of it from m. Without this tie the programme can route a
spread group's KV through whichever machine's pipe has room, while the group's capacity comes
from putting most layers where memory and speed are (het1: a decode group across three sites fed
through all three pipes, whose real layout sends 55 % of the KV to the A100 site).

The cut, for a composition spanning machines, a role (prefill / decode) and one machine m:

* ``C_m(h)``: the composition's ceiling over layouts whose stages on m hold at most h·L layers —
  the relaxation of ``ColumnBounds._structures`` (every TP split, real layer splits under the
  memory caps, the cost model's per-layer times and hand-offs) with one more constraint
  Σ_{i on m} l_i ≤ h·L. The fractional knapsack stays greedy (its constraints — each stage's
  cap, machine m's total, the sum — form a laminar family, so the feasible set is a polymatroid
  and the cheapest-first fill is optimal); the water-filling level is exact, solved at the kinks of
  the layers under a level (``waterfill_capped``), and never above the true minimum step (so the
  capacity is never below its true ceiling).
* A group serving f requests per T with more than ``C_m(h)`` must hold more than h·L layers on m,
  so the KV it takes at (or sends from) m is ``a ≥ f·max{h : C_m(h) < f}``. That step function's
  lower convex envelope on [0, ceiling] (through the origin) is a set of lines ``a ≥ s·f − t``
  with t ≥ 0; summed over the y groups of the column, ``Σ a ≥ s·Σ f − t·y``: linear rows of the
  programme (``bound_groups``), valid for every plan whatever its layouts.
"""

from __future__ import annotations

import itertools

import numpy as np

from hetserve.planner.bound.columns import ColumnBounds
from hetserve.planner.bound.layer_split import first_reach, level_kinks

SHARES = np.arange(1, 40) / 40.0  # the thresholds h (every 2.5 % of the layers)


def share_ceilings(cb: ColumnBounds, comp: tuple[int, ...], on_m: list[bool], hs=SHARES,
                   at_least: bool = False) -> np.ndarray:
    """(prefill, decode) × len(hs): ceilings of layouts of ``comp`` (counts per column kind) that
    hold at most h·L layers on the kinds flagged in ``on_m`` (one machine's kinds) — or, with
    ``at_least``, at least h·L there (the layer split relaxed the same way, so the same proof)."""
    out = np.zeros((2, len(hs)))
    per_kind = [[(ki, s) for s in cb._splits(n)] for ki, n in enumerate(comp) if n]
    hops = cb._hops([ki for ki, n in enumerate(comp) if n])
    hs = np.asarray(hs, dtype=float)
    lo, hi = (hs, np.ones_like(hs)) if at_least else (np.zeros_like(hs), hs)
    for combo in itertools.product(*per_kind):
        stages = tuple((ki, t) for ki, split in combo for t in split)
        if stages:
            out = np.maximum(out, _capped(cb, stages, hops, np.array([on_m[ki] for ki, _ in stages]), lo, hi))
    return out


def _capped(cb: ColumnBounds, stages, hops, in_g: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """``ColumnBounds._structures``'s prefill and decode ceilings with the stages flagged in
    ``in_g`` holding between lo·L and hi·L layers, for every pair of ``lo`` and ``hi`` (2 × len)."""
    m = cb.ctx.model
    nh_, alpha, beta = hops
    act_bytes = m.hidden * m.dtype_bytes

    def hop(tokens):
        return nh_ * (alpha + tokens * act_bytes / beta)

    L, T, b = cb.L, cb.T, cb.b
    S, nh, nb = len(stages), len(lo), len(cb.b)
    info = [cb._stage(ki, t) for ki, t in stages]
    room = np.array([s["room"] for s in info])
    fixed = np.array([cb._fixed(t) for _, t in stages])
    W = m.params_per_layer * m.dtype_bytes
    kvl = m.kv_bytes_per_token_per_layer
    if room.sum() - cb.extras < L * W:
        return np.zeros((2, nh))
    H, Hlo = hi * L, lo * L
    pf = np.array([s["pf"] for s in info])
    cap_pf = room / (W + kvl)
    ttft = (knapsack_capped(pf[None, :], cap_pf[None, :], L, in_g, H, Hlo, tiles=nh)
            + fixed.sum() + min(s["pf_head"] for s in info) + hop(cb.I))
    with np.errstate(divide="ignore"):
        prefill = np.where(np.isfinite(ttft), T / ttft, 0.0)
    den = W + b * (cb.Ir + cb.O) * kvl
    cap = room[None, :] / den[:, None]  # (nb, S)
    ok = (room.sum() - cb.extras) / den >= L
    mb = b / np.minimum(S, b)
    mcount = np.minimum(S, b)
    dec = np.stack([cb._dl(ki, t, S) for ki, t in stages], axis=1)  # (nb, S)
    Hr, Hlor = np.repeat(H, nb), np.repeat(Hlo, nb)  # row h·nb + batch
    sum_lb = knapsack_capped(dec, cap, L, in_g, Hr, Hlor, tiles=nh) + fixed.sum() + np.tile(hop(mb), nh)
    max_lb = np.tile(mcount, nh) * waterfill_capped(dec, np.broadcast_to(fixed, dec.shape), cap, L, in_g, Hr, Hlor,
                                                    tiles=nh)
    step = np.maximum(sum_lb, max_lb).reshape(nh, nb)
    with np.errstate(divide="ignore", invalid="ignore"):
        dcap = np.where(ok[None, :] & np.isfinite(step), T * b[None, :] / (cb.Oc * step), 0.0)
    return np.stack([prefill, dcap.max(axis=1, initial=0.0)])


def knapsack_capped(cost: np.ndarray, cap: np.ndarray, L: float, in_g: np.ndarray, H: np.ndarray,
                    lo: np.ndarray | None = None, tiles: int = 1) -> np.ndarray:
    """min Σ cost_i·l_i s.t. 0 ≤ l_i ≤ cap_i, lo ≤ Σ_{i in g} l_i ≤ H, Σ l_i = L, row by row (inf
    where infeasible). The cost is separable and convex in n = Σ_{i in g} l_i (each side filled
    cheapest first), so the optimum is greedy from n = lo: the flagged items' cheapest lo layers
    first, then cheapest first over everything left, the flagged items also limited by H − lo.

    ``tiles``: the rows of ``cost`` and ``cap`` stand for that many copies of themselves, one per
    block of ``H`` and ``lo`` (row t·n + i is row i under the t-th bounds); sorted once."""
    order = np.argsort(cost, axis=1)
    c = np.take_along_axis(cost, order, axis=1)
    k = np.take_along_axis(cap, order, axis=1).astype(float)
    g = in_g[order]
    if tiles > 1:
        c, k, g = np.tile(c, (tiles, 1)), np.tile(k, (tiles, 1)), np.tile(g, (tiles, 1))
    total = np.zeros(c.shape[0])
    need = np.zeros(c.shape[0]) if lo is None else np.array(lo, dtype=float)
    for p in range(c.shape[1]):  # the flagged items' cheapest ``lo`` layers
        take = np.where(g[:, p], np.clip(np.minimum(k[:, p], need), 0.0, None), 0.0)
        total += c[:, p] * take
        need -= take
        k[:, p] -= take
    rest = float(L) - (0.0 if lo is None else np.asarray(lo, dtype=float))
    room = np.array(H, dtype=float) - (0.0 if lo is None else np.asarray(lo, dtype=float))
    for p in range(c.shape[1]):
        lim = np.where(g[:, p], np.minimum(k[:, p], room), k[:, p])
        take = np.clip(np.minimum(lim, rest), 0.0, None)
        total += c[:, p] * take
        rest -= take
        room -= np.where(g[:, p], take, 0.0)
    return np.where((rest <= L * 1e-12) & (need <= L * 1e-12), total, np.inf)


def waterfill_capped(a: np.ndarray, e: np.ndarray, cap: np.ndarray, L: float, in_g: np.ndarray,
                     H: np.ndarray, lo: np.ndarray | None = None, tiles: int = 1) -> np.ndarray:
    """min z s.t. a_i·l_i + e_i ≤ z, 0 ≤ l_i ≤ cap_i, lo ≤ Σ_{i in g} l_i ≤ H, Σ l_i = L, row by
    row (inf if infeasible), where an item given no layers is not held to its e_i (so the level
    is never above that of the stricter reading). With n_in(z), n_out(z) the layers under level z
    of the flagged items and of the others, z is feasible when n_in ≥ lo and n_out + min(H, n_in)
    ≥ L, that is when n_in ≥ lo, n_out + n_in ≥ L and n_out ≥ L − H: each side non-decreasing and
    piecewise linear with the kinks of ``level_kinks``, so the least z is the latest of the three
    first reaches. ``tiles``: as ``knapsack_capped``'s (the kinks found once, on the rows given)."""
    pts, lay = level_kinks(a, e, cap)
    n_in, n_out = lay[:, :, in_g].sum(axis=2), lay[:, :, ~in_g].sum(axis=2)
    need_all = L * (1 - 1e-12)
    # each reach interpolated to its tolerant threshold: never above the exact level (a lower bound)
    z_all = first_reach(pts, n_in + n_out, need_all, need_all)  # the same for every lo and H
    if tiles > 1:
        pts, n_in, n_out = (np.tile(x, (tiles, 1)) for x in (pts, n_in, n_out))
        z_all = np.tile(z_all, tiles)
    low = np.zeros(pts.shape[0]) if lo is None else np.asarray(lo, dtype=float)
    H = np.asarray(H, dtype=float)
    need_in = low * (1 - 1e-12)
    z = np.maximum(np.maximum(first_reach(pts, n_in, need_in, need_in), z_all),
                   first_reach(pts, n_out, need_all - H, need_all - H))
    feasible = (n_in[:, -1] >= need_in) & (n_out[:, -1] + np.minimum(H, n_in[:, -1]) >= need_all)
    return np.where(feasible, z, np.inf)


def facets(ceiling: float, caps_h: np.ndarray, hs=SHARES) -> list[tuple[float, float]]:
    """Lines (s, t) with ``a ≥ s·f − t`` for every f in [0, ``ceiling``] and every layout serving
    f: the lower convex envelope of the step function f·max{h : C(h) < f} (``caps_h[k]`` =
    C(hs[k]), non-decreasing in h)."""
    below = [(float(c), float(h)) for c, h in zip(caps_h, hs) if c < ceiling * (1 - 1e-9)]
    if not below:
        return []
    # the step function is h·f on each interval between two distinct C values (h: the largest
    # threshold with C(h) below the interval); its envelope is that of the intervals' ends, each
    # taken at its lower value (at x = C(h) itself a layout with share exactly h may serve x)
    pts = [(0.0, 0.0)]
    for x in sorted({c for c, _ in below} | {float(ceiling)}):
        pts.append((x, x * max((h for c, h in below if c < x), default=0.0)))
    hull: list[tuple[float, float]] = []
    for p in sorted(set(pts)):  # lower hull, left to right (Andrew's monotone chain)
        while len(hull) >= 2 and _cross(hull[-2], hull[-1], p) <= 0:
            hull.pop()
        hull.append(p)
    out = []
    for (x1, y1), (x2, y2) in zip(hull, hull[1:]):
        if x2 > x1 * (1 + 1e-12) and y2 > y1:
            s = (y2 - y1) / (x2 - x1)
            out.append((s, max(0.0, s * x1 - y1)))
    return out


def _cross(o, a, b) -> float:
    return (a[0] - o[0]) * (b[1] - o[1]) - (a[1] - o[1]) * (b[0] - o[0])

