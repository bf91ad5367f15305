"""The group programme's rows for groups past the column cap K ("big" groups: more than K ≥ the
largest TP degree devices, so S ≥ 2 stages); their ceilings come from ``ColumnBounds.big`` and
``ColumnBounds.big_decode``.

**Prefill and colocated**: ``n[s, r]`` whole groups whose fastest (best) stage is of stage kind
s = (kind g, degree t), each serving at most ``big_pf[s]`` (``big_col[s]``), holding t devices of
kind g and K + 1 in all.

**Big decode groups by their stage count S.** A group of S stages runs m = min(S, b)
micro-batches; its capacity is at most the sum over its devices of ``big_decode``'s per-device
rate at S. ``w[s, S]`` counts devices in stages of kind s of S-stage groups, ``N[S]`` those
groups: Σ_s w / t = S·N[S] (S or more in the last bucket), (K + 1)·N[S] ≤ Σ_s w, and Σ w
over a kind's stage kinds is ``z[kind, decode]``. Only their total N = Σ N[S] is whole (≥ 1 where
any device decodes in a big group): integer counts per S made the solver twice as slow, and the
fractional ones keep the rule that matters — few stages need large TP degrees. ``D`` is their
capacity in requests per T.
"""

from __future__ import annotations

from hetserve.planner.bound.columns import BIG_STAGES, ROLES

N_BUCKETS = BIG_STAGES - 1  # S = 2 … BIG_STAGES - 1, then BIG_STAGES or more


class BigVars:
    """Indices of the big groups' variables from ``start``: ``n[s, r]`` (groups by stage kind),
    ``C`` (colocated requests per T), ``N`` (decode groups), ``w[s, S]``, ``N[S]``, ``D``."""

    def __init__(self, start: int, ns: int):
        self.ns = ns
        self.n = start
        self.C = self.n + 3 * ns
        self.N = self.C + 1
        self.w = self.N + 1
        self.NS = self.w + ns * N_BUCKETS
        self.D = self.NS + N_BUCKETS
        self.end = self.D + 1

    def groups(self, s: int, r: int) -> int:
        return self.n + 3 * s + r

    def devices(self, s: int, j: int) -> int:
        return self.w + s * N_BUCKETS + j


def big_rows(cols, v: BigVars, iz: int, row) -> None:
    """The rows above; ``iz + 3·g + r``: devices of kind g in big groups of role r."""
    ng, K, total = len(cols.counts), cols.K, float(sum(cols.counts))
    stages = cols.big_stages
    for r in (0, 2):
        row({**{v.groups(s, r): K + 1.0 for s in range(v.ns)}, **{iz + 3 * g + r: -1.0 for g in range(ng)}},
            0.0, f"big {ROLES[r]} groups")
        for g in range(ng):
            row({**{v.groups(s, r): float(t) for s, (h, t) in enumerate(stages) if h == g},
                 iz + 3 * g + r: -1.0}, 0.0, f"big {ROLES[r]} groups led by kind {g}")
    row({v.C: 1.0, **{v.groups(s, 2): -cols.big_col[s] for s in range(v.ns)}}, 0.0, "big colocated groups")
    row({v.C: 1.0, **{iz + 3 * g + 2: -cols.big_dec[g] for g in range(ng)}}, 0.0, "big colocated decode")
    for g in range(ng):
        row.equal({**{v.devices(s, j): 1.0 for s, (h, _) in enumerate(stages) if h == g for j in range(N_BUCKETS)},
                   iz + 3 * g + 1: -1.0}, 0.0, f"big decode devices of kind {g}")
    for j in range(N_BUCKETS):
        S = j + 2
        stage_count = {**{v.devices(s, j): 1.0 / t for s, (_, t) in enumerate(stages)}, v.NS + j: -float(S)}
        if S < BIG_STAGES:
            row.equal(stage_count, 0.0, f"stages of {S}-stage big decode groups")
        else:
            row({i: -c for i, c in stage_count.items()}, 0.0, f"stages of {S}+-stage big decode groups")
        row({v.NS + j: K + 1.0, **{v.devices(s, j): -1.0 for s in range(v.ns)}}, 0.0,
            f"devices of {S}-stage big decode groups")
    row.equal({v.N: 1.0, **{v.NS + j: -1.0 for j in range(N_BUCKETS)}}, 0.0, "big decode groups")
    row({v.N: -total, **{iz + 3 * g + 1: 1.0 for g in range(ng)}}, 0.0, "big decode groups")
    row({v.D: 1.0, **{v.devices(s, j): -float(cols.big_dec_stages[s, j]) for s in range(v.ns)
                      for j in range(N_BUCKETS)}}, 0.0, "big decode capacity")


def big_integers(v: BigVars) -> list[int]:
    """Whole groups: prefill and colocated ones by stage kind, decode ones in all."""
    return [*range(v.n, v.C), v.N]
