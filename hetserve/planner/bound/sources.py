"""The group programme's KV per source: flow levels of the spread groups (``bound_groups``).

``TiedRows`` routes the KV by machine totals: a decode group spread over machines takes its
share of every request's KV on each machine, but which *prefill* machine that KV comes from is
left free (a transport relaxation). In a plan a request prefilled by a group on one machine p
and decoded by a spread group whose stages on m hold a share s_m of the layers sends s_m of its
KV from p to m — the same split for every source, so the pipe p → m carries s_m·x_p, with x_p
the flow from p into the group: bilinear. het2's programme fed a decode group across all four
sites from a 2×H100 prefill group and sent that group's KV only through pipes with room, while
each request really sends each site its share and the most loaded pipe caps the H100's flow.

**Levels.** A spread group of composition j in role r serving a flow f in (φ_{k−1}, φ_k]
(``levels``: 0 = φ_0 < … < φ_K = its ceiling) holds on each of its machines m a share s_m with

* s_m > h for every threshold h with C^≤_m(h) ≤ φ_{k−1} (C^≤_m(h): the composition's ceiling
  over layouts holding at most h·L layers on m, ``bound_shares.share_ceilings``; serving
  f > C^≤_m(h) needs more than h·L layers there), and
* s_m < h for every h with C^≥_m(h) ≤ φ_{k−1} (the ceiling over layouts holding at least h·L
  layers on m: the same relaxation with the other inequality — putting most layers on a
  machine whose memory then has no room for KV caps the batch), and s_m ≤ the share m's
  devices can hold at all.

So lo_k ≤ s ≤ up_k, box bounds known per level. Each group is counted in the level of its flow
(``y[j, r, k]`` integers summing to y[j, r], its flow ≤ φ_k each), so the bilinear terms become
linear: the KV that a level-k group exchanges with one-machine groups on machine q, w[q, m]
(from q to its machine m when it decodes, from m to q when it prefills), satisfies
lo_{k,m}·x_q ≤ w[q, m] ≤ up_{k,m}·x_q and Σ_m w[q, m] = x_q (the shares sum to one; each
source may use its own point of the box, a relaxation). Its KV on m is also between
lo_{k,m} and up_{k,m} times its flow.

**Who sends to whom.** One-machine prefill groups on p send all their flow somewhere:
to one-machine decode groups (Φ[p, m], all of it over p → m), to a level of a tied spread decode
group (x), to a spread decode column without tied rows (e[class, p]: the columns grouped by role,
machines and the share each machine's devices can hold; at most their groups' ceilings and
their flow), or to groups past K devices (e[p], at most their flow); the mirror image for
one-machine decode groups. For a one-machine group on q and every set M of other machines
(all of them up to 6 machines; past that single ones and the whole set), the KV between q and
M is at least Φ over M, plus the w's of the levels over M, plus, for an untied class whose
other machines all lie in M, (1 − the share q's devices in it can hold) × its flow with q (a
request keeps at most that share on q, the rest lands on the class's other machines) —
disjoint sets of requests, so the sum of the routes ``u`` over those pairs is at least that,
and the pipe and NIC rows on u do the rest. Every row holds for the plan's real groups, flows
and layer splits read this way, so the programme stays a relaxation of every plan. Not tied:
the KV between two spread groups, and that of groups past K (their shares are not known).
"""

from __future__ import annotations

import itertools

import numpy as np

from hetserve.planner.bound.columns import ROLES
from hetserve.planner.bound.shares import SHARES

LEVELS = 6  # flow levels per spread column and role (more: tighter, a slower MILP)


def levels(cap: float, le: np.ndarray, ge: np.ndarray, held: list[float], n: int = LEVELS, hs=SHARES):
    """(φ_1 … φ_K, lo (K × machines), up (K × machines)) for one spread column and role from its
    ceiling ``cap`` and, per machine of the column, C^≤(h) (``le``, machines × thresholds) and
    C^≥(h) (``ge``); ``held``: the share each machine's devices can hold. The breakpoints are
    the C values below the ceiling, ``n`` − 1 of them kept evenly through the sorted list."""
    hs = np.asarray(hs, dtype=float)
    cand = np.unique(np.concatenate([le.ravel(), ge.ravel()]))
    cand = cand[(cand > 0) & (cand < cap * (1 - 1e-9))]
    if len(cand) > n - 1:
        cand = cand[np.unique(np.round(np.linspace(0, len(cand) - 1, n - 1)).astype(int))]
    phi = np.append(cand, cap)
    low = np.concatenate([[0.0], phi[:-1]])  # φ_{k−1}
    lo = np.zeros((len(phi), le.shape[0]))
    up = np.tile(np.minimum(1.0, np.asarray(held, dtype=float)), (len(phi), 1))
    for k, f0 in enumerate(low):
        for m in range(le.shape[0]):
            below = hs[le[m] <= f0]
            lo[k, m] = below.max(initial=0.0)
            over = hs[ge[m] <= f0]
            up[k, m] = min(up[k, m], over.min(initial=1.0))
    return phi, lo, np.maximum(up, lo)


