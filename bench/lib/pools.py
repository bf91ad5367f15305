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


# ----------------------------------------------------------------------------- held-out pools
# Pools no planner or cost-model constant was tuned on (the shared-link targets are measured on them).


def _pool(name: str, machines: list[dict], intra_gbps: float, pipes: dict[tuple[str, str], float],
          inter_gbps: float) -> Cluster:
    return cluster_from_dict({
        "name": name, "machines": machines,
        "network": {"intra_site": {"bandwidth_gbps": intra_gbps, "latency_ms": 0.5},
                    "inter_site": {"bandwidth_gbps": inter_gbps, "latency_ms": 20},
                    "links": [{"between": [a, b], "bandwidth_gbps": g, "latency_ms": 20} for (a, b), g in pipes.items()]},
    }, f"<{name}>")


def held_out_pools() -> dict[str, Cluster]:
    """Three pools: the 48-GPU three-site H100 / A6000 / L40S / RTX-4090 pool of the issue, a
    narrow-pipe two-site pool, and a 64-GPU synthetic pool of another seed."""
    three_site = _pool("heldout-3site-48", [
        {"name": "h0", "gpu": "H100-SXM-80G", "count": 8, "site": "dc-a"},
        {"name": "h1", "gpu": "H100-SXM-80G", "count": 8, "site": "dc-a"},
        {"name": "w0", "gpu": "A6000", "count": 8, "site": "dc-b"},
        {"name": "s0", "gpu": "L40S", "count": 8, "site": "dc-b"},
        {"name": "r0", "gpu": "RTX-4090", "count": 8, "site": "dc-c"},
        {"name": "r1", "gpu": "RTX-4090", "count": 8, "site": "dc-c"}],
        25.0, {("dc-a", "dc-b"): 2.0, ("dc-a", "dc-c"): 5.0, ("dc-b", "dc-c"): 1.0}, 2.0)
    narrow = _pool("heldout-narrow-pipe-32", [
        {"name": "h0", "gpu": "H100-SXM-80G", "count": 8, "site": "east"},
        {"name": "a0", "gpu": "A100-SXM-80G", "count": 8, "site": "east"},
        {"name": "l0", "gpu": "L40", "count": 8, "site": "west"},
        {"name": "l1", "gpu": "L40", "count": 8, "site": "west"}],
        10.0, {}, 1.0)
    synthetic = synthetic_pool(64, seed=1)
    return {c.name: c for c in (three_site, narrow, synthetic)}
