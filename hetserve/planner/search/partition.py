"""HexGen-2 phase 1 (§3.1): graph partition of the device pool, then the group types.

The device graph has one node per GPU (weight: its memory) and one edge per pair (weight: the
link bandwidth in Gbit/s).

1. ``initial_partition``: spectral partitioning into K groups, K = pool memory / one replica's
   memory (App. A). Done as recursive spectral bisection (Alpert & Kahng): the Fiedler vector of
   the graph Laplacian orders the nodes, and the cut along that order is the cheapest one whose
   memory split matches the number of groups on each side to within half a replica. Each
   bisection is then refined by Kernighan–Lin (networkx), kept only when it lowers the cut
   without unbalancing memory.
2. ``assign_roles``: coarsen every group to a super node (edge weight = total bandwidth between
   the groups) and partition the coarse graph in two — prefill and decode — this time
   *maximising* the cut, so KV caches travel over the fastest links; the split starts from the
   one that balances total prefill and decode capacity and is improved by pair swaps that raise
   the cut while keeping that balance within ``ROLE_BALANCE_SLACK``.
3. Projection is implicit: a group's role applies to all of its devices.
"""

from __future__ import annotations

import random
from typing import Sequence

import networkx as nx
import numpy as np
from networkx.algorithms.community import kernighan_lin_bisection
from scipy.sparse import csr_array

from hetserve.planner.context import PlanContext
from hetserve.planner.pool.evaluator import Evaluator

ROLE_BALANCE_SLACK = 0.9  # a role swap may cost at most 10% of min(prefill, decode) capacity
KL_MAX_NODES = 160  # Kernighan–Lin on larger bisections costs more than it returns
# On pools of this many devices a repeated second eigenvalue (sites alike, alike pipes between them) takes
# the class quotient's vector (a C × C problem), the one of the eigenspace its eigh returns; smaller
# pools take the full Laplacian's, chosen the same on every machine (``_second_vector``). The
# quotient's ramp projection was tried on the 1,024-GPU pool: the same plan, but its groups mixed
# sites and the search took 2.8× the CPU, so there the choice still follows eigh's numerics.
QUOTIENT_ANY_FIEDLER_DEVICES = 512


def initial_partition(ctx: PlanContext, devices: Sequence[int], k: int, seed: int = 0,
                      orders: dict | None = None) -> list[list[int]]:
    """Split ``devices`` into ``k`` groups of balanced memory and small inter-group bandwidth.

    ``orders``: Laplacian orders by device set, shared by the partitions of one pool into
    several K (each starts by bisecting the whole pool; the eigendecomposition was most of a
    320-GPU partition's time)."""
    devices = sorted(devices)
    if k <= 1 or len(devices) <= 1:
        return [devices]
    orders = {} if orders is None else orders
    k = min(k, len(devices))
    k_left = k // 2
    left, right = _spectral_bisect(ctx, devices, k_left / k, orders)
    left, right = _kernighan_lin(ctx, left, right, k_left / k, seed)
    return (initial_partition(ctx, left, k_left, seed, orders) + initial_partition(ctx, right, k - k_left, seed, orders))


def _laplacian_order(w: np.ndarray, labels: np.ndarray | None = None, any_fiedler: bool = False) -> np.ndarray:
    """Nodes by their Fiedler vector's entries (rounded, ties by index). ``labels``: the device
    class of each node; where given, the vector comes from the class quotient when that is exact
    (``_class_fiedler``; ``any_fiedler``: also where the second eigenvalue repeats)."""
    fiedler = None if labels is None else _class_fiedler(w, labels, any_fiedler)
    if fiedler is None:
        lap = np.diag(w.sum(axis=1)) - w
        vals, vecs = np.linalg.eigh(lap)
        fiedler = _second_vector(vals, vecs)
    # rounded, and its sign fixed by the largest entry (the first of those equal once rounded), so the
    # order is reproducible: entries alike by symmetry differ in their last bits from one CPU to another
    rounded = np.round(fiedler, 9)
    if rounded[np.argmax(np.abs(rounded))] < 0:
        rounded = -rounded
    return np.lexsort((np.arange(len(w)), rounded))