class SourceRows:
    """The rows of the module docstring over the tied columns' levels (``tie``: ``TiedRows``;
    ``lv[(j, r)]``: ``levels``' output over ``tie.where[j]``). Variables from ``start``."""

    def __init__(self, tie, cols, lv: dict, start: int):
        self.tie, self.cols, self.lv = tie, cols, lv
        nm = len(tie.machines)
        i = start
        self.i_y, self.i_lf, self.i_x, self.i_w = {}, {}, {}, {}
        for (j, r), (phi, _, _) in sorted(lv.items()):
            for k in range(len(phi)):
                self.i_y[(j, r, k)], self.i_lf[(j, r, k)] = i, i + 1
                i += 2
                for q in range(nm):
                    self.i_x[(j, r, k, q)] = i
                    i += 1
                    for mi in tie.where[j]:
                        self.i_w[(j, r, k, q, mi)] = i
                        i += 1
        self.i_phi = {(p, m): i + nm * p + m for p in range(nm) for m in range(nm)}
        i += nm * nm
        self.i_e = i  # e[r, q]: one-machine groups' flow to / from big groups
        i += 2 * nm
        # untied spread columns, by role, machines and the share each machine can hold: their
        # flow with one-machine groups on q, e[class, q]
        self.classes: dict[tuple, list[int]] = {}
        for j in tie.loose:
            held = tuple(tie.held[j][mi] if mi in tie.where[j] else 0.0 for mi in range(nm))
            for r in range(2):
                self.classes.setdefault((r, tuple(tie.where[j]), held), []).append(j)
        self.i_c = {key: i + nm * n for n, key in enumerate(sorted(self.classes))}
        self.nv = i + nm * len(self.classes)
        self.integers = sorted(self.i_y.values())

    def rows(self, iu: dict, iy: int, row) -> None:
        tie, cols = self.tie, self.cols
        machines = tie.machines
        nm = len(machines)
        for (j, r), (phi, lo, up) in sorted(self.lv.items()):
            K = len(phi)
            row.equal({iy + 3 * j + r: 1.0, **{self.i_y[(j, r, k)]: -1.0 for k in range(K)}}, 0.0,
                      f"{ROLES[r]} groups of a spread column by flow level")
            row.equal({tie.f(j, r): 1.0, **{self.i_lf[(j, r, k)]: -1.0 for k in range(K)}}, 0.0,
                      f"{ROLES[r]} flow of a spread column by level")
            for k in range(K):
                y, f = self.i_y[(j, r, k)], self.i_lf[(j, r, k)]
                row({f: 1.0, y: -float(phi[k])}, 0.0, f"{ROLES[r]} flow level")
                row({f: -1.0, **{self.i_x[(j, r, k, q)]: 1.0 for q in range(nm)}}, 0.0,
                    f"{ROLES[r]} flow of a level by one-machine partner")
                for q in range(nm):
                    x = self.i_x[(j, r, k, q)]
                    row.equal({x: 1.0, **{self.i_w[(j, r, k, q, mi)]: -1.0 for mi in tie.where[j]}}, 0.0,
                              f"{ROLES[r]} KV of a level's partner, by machine")
                    for c, mi in enumerate(tie.where[j]):
                        w = self.i_w[(j, r, k, q, mi)]
                        row({w: -1.0, x: float(lo[k, c])}, 0.0, f"{ROLES[r]} share of a level ≥")
                        row({w: 1.0, x: -float(up[k, c])}, 0.0, f"{ROLES[r]} share of a level ≤")
            for c, mi in enumerate(tie.where[j]):  # its KV on each machine, by level
                a = tie.at(j, r, mi)
                row({a: -1.0, **{self.i_lf[(j, r, k)]: float(lo[k, c]) for k in range(K)}}, 0.0,
                    f"{ROLES[r]} KV on {machines[mi]} by level ≥")
                row({a: 1.0, **{self.i_lf[(j, r, k)]: -float(up[k, c]) for k in range(K)}}, 0.0,
                    f"{ROLES[r]} KV on {machines[mi]} by level ≤")
                # the local rows' partner flows are the levels' partner flows summed
                row.equal({tie.i_x[(j, r, mi)]: 1.0,
                           **{self.i_x[(j, r, k, mi)]: -1.0 for k in range(K)}}, 0.0, "partner flow by level")
        single = [[j for j in range(len(cols.comps)) if not tie.spread[j] and tie.where[j] == [q]] for q in range(nm)]
        for r in range(2):  # r: the one-machine groups' role; their partners' role is 1 − r
            o = 1 - r
            for q in range(nm):
                c = {**{tie.f(j, r): 1.0 for j in single[q]}, self.i_e + 2 * q + r: -1.0}
                for p in range(nm):
                    c[self.i_phi[(q, p) if r == 0 else (p, q)]] = -1.0
                for (j, rr, k, qq), x in self.i_x.items():
                    if rr == o and qq == q:
                        c[x] = -1.0
                for key, i in self.i_c.items():
                    if key[0] == o:
                        c[i + q] = -1.0
                row.equal(c, 0.0, f"one-machine {ROLES[r]} flow on {machines[q]} by partner")
            if tie.big:
                rest = {tie.i_B + 2 * mi + o: 1.0 for mi in range(nm)}
                row({**{self.i_e + 2 * q + r: 1.0 for q in range(nm)}, **{i: -v for i, v in rest.items()}}, 0.0,
                    f"one-machine {ROLES[r]} flow with big partners")
            else:
                for q in range(nm):
                    row({self.i_e + 2 * q + r: 1.0}, 0.0, "no big groups")
            untied = [i + q for key, i in self.i_c.items() if key[0] == o for q in range(nm)]
            if untied:
                row({**{i: 1.0 for i in untied}, **{tie.i_L + 2 * mi + o: -1.0 for mi in range(nm)}}, 0.0,
                    f"one-machine {ROLES[r]} flow with untied spread partners")
        for key, js in self.classes.items():
            r = key[0]
            caps = {iy + 3 * j + r: -float(cols.caps[j, r]) for j in js}
            row({**{self.i_c[key] + q: 1.0 for q in range(nm)}, **caps}, 0.0,
                f"{ROLES[r]} flow of untied spread columns by partner")
        self._kv_rows(iu, row)

    def _kv_rows(self, iu, row) -> None:
        """For a one-machine group on q and each set M of other machines: the KV between q and M
        (out of q: q prefills; into q: q decodes) is at least Φ over M, the levels' KV with q
        over M, and for an untied spread class whose other machines lie in M, (1 − the share
        q can hold) × its flow with q."""
        machines = self.tie.machines
        nm = len(machines)
        for q in range(nm):
            others = [m for m in range(nm) if m != q]
            subsets = [M for n in range(1, len(others) + 1) for M in itertools.combinations(others, n)]
            if nm > 6:  # 2^(n−1) sets: past 6 machines only single ones and all of them
                subsets = [M for M in subsets if len(M) in (1, len(others))]
            for M in subsets:
                for r in range(2):  # r: the one-machine group's role
                    o = 1 - r
                    pair = (lambda m: (q, m)) if r == 0 else (lambda m: (m, q))
                    c = {iu[(machines[a], machines[b])]: -1.0 for a, b in map(pair, M)}
                    for m in M:
                        c[self.i_phi[pair(m)]] = 1.0
                    for (j, rr, k, qq, mi), w in self.i_w.items():
                        if rr == o and qq == q and mi in M:
                            c[w] = 1.0
                    for (rr, where, held), i in self.i_c.items():
                        rest = set(where) - {q}
                        if rr == o and rest and rest <= set(M) and held[q] < 1.0:
                            c[i + q] = 1.0 - held[q]
                    ends = (machines[q], f"{len(M)} machines")
                    row(c, 0.0, "KV {} → {} by source".format(*(ends if r == 0 else ends[::-1])))
