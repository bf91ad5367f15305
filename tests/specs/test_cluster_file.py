"""The cluster file's contract (docs/design.md): the documented examples load, a pool past the device
limit is refused before its matrices exist, matrix and network exclude each other, and a machine's
``gpu_usd_per_hour`` prices its devices for every reader."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

import hetserve.specs.cluster as cluster_mod
from hetserve.errors import SpecError
from hetserve.specs.cluster import cluster_from_dict
from hetserve.specs.cluster_file import MAX_POOL_DEVICES
from hetserve.specs.gpus import gpu

DESIGN = Path(__file__).resolve().parents[2] / "docs" / "design.md"


def _cluster_examples() -> list[str]:
    text = DESIGN.read_text()
    section = text[text.index("### Cluster file"):text.index("### Plan file")]
    return re.findall(r"```yaml\n(.*?)```", section, re.S)


def test_the_documented_cluster_files_load():
    blocks = _cluster_examples()
    assert len(blocks) == 2  # the network form and the matrix form
    net, matrix = (cluster_from_dict(yaml.safe_load(b), "design.md") for b in blocks)
    assert net.topology is not None and matrix.topology is None
    assert net.devices[0].gpu.usd_per_hour == 2.10  # the example's gpu_usd_per_hour
    assert net.machine_addresses == {"a0": "10.0.0.5"}
    assert matrix.link(0, 2)[1] == pytest.approx(10 * 1e9 / 8)


def test_a_top_level_bandwidth_matrix_is_no_field():
    """The documented key is ``matrix: {bandwidth_gbps, latency_ms}``; the bare keys are refused."""
    data = {"name": "m", "machines": [{"name": "a", "gpu": "L4", "count": 2}],
            "bandwidth_gbps": [[0, 1], [1, 0]], "latency_ms": [[0, 1], [1, 0]]}
    with pytest.raises(SpecError, match="bandwidth_gbps"):
        cluster_from_dict(data, "m.yaml")


def test_matrix_beside_network_is_refused():
    data = yaml.safe_load(_cluster_examples()[1])
    data["network"] = {"intra_site": {"bandwidth_gbps": 1, "latency_ms": 1}}
    with pytest.raises(SpecError) as exc:
        cluster_from_dict(data, "m.yaml")
    assert "m.yaml" in str(exc.value) and "'network'" in str(exc.value) and "matrix" in str(exc.value)


def test_a_pool_past_the_device_limit_is_refused_before_any_matrix(monkeypatch):
    def no_matrices(*args, **kwargs):
        raise AssertionError("matrices built for a pool past the limit")

    monkeypatch.setattr(cluster_mod, "pair_matrices", no_matrices)
    data = {"name": "many", "machines": [{"name": f"m{i}", "gpu": "H100-SXM-80G", "count": 1024} for i in range(20)],
            "network": {"intra_site": {"bandwidth_gbps": 100, "latency_ms": 0.5}}}
    with pytest.raises(SpecError) as exc:
        cluster_from_dict(data, "many.yaml")
    msg = str(exc.value)
    assert "many.yaml" in msg and "20,480 devices" in msg and f"{MAX_POOL_DEVICES:,}" in msg


def test_the_device_limit_admits_the_planner_benchmarks():
    assert MAX_POOL_DEVICES >= 4096  # bench/bench_planner.py plans synthetic pools of up to 4,096 GPUs


def _t4s(a_price=None, b_price=None, b_gpu="T4") -> dict:
    machines = [{"name": "a", "gpu": "T4", "count": 2}, {"name": "b", "gpu": b_gpu, "count": 1}]
    for m, p in zip(machines, (a_price, b_price)):
        if p is not None:
            m["gpu_usd_per_hour"] = p
    return {"name": "t4s", "machines": machines, "network": {"intra_site": {"bandwidth_gbps": 10, "latency_ms": 1}}}


def test_a_machine_price_prices_its_devices_for_every_reader():
    assert gpu("T4").usd_per_hour is None  # the GPU table has none: the reason for the field
    c = cluster_from_dict(_t4s(0.35, 0.35), "t4.yaml")
    assert all(d.gpu.usd_per_hour == 0.35 for d in c.devices)
    assert c.usd_per_hour() == pytest.approx(1.05)
    assert c.devices[0].gpu == c.devices[2].gpu  # one GpuType per type: devices of a type compare equal
    assert "gpu_usd_per_hour" in c.machine_fields["a"]
    assert gpu("T4").usd_per_hour is None  # the catalog itself is left alone


def test_a_machine_price_replaces_the_tables():
    c = cluster_from_dict(_t4s(b_gpu="L4", b_price=0.1), "x.yaml")
    assert c.devices[2].gpu.usd_per_hour == 0.1 and c.devices[0].gpu.usd_per_hour is None
    assert gpu("L4").usd_per_hour != 0.1


@pytest.mark.parametrize("prices", [(0.35, None), (0.35, 0.4), (None, 0.4)])
def test_two_prices_for_one_gpu_type_are_refused(prices):
    with pytest.raises(SpecError) as exc:
        cluster_from_dict(_t4s(*prices), "t4.yaml")
    assert "machines.1.gpu_usd_per_hour" in str(exc.value) and "one price per GPU type" in str(exc.value)


@pytest.mark.parametrize("price", [-1, float("nan"), 1e9])
def test_a_bad_price_is_refused(price):
    with pytest.raises(SpecError, match="gpu_usd_per_hour"):
        cluster_from_dict(_t4s(price, price), "t4.yaml")
