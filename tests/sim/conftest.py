"""Small clusters and plans for simulator tests (llama-2-7b on A100s: fast, exact arithmetic)."""

from __future__ import annotations

import pytest

from hetserve.cost.analytic import CostModel
from hetserve.specs.cluster import cluster_from_dict
from hetserve.specs.model import load_model


def two_box_cluster(gbps_between: float = 100.0, latency_ms: float = 1.0, gpu: str = "A100-SXM-80G"):
    """Boxes m0 and m1 with 4 GPUs each, joined by ``gbps_between`` / ``latency_ms``."""
    return cluster_from_dict({
        "name": "test",
        "machines": [{"name": "m0", "gpu": gpu, "count": 4, "site": "s0"},
                     {"name": "m1", "gpu": gpu, "count": 4, "site": "s1"}],
        "network": {"inter_site": {"bandwidth_gbps": gbps_between, "latency_ms": latency_ms}},
    })


@pytest.fixture
def cluster():
    return two_box_cluster()


@pytest.fixture
def model():
    return load_model("llama-2-7b")


@pytest.fixture
def cost(cluster, model):
    return CostModel(cluster, model)