def _class_fiedler(w: np.ndarray, labels: np.ndarray, any_fiedler: bool = False) -> np.ndarray | None:
    """The Fiedler vector from the class quotient, or None where it may not be that.

    Devices of one class have the same links (``PlanContext``), so the Laplacian maps vectors
    constant on classes to such vectors: with n_c devices in class c, w_ce the link between
    classes and d_c a device's degree, they are eigenvectors of the symmetric C × C matrix
    B = diag(d_c − (n_c − 1)·w_cc) − [w_ce·√(n_c·n_e)]_{c≠e} (lifted as y_c = z_c / √n_c, the same
    norm). Every other eigenvector sums to zero inside one class, with eigenvalue d_c + w_cc. So
    when B's second eigenvalue is simple and below every such d_c + w_cc, it is the Laplacian's
    second, and its vector the Fiedler vector — from a C × C problem instead of a D × D one
    (174 classes against 1,024 devices on the synthetic 1,024-GPU pool; eigh is cubic)."""
    classes, first, counts = np.unique(labels, return_index=True, return_counts=True)
    if len(classes) == len(labels) or len(classes) < 3:
        return None
    wc = w[np.ix_(first, first)].copy()
    inner = np.array([w[first[c], np.flatnonzero(labels == classes[c])[1]] if counts[c] > 1 else 0.0
                      for c in range(len(classes))])
    np.fill_diagonal(wc, inner)
    n = counts.astype(float)
    degree = wc @ n - inner
    b = -wc * np.sqrt(np.outer(n, n))
    np.fill_diagonal(b, degree - (n - 1) * inner)
    vals, vecs = np.linalg.eigh(b)
    internal = (degree + inner)[counts > 1]
    gap = _eigen_gap(vals)
    if len(internal) and vals[1] >= internal.min() - gap:
        return None
    if vals[2] - vals[1] <= gap and not any_fiedler:
        return None
    index = np.searchsorted(classes, labels)
    return vecs[index, 1] / np.sqrt(n[index])


def _eigen_gap(vals: np.ndarray) -> float:
    """Eigenvalues of a Laplacian (``eigh``'s, ascending) this close are one repeated eigenvalue."""
    return 1e-9 * max(1.0, abs(float(vals[-1])))


def _second_vector(vals: np.ndarray, vecs: np.ndarray) -> np.ndarray:
    """The eigenvector of the second smallest eigenvalue (``eigh``'s ``vals``, ``vecs``). Where that
    eigenvalue repeats (alike machines, alike links), any vector of its eigenspace is a Fiedler
    vector, and ``eigh`` picks a basis by its numerics, which differ between CPUs (the BLAS kernels
    it dispatches to): the eigenspace's projection of a fixed ramp over the nodes does not, so a
    pool gets the same partition, and plan, on every machine."""
    same = np.flatnonzero(np.abs(vals - vals[1]) <= _eigen_gap(vals))
    if len(same) == 1:
        return vecs[:, 1]
    basis = vecs[:, same]
    ramp = np.arange(len(vals), dtype=float)
    for r in (ramp - ramp.mean(), (ramp - ramp.mean()) ** 2):
        v = basis @ (basis.T @ r)
        norm = float(np.linalg.norm(v))
        if norm > 1e-6 * float(np.linalg.norm(r)):
            return v / norm
    return vecs[:, 1]


def _spectral_bisect(ctx: PlanContext, devices: list[int], frac: float,
                     orders: dict | None = None) -> tuple[list[int], list[int]]:
    idx = np.asarray(devices)
    w = ctx.bandwidth_gbps[np.ix_(idx, idx)]
    w = (w + w.T) / 2
    key = tuple(devices)
    order = None if orders is None else orders.get(key)
    if order is None:
        order = _laplacian_order(w, np.asarray([ctx.class_of[d] for d in devices]),
                                 ctx.num_devices >= QUOTIENT_ANY_FIEDLER_DEVICES)
        if orders is not None:
            orders[key] = order
    mem = np.asarray([ctx.memory[d] for d in devices], dtype=float)[order]
    target = frac * mem.sum()
    tol = 0.5 * ctx.replica_memory_bytes
    ws = w[np.ix_(order, order)]
    # cut(i) = weight between order[:i] and order[i:], updated as node i-1 crosses over
    cuts = np.empty(len(devices) - 1)
    cut = 0.0
    for i in range(1, len(devices)):
        v = i - 1
        cut += ws[v, i:].sum() - ws[v, :v].sum()
        cuts[i - 1] = cut
    prefix = np.cumsum(mem)[:-1]
    err = np.abs(prefix - target)
    ok = np.flatnonzero(err <= tol)
    i = int(ok[np.argmin(cuts[ok])]) if len(ok) else int(np.argmin(err))
    left = sorted(int(idx[j]) for j in order[:i + 1])
    right = sorted(int(idx[j]) for j in order[i + 1:])
    return left, right


def _cut(ctx: PlanContext, a: Sequence[int], b: Sequence[int]) -> float:
    return float(ctx.bandwidth_gbps[np.ix_(a, b)].sum())


