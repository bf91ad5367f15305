"""The least time of a pipeline over real layer splits: each stage i holds l_i layers at a cost
per layer, at most its memory's ``cap_i``, and Σ l_i = L. The group columns (columns.py) bound a
layout's time by these minima, row by row over the batch sizes: ``knapsack`` for a sum over the
stages (fill the cheapest first), ``waterfill`` for the slowest stage (the least level every stage
can stay under). ``level_kinks`` and ``first_reach`` are the level's pieces, shared with the capped
forms of the layer-share cuts (shares.py).
"""

from __future__ import annotations

import numpy as np


def knapsack(cost: np.ndarray, cap: np.ndarray, L: float) -> np.ndarray:
    """min Σ_i cost_i·l_i s.t. 0 ≤ l_i ≤ cap_i, Σ l_i = L, row by row (inf where infeasible):
    the fractional knapsack — fill the cheapest first."""
    order = np.argsort(cost, axis=1)
    c = np.take_along_axis(cost, order, axis=1)
    k = np.take_along_axis(cap, order, axis=1)
    before = np.cumsum(k, axis=1) - k
    take = np.clip(L - before, 0.0, k)
    total = (c * take).sum(axis=1)
    return np.where(k.sum(axis=1) >= L * (1 - 1e-12), total, np.inf)


def waterfill(a: np.ndarray, e: np.ndarray, cap: np.ndarray, L: float) -> np.ndarray:
    """min z s.t. a_i·l_i + e_i ≤ z, 0 ≤ l_i ≤ cap_i, Σ l_i = L, row by row (inf if infeasible).

    The layers that fit under a level z, Σ clip((z − e_i)/a_i, 0, cap_i), are piecewise linear
    and non-decreasing in z, with kinks at e_i and e_i + a_i·cap_i (``level_kinks``): find the
    first kink where they reach L and interpolate back along the segment before it."""
    pts, lay = level_kinks(a, e, cap)
    return first_reach(pts, lay.sum(axis=2), L * (1 - 1e-12), L)


def level_kinks(a: np.ndarray, e: np.ndarray, cap: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The kinks of the layers under a level z, row by row: every e_i and e_i + a_i·cap_i, sorted
    (n, 2S), and each item's layers at each (n, 2S, S); between two kinks every item's is linear."""
    e = np.broadcast_to(e, a.shape)
    pts = np.sort(np.concatenate([e, e + a * cap], axis=1), axis=1)
    return pts, np.clip((pts[:, :, None] - e[:, None, :]) / a[:, None, :], 0.0, cap[:, None, :])


def first_reach(pts: np.ndarray, room: np.ndarray, enough, target) -> np.ndarray:
    """The least z where ``room`` (non-decreasing, linear between the kinks ``pts``) reaches
    ``target``, row by row: the first kink where it is at least ``enough``, interpolated back along
    the segment before it (inf where it never is; the first kink where it is there already)."""
    enough = room >= np.reshape(enough, (-1, 1))
    first = np.argmax(enough, axis=1)
    rows = np.arange(pts.shape[0])
    hi_z, hi_r = pts[rows, first], room[rows, first]
    prev = np.maximum(first - 1, 0)
    lo_z, lo_r = pts[rows, prev], room[rows, prev]
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.where((first > 0) & (hi_r > lo_r), lo_z + (target - lo_r) * (hi_z - lo_z) / (hi_r - lo_r), hi_z)
    return np.where(enough.any(axis=1), z, np.inf)
