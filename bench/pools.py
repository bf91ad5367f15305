"""Synthetic heterogeneous pools for the planner benchmarks.

``synthetic_pool(n)``: ``n`` GPUs in machines of 4 or 8 GPUs of one type each (H100, A100, L40,
A6000 in turn, as HexGen-2's settings mix them), five machines per site; 100 Gbit/s between
machines of a site, 3 Gbit/s across sites (HexGen-2's RunPod measurements are of that order).
Deterministic in ``n`` and ``seed``.
"""

from __future__ import annotations

import random

from hetserve.specs.cluster import Cluster, cluster_from_dict

TYPES = ("H100-SXM-80G", "A100-SXM-80G", "L40", "A6000")
MACHINES_PER_SITE = 5


def synthetic_pool(n: int, seed: int = 0) -> Cluster:
    rng = random.Random(seed)
    machines, left, i = [], n, 0
    while left > 0:
        count = min(left, rng.choice((4, 8)))
        machines.append({"name": f"m{i}", "gpu": TYPES[i % len(TYPES)], "count": count,
                         "site": f"s{i // MACHINES_PER_SITE}"})
        left -= count
        i += 1
    return cluster_from_dict({
        "name": f"synthetic-{n}",
        "machines": machines,
        "network": {"intra_site": {"bandwidth_gbps": 100, "latency_ms": 0.2},
                    "inter_site": {"bandwidth_gbps": 3, "latency_ms": 15}},
    }, f"<synthetic-{n}>")