def _kernighan_lin(ctx: PlanContext, left: list[int], right: list[int], frac: float,
                   seed: int) -> tuple[list[int], list[int]]:
    nodes = left + right
    if len(nodes) > KL_MAX_NODES or not left or not right:
        return left, right
    g = nx.Graph()
    g.add_nodes_from(nodes)
    bw = ctx.bandwidth_gbps
    for i, a in enumerate(nodes):
        for b in nodes[i + 1:]:
            g.add_edge(a, b, weight=float(bw[a, b] + bw[b, a]) / 2)
    a, b = kernighan_lin_bisection(g, partition=(set(left), set(right)), max_iter=10, weight="weight", seed=seed)
    a, b = sorted(a), sorted(b)
    total = ctx.group_memory(nodes)
    target, tol = frac * total, 0.5 * ctx.replica_memory_bytes
    before = abs(ctx.group_memory(left) - target)
    after = abs(ctx.group_memory(a) - target)
    if _cut(ctx, a, b) < _cut(ctx, left, right) and after <= max(tol, before):
        return a, b
    return left, right


def group_bandwidth(ctx: PlanContext, groups: Sequence[Sequence[int]]) -> np.ndarray:
    """Coarsened graph: total bandwidth (Gbit/s) between every two groups.

    Summed per device class (devices of a class have the same links, ``PlanContext``): the
    groups' class counts C and the class-to-class matrix B give C·B·Cᵀ, C sparse (a group holds
    a few of the pool's classes: at thousands of GPUs the dense products cost ~1 s a call)."""
    rows, cols = [], []
    class_of = ctx.class_of
    for j, g in enumerate(groups):
        for d in g:
            rows.append(j)
            cols.append(class_of[d])
    counts = csr_array((np.ones(len(rows)), (rows, cols)), shape=(len(groups), len(ctx.classes)))
    w = np.ascontiguousarray((counts @ (counts @ ctx.class_bandwidth_gbps).T).T)
    np.fill_diagonal(w, 0.0)
    return w


def assign_roles(ev: Evaluator, groups: Sequence[Sequence[int]]) -> list[str]:
    """Secondary partition of the coarse graph into prefill / decode (see module docstring).

    Groups that can hold no replica get "decode" (they carry no flow either way). Fewer than two
    feasible groups: all "decode" (the caller falls back to a colocated plan).
    """
    n = len(groups)
    cp = np.array([ev.capacity(g, "prefill") for g in groups])
    cd = np.array([ev.capacity(g, "decode") for g in groups])
    feas = [i for i in range(n) if cp[i] > 0 and cd[i] > 0]
    roles = ["decode"] * n
    if len(feas) < 2:
        return roles
    ratio = sorted(feas, key=lambda i: (-cp[i] / cd[i], i))
    best_np, best_bal = 1, -1.0
    for n_p in range(1, len(ratio)):
        bal = min(cp[ratio[:n_p]].sum(), cd[ratio[n_p:]].sum())
        if bal > best_bal:
            best_np, best_bal = n_p, bal
    is_p = np.zeros(n, dtype=bool)
    is_p[ratio[:best_np]] = True
    feas_mask = np.zeros(n, dtype=bool)
    feas_mask[feas] = True
    w = group_bandwidth(ev.ctx, groups)
    floor = ROLE_BALANCE_SLACK * best_bal
    for _ in range(len(feas)):
        P = np.flatnonzero(is_p & feas_mask)
        D = np.flatnonzero(~is_p & feas_mask)
        in_p, in_d = w[:, P].sum(axis=1), w[:, D].sum(axis=1)
        gain = (in_p - in_d)[P][:, None] + (in_d - in_p)[D][None, :] + 2 * w[np.ix_(P, D)]
        sum_p, sum_d = cp[P].sum(), cd[D].sum()
        new_p = sum_p - cp[P][:, None] + cp[D][None, :]
        new_d = sum_d - cd[D][None, :] + cd[P][:, None]
        gain[np.minimum(new_p, new_d) < floor] = -np.inf
        i, j = np.unravel_index(np.argmax(gain), gain.shape)
        if not gain[i, j] > 1e-9:
            break
        is_p[P[i]], is_p[D[j]] = False, True
    for i in feas:
        roles[i] = "prefill" if is_p[i] else "decode"
    return roles


def random_partition(ctx: PlanContext, k: int, rng: random.Random) -> list[list[int]]:
    """Devices dealt at random into ``k`` groups (used by tests and random restarts)."""
    devices = list(range(ctx.num_devices))
    rng.shuffle(devices)
    return [sorted(devices[i::k]) for i in range(k)]
