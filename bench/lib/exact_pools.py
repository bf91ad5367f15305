"""The small pools (≤ 8 GPUs) of ``bench_planner exact``, where the exact search is affordable.

A case study of HexGen-2 (4×H100 + 4×A100 on two sites), presets, islands (a box in one site and
smaller GPUs behind a 0.5 Gbit/s pipe: mixed plans win there) and two-box pools (memory-rich GPUs
beside compute-dense, memory-poor L4s on one network).
"""

from __future__ import annotations

from hetserve.specs.cluster import Cluster, cluster_from_dict, load_cluster


def case_study() -> Cluster:
    return cluster_from_dict({
        "name": "case-study-e (4×H100 + 4×A100)",
        "machines": [{"name": "h0", "gpu": "H100-SXM-80G", "count": 4, "site": "a"},
                     {"name": "a0", "gpu": "A100-SXM-80G", "count": 4, "site": "b"}],
        "network": {"intra_site": {"bandwidth_gbps": 10, "latency_ms": 0.5},
                    "inter_site": {"bandwidth_gbps": 3, "latency_ms": 15}}})


def island(g1: str, n1: int, g2: str, n2: int) -> Cluster:
    """A box in one site and an island of smaller GPUs behind a 0.5 Gbit/s pipe (mixed plans win)."""
    return cluster_from_dict({
        "name": f"island {n1}×{g1.split('-')[0]} + {n2}×{g2}",
        "machines": [{"name": "a0", "gpu": g1, "count": n1, "site": "a"},
                     {"name": "b0", "gpu": g2, "count": n2, "site": "b"}],
        "network": {"intra_site": {"bandwidth_gbps": 100, "latency_ms": 0.1},
                    "inter_site": {"bandwidth_gbps": 0.5, "latency_ms": 30}}})


def two_box(g1: str, n1: int, g2: str, n2: int) -> Cluster:
    """Two boxes on one 100 Gbit/s network: memory-rich GPUs beside compute-dense, memory-poor L4s
    (with prompts priced inside mixed decode steps, the pools where mixed plans still win)."""
    return cluster_from_dict({
        "name": f"two-box {n1}×{g1.split('-')[0]} + {n2}×{g2}",
        "machines": [{"name": "a0", "gpu": g1, "count": n1}, {"name": "b0", "gpu": g2, "count": n2}],
        "network": {"intra_site": {"bandwidth_gbps": 100, "latency_ms": 0.1}}})


def exact_cases(only_mixed: bool = False) -> list[tuple[Cluster, str]]:
    """(pool, model name) of the exact benchmark, in its order; ``only_mixed``: the island and
    two-box pools alone."""
    mixed = [(island("H100-SXM-80G", 4, "RTX-4090", 4), "llama-2-7b"),
             (island("A100-SXM-80G", 4, "L4", 2), "llama-2-7b"), (island("L40", 4, "A6000", 4), "llama-2-7b"),
             (two_box("A6000", 2, "L4", 6), "llama-2-7b"), (two_box("A6000", 2, "L4", 6), "llama-2-13b")]
    if only_mixed:
        return mixed
    return [(case_study(), "llama-2-70b"), (load_cluster("hexgen2-homo"), "llama-2-70b"),
            (load_cluster("aladdin-a100"), "llama-2-70b"), (load_cluster("demo-cpu"), "llama-2-7b"),
            (load_cluster("aladdin-v100"), "llama-2-7b"), (load_cluster("molink-3x4090"), "llama-2-7b"), *mixed]
