"""Concurrent transfers over shared network resources: the one place that prices sharing.

A transfer crosses the resources of its ``Path`` (``hetserve.specs.network``): the sending NIC,
the site pipe or dedicated link, the receiving NIC (or one in-box GPU pair). Transfers that are
in flight together share every resource they have in common **max-min fairly** (progressive
filling: raise all rates together; a resource that fills up freezes the rates of the transfers
crossing it; repeat) — the steady state TCP-like flows reach, and what "fair" transmission means
in the simulator and the runtime's shaped links, which call ``max_min_rates`` too.

``competing_penalty`` (default 0: none) models the throughput a link loses to contention between
flows (congestion control, incast): a resource crossed by n flows delivers
``capacity / (1 + penalty·(n − 1))`` in total. Calibration (MoLink reproduction) may set it.

Lower bound: a transfer alone costs ``α + bytes / β`` with β = the narrowest resource of its path,
which is exactly ``CostModel.p2p_time``; adding a transfer never speeds another one up.
Units: bytes, bytes/s, seconds.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Hashable, Sequence

from hetserve.specs.network import Path, Resource

_EPS = 1e-12


def max_min_rates(paths: Sequence[Sequence[Resource]], competing_penalty: float = 0.0,
                  keys: Sequence[Sequence[Hashable]] | None = None,
                  weights: Sequence[int] | None = None) -> list[float]:
    """Max-min fair rate (bytes/s) of each flow crossing ``paths[i]``'s resources.

    ``keys[i]`` (optional) names the resources of flow i (default: the resources themselves);
    ``weights[i]`` (optional, default 1): how many identical flows entry i stands for.
    A flow that crosses only unlimited resources gets ``inf``. Flows with the same resources get
    the same rate, so they are filled as one class with a count: running time
    O(rounds × distinct paths × path length), rounds ≤ number of distinct resources.
    """
    classes = FlowClasses(paths, keys, weights)
    rate = class_rates(classes.members, classes.count, classes.capacity, competing_penalty)
    return [rate[c] for c in classes.of_flow]


class FlowClasses:
    """Flows grouped by the resources they cross, in order of first appearance (``weights[i]``:
    how many flows entry i stands for, default 1).

    ``members[c]``: the resource keys of class c; ``count[c]``: its flows; ``of_flow[i]``: flow i's
    class; ``capacity``: bytes/s by resource key. ``class_rates`` depends on nothing else but
    ``members`` and ``count``, so a caller with fixed capacities may key a cache on those."""

    __slots__ = ("members", "count", "of_flow", "capacity")

    def __init__(self, paths: Sequence[Sequence[Resource]], keys: Sequence[Sequence[Hashable]] | None = None,
                 weights: Sequence[int] | None = None):
        keys = [tuple(k) for k in (keys if keys is not None else paths)]
        counts: dict
        if weights is None:
            counts = Counter(keys)  # insertion order: first appearance
        else:
            counts = {}
            for key, w in zip(keys, weights):
                counts[key] = counts.get(key, 0) + w
        self.members: list[tuple] = list(counts)
        self.count: list[int] = list(counts.values())
        index: dict = {key: c for c, key in enumerate(self.members)}
        self.of_flow: list[int] = [index[key] for key in keys]
        self.capacity = capacities(self.members, dict(zip(keys, paths)))  # type: ignore[arg-type]


def capacities(members: Sequence[tuple], path_of: dict[tuple, Sequence[Resource]]) -> dict[Hashable, float]:
    """Bytes/s by resource key over the classes ``members`` (keys in class order, as the water
    filling visits them); ``path_of[key]``: the resources of a class's path."""
    cap: dict[Hashable, float] = {}
    for key in members:
        for r, k in zip(path_of[key], key):
            cap.setdefault(k, r.bandwidth)
    return cap


def class_rates(members: Sequence[tuple], count: Sequence[int], capacity: dict[Hashable, float],
                competing_penalty: float = 0.0) -> list[float]:
    """Progressive filling over flow classes (``FlowClasses``): the max-min rate of each class."""
    cap = dict(capacity)
    users: dict[Hashable, list[int]] = {k: [] for k in cap}
    flows_on: dict[Hashable, int] = {k: 0 for k in cap}
    for c, key in enumerate(members):
        for k in key:
            users[k].append(c)
            flows_on[k] += count[c]
    if competing_penalty > 0:
        for k, n in flows_on.items():
            cap[k] = cap[k] / (1.0 + competing_penalty * (n - 1))
    rate = [math.inf] * len(members)
    frozen = [False] * len(members)
    left = cap
    active = flows_on
    while True:
        # the resource whose equal share for its unfrozen flows is the smallest sets their rate
        best_k, best_share = None, math.inf
        for k, n in active.items():
            if n > 0:
                share = left[k] / n
                if share < best_share:
                    best_k, best_share = k, share
        if best_k is None or math.isinf(best_share):
            return rate
        best_share = max(best_share, 0.0)
        for c in users[best_k]:
            if frozen[c]:
                continue
            frozen[c] = True
            rate[c] = best_share
            for k in members[c]:
                left[k] -= best_share * count[c]
                active[k] -= count[c]


def one_class_rate(narrowest: float, flows: int, competing_penalty: float = 0.0) -> float:
    """``class_rates`` of a single class of ``flows`` flows whose path crosses each of its
    resources once, the narrowest delivering ``narrowest`` bytes/s: the same float, as the filling
    freezes the class at the smallest of capacity / flows and dividing keeps the order."""
    if competing_penalty > 0:
        narrowest = narrowest / (1.0 + competing_penalty * (flows - 1))
    return max(narrowest / flows, 0.0)


def transfer_times(transfers: Sequence[tuple[Path, float]], competing_penalty: float = 0.0,
                   overhead_s: float = 0.0) -> list[float]:
    """Completion time of each ``(path, bytes)`` transfer when all start together at t = 0.

    Rates are max-min fair and re-shared whenever one transfer finishes (a fluid model); each
    transfer then pays its path's latency (and ``overhead_s``) once. O(n² × path length).
    """
    n = len(transfers)
    left = [max(0.0, float(b)) for _, b in transfers]
    done = [math.nan] * n
    live = [i for i in range(n) if left[i] > 0]
    for i in range(n):
        if left[i] <= 0:
            done[i] = 0.0
    t = 0.0
    while live:
        rates = max_min_rates([transfers[i][0].resources for i in live], competing_penalty)
        dt = min((left[i] / r if r > 0 else math.inf) for i, r in zip(live, rates))
        if math.isinf(dt):
            if all(math.isinf(r) for r in rates):  # only unlimited resources: no time on the wire
                for i in live:
                    done[i] = t
                break
            raise ValueError("a transfer got no bandwidth at all")
        t += dt
        still = []
        for i, r in zip(live, rates):
            left[i] -= r * dt
            if left[i] <= _EPS * max(1.0, transfers[i][1]):
                done[i] = t
            else:
                still.append(i)
        live = still
    return [d + p.latency_s + overhead_s for d, (p, _) in zip(done, transfers)]


def concurrent_time(transfers: Sequence[tuple[Path, float]], competing_penalty: float = 0.0) -> float:
    """Time until the last of ``transfers`` (started together) is delivered; 0 for none."""
    return max(transfer_times(transfers, competing_penalty), default=0.0)
