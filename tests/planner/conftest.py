import pytest

from hetserve.specs.cluster import cluster_from_dict
from hetserve.specs.model import load_model
from hetserve.specs.workload import load_workload


@pytest.fixture(scope="session")
def azure():
    return load_workload("azure-conv")


@pytest.fixture(scope="session")
def llama70b():
    return load_model("llama-2-70b")


@pytest.fixture(scope="session")
def llama7b():
    return load_model("llama-2-7b")


def case_study_cluster():
    """HexGen-2 Appendix E: 4×H100 + 4×A100 (one box each, in two data centres)."""
    return cluster_from_dict({
        "name": "case-study-e",
        "machines": [{"name": "h0", "gpu": "H100-SXM-80G", "count": 4, "site": "a"},
                     {"name": "a0", "gpu": "A100-SXM-80G", "count": 4, "site": "b"}],
        "network": {"intra_site": {"bandwidth_gbps": 10, "latency_ms": 0.5},
                    "inter_site": {"bandwidth_gbps": 3, "latency_ms": 15}},
    })


@pytest.fixture(scope="session")
def case_study():
    return case_study_cluster()
