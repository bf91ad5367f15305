"""Bundled cluster presets: they load, and their device counts and links match the papers."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from hetserve.specs.cluster import GBPS, MS, _preset_dir, cluster_presets, load_cluster

H100, A100, L40, A6000 = "H100-SXM-80G", "A100-SXM-80G", "L40", "A6000"

# GPU counts per type, as stated in the papers (see each preset's `source`).
EXPECTED_COUNTS = {
    # HexGen-2 Sec. 5.1 and the caption of Figure `comm_matrix`
    "hexgen2-homo": {H100: 8},
    "hexgen2-het1": {H100: 2, A100: 6, L40: 4, A6000: 8},
    "hexgen2-het2": {H100: 3, A100: 3, L40: 6, A6000: 6},
    "hexgen2-het3": {A100: 6, L40: 12, A6000: 6},
    "hexgen2-het4": {H100: 3, A100: 9},
    "hexgen2-het5": {A100: 4, L40: 6, A6000: 10},
    # HexGen Sec. 5.1 and Table 4 (58 GPUs in the full-price setting)
    "hexgen-full-price": {"RTX-3090Ti": 22, "A5000": 16, "A6000": 16, "A40": 4},
    "hexgen-half-price": {"RTX-3090Ti": 22, "A5000": 8},
    # MoLink Sec. 5, Aladdin Sec. 6.1
    "molink-3x4090": {"RTX-4090": 3},
    "aladdin-a100": {A100: 4},
    "aladdin-v100": {"V100-32G": 4},
    "demo-cpu": {"RTX-4090": 2, "L4": 2},
    "demo-tiny": {"RTX-4090": 2, "L4": 2},
}

# The budgets the HexGen-2 paper quotes ($/h); gpus.csv prices are 2026 figures and lower.
HEXGEN2_BUDGET = {"hexgen2-homo": 29.52, "hexgen2-het1": 28.80, "hexgen2-het2": 26.88,
                  "hexgen2-het3": 27.06, "hexgen2-het4": 26.28, "hexgen2-het5": 20.54}


def gbps(cluster) -> np.ndarray:
    return cluster.bandwidth / GBPS


def ms(cluster) -> np.ndarray:
    return cluster.latency / MS


def test_presets_listed_exactly():
    assert set(cluster_presets()) == set(EXPECTED_COUNTS)
    assert len(cluster_presets()) == 13


@pytest.mark.parametrize("name", sorted(EXPECTED_COUNTS))
def test_preset_loads_with_paper_counts(name):
    c = load_cluster(name)
    assert c.name == name
    assert Path(str(_preset_dir() / f"{name}.yaml")).is_file()
    assert dict(Counter(d.gpu.name for d in c.devices)) == EXPECTED_COUNTS[name]
    assert len(c) == sum(EXPECTED_COUNTS[name].values())
    # every preset documents itself
    assert c.description and c.source and c.assumptions
    if not name.startswith("demo-"):
        assert any(w in c.source for w in ("Sec.", "Table", "Figure", "footnote"))


@pytest.mark.parametrize("name", sorted(EXPECTED_COUNTS))
def test_preset_links_are_sane(name):
    c = load_cluster(name)
    bw, lat = gbps(c), ms(c)
    off = ~np.eye(len(c), dtype=bool)
    assert np.allclose(bw, bw.T) and np.allclose(lat, lat.T)
    assert np.isinf(np.diag(bw)).all() and (np.diag(lat) == 0).all()
    assert (bw[off] > 0).all() and np.isfinite(bw[off]).all() and (lat[off] >= 0).all()
    same_box = np.array([[a.machine == b.machine for b in c.devices] for a in c.devices]) & off
    cross_site = np.array([[a.site != b.site for b in c.devices] for a in c.devices])
    if same_box.any():
        assert bw[same_box].min() >= 100  # NVLink or PCIe: hundreds to thousands of Gbps
        assert lat[same_box].max() <= 0.1
    if cross_site.any():
        assert bw[cross_site].max() <= 10  # Ethernet / WAN: at most tens of Gbps
        assert lat[cross_site].min() >= 1
    if same_box.any() and (off & ~same_box).any():
        assert bw[same_box].min() >= 10 * bw[off & ~same_box].max()


def test_preset_files_are_named_after_their_stem():
    import yaml

    for path in _preset_dir().glob("*.yaml"):
        assert yaml.safe_load(path.read_text())["name"] == path.stem


@pytest.mark.parametrize("name", sorted(HEXGEN2_BUDGET))
def test_hexgen2_price_is_computed_and_mentioned(name):
    c = load_cluster(name)
    price = c.usd_per_hour()
    assert price is not None and 0.5 * HEXGEN2_BUDGET[name] < price < HEXGEN2_BUDGET[name]
    assert f"{price:.2f}" in c.assumptions  # catalog price stated ...
    assert f"{HEXGEN2_BUDGET[name]:.2f}" in c.assumptions  # ... next to the paper's budget


def test_hexgen2_box_layout():
    het4 = load_cluster("hexgen2-het4")
    assert {m: len(d) for m, d in het4.machines.items()} == {"h100-0": 3, "a100-0": 5, "a100-1": 4}
    bw = gbps(het4)
    assert bw[0, 1] == pytest.approx(3600)  # H100 NVLink
    assert bw[3, 4] == pytest.approx(2400)  # A100 NVLink
    a0, a1 = het4.device("a100-0:0").index, het4.device("a100-1:0").index
    h = het4.device("h100-0:0").index
    assert bw[a0, a1] == pytest.approx(10) and bw[h, a0] == pytest.approx(3)
    het1 = load_cluster("hexgen2-het1")
    l40 = [d.index for d in het1.devices if d.gpu.name == L40]
    assert gbps(het1)[l40[0], l40[1]] == pytest.approx(200)  # PCIe box
    assert len(load_cluster("hexgen2-homo").machines) == 1


def test_hexgen_regions_follow_footnote_3():
    full = load_cluster("hexgen-full-price")
    assert {s: len(d) for s, d in full.sites.items()} == {
        "iceland": 16, "norway": 6, "nevada": 8, "illinois": 28}
    assert len(full.machines) == 9
    bw, lat = gbps(full), ms(full)
    same_site = np.array([[a.site == b.site and a.machine != b.machine for b in full.devices]
                          for a in full.devices])
    cross = np.array([[a.site != b.site for b in full.devices] for a in full.devices])
    assert np.allclose(bw[same_site], 5) and np.allclose(lat[same_site], 2)
    assert bw[cross].min() >= 0.3 and bw[cross].max() <= 1.0
    assert lat[cross].min() >= 40 and lat[cross].max() <= 150
    assert len(np.unique(lat[cross])) > 1  # region pairs differ
    ic, no = full.device("is-3090ti-0:0").index, full.device("no-3090ti-0:0").index
    nv = full.device("nv-a5000-0:0").index
    assert (lat[ic, no], bw[ic, no]) == pytest.approx((40, 1.0))
    assert (lat[no, nv], bw[no, nv]) == pytest.approx((150, 0.3))
    assert full.usd_per_hour() is None  # RTX-3090Ti and A5000 have no price in gpus.csv

    half = load_cluster("hexgen-half-price")
    assert set(half.sites) == {"iceland", "norway", "nevada"}
    assert np.allclose(gbps(half), gbps(full.subset(list(range(30)))))


def test_molink_links():
    c = load_cluster("molink-3x4090")
    assert len(c.machines) == 3 and all(len(d) == 1 for d in c.machines.values())
    off = ~np.eye(3, dtype=bool)
    assert np.allclose(gbps(c)[off], 0.1) and np.allclose(ms(c)[off], 30)


def test_aladdin_testbeds():
    a100 = load_cluster("aladdin-a100")
    assert all(d.gpu.memory_gb == 80 for d in a100.devices)  # paper: A100 80GB
    off = ~np.eye(4, dtype=bool)
    assert np.allclose(gbps(a100)[off], 200)  # PCIe, not NVLink
    v100 = load_cluster("aladdin-v100")
    assert np.allclose(gbps(v100)[off], 1200)  # NVLink default for V100
    assert len(a100.machines) == len(v100.machines) == 1


def test_demo_cpu_is_small():
    c = load_cluster("demo-cpu")
    assert len(c) == 4 and len(c.machines) == 2 and len(c.sites) == 1


def test_demo_tiny_slots_have_their_own_memory():
    c = load_cluster("demo-tiny")
    assert all(d.memory_bytes == pytest.approx(0.04e9) for d in c.devices)
    assert c.total_memory_bytes == pytest.approx(0.16e9)
