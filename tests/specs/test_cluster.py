"""Cluster loader: the good paths and every bad-input path gives a one-line SpecError."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest

from hetserve.errors import SpecError
from hetserve.specs.cluster import GBPS, MS, cluster_from_dict, default_intra_link, load_cluster
from hetserve.specs.gpus import gpu

TWO_BOXES = """\
name: t
machines:
  - {name: a0, gpu: H100-SXM-80G, count: 2, site: east}
  - {name: b0, gpu: RTX-4090, count: 2, site: west}
network:
  inter_site: {bandwidth_gbps: 1, latency_ms: 50}
"""


def write(tmp_path, text: str, name: str = "c.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def spec_error(tmp_path, text: str) -> SpecError:
    path = write(tmp_path, text)
    with pytest.raises(SpecError) as info:
        load_cluster(path)
    err = info.value
    msg = str(err)
    assert "\n" not in msg
    assert msg.startswith(f"{path}: field '{err.field}': expected ")
    return err


# ----------------------------------------------------------------------------- good inputs


def test_network_form(tmp_path):
    c = load_cluster(write(tmp_path, TWO_BOXES))
    assert [d.name for d in c.devices] == ["a0:0", "a0:1", "b0:0", "b0:1"]
    assert c.bandwidth[0, 2] == pytest.approx(1 * GBPS) and c.latency[0, 2] == pytest.approx(50 * MS)
    assert np.isinf(c.bandwidth[1, 1]) and c.latency[1, 1] == 0


def test_default_intra_nvlink_vs_pcie(tmp_path):
    c = load_cluster(write(tmp_path, TWO_BOXES))
    # H100 SXM: NVLink fabric; RTX 4090: PCIe
    assert c.bandwidth[0, 1] == pytest.approx(3600 * GBPS) and c.latency[0, 1] == pytest.approx(0.005 * MS)
    assert c.bandwidth[2, 3] == pytest.approx(200 * GBPS) and c.latency[2, 3] == pytest.approx(0.01 * MS)
    assert default_intra_link(gpu("A100-SXM-80G")) == (2400.0, 0.005)
    assert default_intra_link(gpu("V100-32G")) == (1200.0, 0.005)
    assert default_intra_link(gpu("H100-PCIe-80G")) == (400.0, 0.01)
    assert default_intra_link(gpu("L40")) == (200.0, 0.01)


def test_machine_intra_overrides_default(tmp_path):
    c = load_cluster(write(tmp_path, """\
        name: t
        machines:
          - {name: a0, gpu: A100-SXM-80G, count: 2, intra: {bandwidth_gbps: 150, latency_ms: 0.02}}
        """))
    assert c.bandwidth[0, 1] == pytest.approx(150 * GBPS) and c.latency[0, 1] == pytest.approx(0.02 * MS)


def test_machine_pair_override(tmp_path):
    c = load_cluster(write(tmp_path, TWO_BOXES + """\
  links:
    - {between: [b0, a0], bandwidth_gbps: 5, latency_ms: 30}
"""))
    assert c.bandwidth[1, 3] == pytest.approx(5 * GBPS) == c.bandwidth[3, 1]
    assert c.latency[0, 2] == pytest.approx(30 * MS)
    assert c.bandwidth[0, 1] == pytest.approx(3600 * GBPS)  # intra-box untouched


def test_site_pair_override_and_intra_site(tmp_path):
    c = load_cluster(write(tmp_path, """\
        name: t
        machines:
          - {name: a0, gpu: L4, count: 1, site: east}
          - {name: a1, gpu: L4, count: 1, site: east}
          - {name: b0, gpu: L4, count: 1, site: west}
          - {name: c0, gpu: L4, count: 1, site: north}
        network:
          intra_site: {bandwidth_gbps: 25, latency_ms: 0.5}
          inter_site: {bandwidth_gbps: 1, latency_ms: 50}
          links:
            - {between: [east, west], bandwidth_gbps: 0.3, latency_ms: 150}
        """))
    bw, lat = c.bandwidth / GBPS, c.latency / MS
    assert bw[0, 1] == pytest.approx(25) and lat[0, 1] == pytest.approx(0.5)
    assert bw[0, 2] == pytest.approx(0.3) and bw[1, 2] == pytest.approx(0.3) and lat[2, 0] == pytest.approx(150)
    assert bw[0, 3] == pytest.approx(1) and bw[2, 3] == pytest.approx(1)


def test_machine_override_beats_site_override(tmp_path):
    c = cluster_from_dict({
        "name": "t",
        "machines": [{"name": "a", "gpu": "L4", "count": 1, "site": "x"},
                     {"name": "b", "gpu": "L4", "count": 1, "site": "y"}],
        "network": {"inter_site": {"bandwidth_gbps": 1, "latency_ms": 50},
                    "links": [{"between": ["x", "y"], "bandwidth_gbps": 2, "latency_ms": 40},
                              {"between": ["a", "b"], "bandwidth_gbps": 3, "latency_ms": 30}]},
    })
    assert c.bandwidth[0, 1] == pytest.approx(3 * GBPS)


def test_explicit_matrix(tmp_path):
    c = load_cluster(write(tmp_path, """\
        name: m
        machines:
          - {name: a0, gpu: L4, count: 2}
          - {name: b0, gpu: T4, count: 1}
        matrix:
          bandwidth_gbps: [[0, 100, 2], [100, 0, 3], [2, 3, 0]]
          latency_ms: [[0, 0.1, 20], [0.1, 0, 25], [20, 25, 0]]
        """))
    assert c.bandwidth[0, 1] == pytest.approx(100 * GBPS) and c.bandwidth[1, 2] == pytest.approx(3 * GBPS)
    assert c.latency[2, 0] == pytest.approx(20 * MS)
    assert np.isinf(np.diag(c.bandwidth)).all() and (np.diag(c.latency) == 0).all()


def test_one_machine_needs_no_network(tmp_path):
    c = load_cluster(write(tmp_path, "name: one\nmachines: [{name: a, gpu: T4, count: 3}]\n"))
    assert len(c) == 3 and c.sites.keys() == {"default"}


def test_json_file(tmp_path):
    c = load_cluster(write(tmp_path, '{"name": "j", "machines": [{"name": "a", "gpu": "L4", "count": 1}]}',
                           "c.json"))
    assert len(c) == 1


# ----------------------------------------------------------------------------- bad inputs


def test_unknown_gpu(tmp_path):
    err = spec_error(tmp_path, "name: t\nmachines: [{name: a, gpu: H100, count: 1}]\n")
    assert err.field == "machines.0.gpu"
    assert "H100-SXM-80G" in str(err) and "'H100'" in str(err)


def test_unknown_gpu_in_second_machine(tmp_path):
    err = spec_error(tmp_path, TWO_BOXES.replace("RTX-4090", "RTX-9090"))
    assert err.field == "machines.1.gpu"


@pytest.mark.parametrize("count", [-1, 0])
def test_non_positive_count(tmp_path, count):
    err = spec_error(tmp_path, f"name: t\nmachines: [{{name: a, gpu: L4, count: {count}}}]\n")
    assert err.field == "machines.0.count"
    assert "greater than 0" in str(err)


def test_missing_intra_site(tmp_path):
    err = spec_error(tmp_path, """\
        name: t
        machines:
          - {name: a0, gpu: L4, count: 1, site: east}
          - {name: a1, gpu: L4, count: 1, site: east}
        network:
          inter_site: {bandwidth_gbps: 1, latency_ms: 50}
        """)
    assert err.field == "network.intra_site"
    assert "a0" in str(err) and "a1" in str(err)


def test_missing_inter_site(tmp_path):
    err = spec_error(tmp_path, TWO_BOXES.replace("  inter_site", "  intra_site"))
    assert err.field == "network.inter_site"


def test_unknown_name_in_links(tmp_path):
    err = spec_error(tmp_path, TWO_BOXES + """\
  links:
    - {between: [a0, c9], bandwidth_gbps: 5, latency_ms: 30}
""")
    assert err.field == "network.links.0.between" and "'c9'" in str(err)


@pytest.mark.parametrize("pair", [["east", "b0"], ["east", "east"]])
def test_links_between_must_be_two_machines_or_two_sites(tmp_path, pair):
    # a machine-site pair, or one site twice, would never apply: it must be refused, not ignored
    err = spec_error(tmp_path, TWO_BOXES + f"""\
  links:
    - {{between: [{pair[0]}, {pair[1]}], bandwidth_gbps: 5, latency_ms: 30}}
""")
    assert err.field == "network.links.0.between"


@pytest.mark.parametrize("second", ["[a0, b0]", "[b0, a0]"])
def test_a_pair_linked_twice_is_refused_not_overwritten(tmp_path, second):
    err = spec_error(tmp_path, TWO_BOXES + f"""\
  links:
    - {{between: [a0, b0], bandwidth_gbps: 1, latency_ms: 30}}
    - {{between: {second}, bandwidth_gbps: 7, latency_ms: 30}}
""")
    assert err.field == "network.links.1.between" and "network.links.0 already joins" in str(err)


def test_links_between_needs_two_names(tmp_path):
    err = spec_error(tmp_path, TWO_BOXES + """\
  links:
    - {between: [a0], bandwidth_gbps: 5, latency_ms: 30}
""")
    assert err.field.startswith("network.links.0.between")


@pytest.mark.parametrize("bw", [
    "[[0, 1], [1, 0]]",            # 2x2 for 3 devices
    "[[0, 1, 1], [1, 0, 1]]",      # too few rows
    "[[0, 1, 1], [1, 0], [1, 1, 0]]",  # ragged
])
def test_wrong_matrix_shape(tmp_path, bw):
    err = spec_error(tmp_path, f"""\
        name: m
        machines: [{{name: a, gpu: L4, count: 3}}]
        matrix:
          bandwidth_gbps: {bw}
          latency_ms: [[0, 1, 1], [1, 0, 1], [1, 1, 0]]
        """)
    assert err.field == "matrix.bandwidth_gbps"
    assert "3×3" in str(err)


def test_matrix_bad_values(tmp_path):
    err = spec_error(tmp_path, """\
        name: m
        machines: [{name: a, gpu: L4, count: 2}]
        matrix:
          bandwidth_gbps: [[0, 0], [1, 0]]
          latency_ms: [[0, 1], [1, 0]]
        """)
    assert err.field == "matrix.bandwidth_gbps"
    err = spec_error(tmp_path, """\
        name: m
        machines: [{name: a, gpu: L4, count: 2}]
        matrix:
          bandwidth_gbps: [[0, 1], [1, 0]]
          latency_ms: [[0, -1], [1, 0]]
        """)
    assert err.field == "matrix.latency_ms"


def test_malformed_yaml(tmp_path):
    err = spec_error(tmp_path, "name: t\nmachines: [{name: a, gpu: L4, count: 1}\n  bad: : :\n")
    assert err.field == "(file)" and "valid YAML" in str(err)


def test_top_level_not_a_mapping(tmp_path):
    err = spec_error(tmp_path, "- just\n- a list\n")
    assert err.field == "(top level)"


@pytest.mark.parametrize("text, field", [
    ("name: t\nmachines: []\n", "machines"),
    ("machines: [{name: a, gpu: L4, count: 1}]\n", "name"),
    ("name: t\nmachines: [{name: a, gpu: L4, count: 1, colour: red}]\n", "machines.0.colour"),
    ("name: t\nmachines: [{name: 'a b', gpu: L4, count: 1}]\n", "machines.0.name"),
    ("name: t\nmachines: [{name: a, gpu: L4, count: 1}, {name: a, gpu: L4, count: 1}]\n", "machines.1.name"),
    ("name: t\nmachines: [{name: a, gpu: L4, count: 1}, {name: b, gpu: L4, count: 1}]\n"
     "network: {intra_site: {bandwidth_gbps: 0, latency_ms: 1}}\n", "network.intra_site.bandwidth_gbps"),
])
def test_schema_errors_name_the_field(tmp_path, text, field):
    assert spec_error(tmp_path, text).field == field


def test_unknown_preset_lists_presets(tmp_path):
    with pytest.raises(SpecError) as info:
        load_cluster("no-such-preset")
    assert info.value.field == "(cluster)" and "demo-cpu" in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("kind", ["cluster", "model", "workload"])
def test_an_empty_name_is_no_name_not_the_current_folder(kind):
    from hetserve.specs.model import load_model
    from hetserve.specs.workload import load_workload

    load = {"cluster": load_cluster, "model": load_model, "workload": load_workload}[kind]
    with pytest.raises(SpecError) as info:
        load("")
    assert info.value.field == f"({kind})" and info.value.source == "''"


def test_memory_override_per_machine(tmp_path):
    from hetserve.specs.cluster import cluster_from_dict

    c = cluster_from_dict({"name": "m", "machines": [{"name": "a", "gpu": "L4", "count": 2, "memory_gb": 0.5}]})
    assert [d.memory_bytes for d in c.devices] == [0.5e9, 0.5e9]
    assert c.subset([1]).devices[0].memory_bytes == 0.5e9
    with pytest.raises(SpecError, match="machines.0.memory_gb"):
        cluster_from_dict({"name": "m", "machines": [{"name": "a", "gpu": "L4", "count": 1, "memory_gb": -1}]})


# ----------------------------------------------------------------------------- shared network resources

SITES = """\
name: t
machines:
  - {name: a0, gpu: H100-SXM-80G, count: 2, site: east}
  - {name: a1, gpu: H100-SXM-80G, count: 2, site: east, nic: {bandwidth_gbps: 25, latency_ms: 0.1}}
  - {name: b0, gpu: RTX-4090, count: 2, site: west}
network:
  intra_site: {bandwidth_gbps: 10, latency_ms: 0.5}
  inter_site: {bandwidth_gbps: 1, latency_ms: 50}
  links:
    - {between: [east, west], bandwidth_gbps: 2, latency_ms: 40}
"""


def test_paths_cross_nics_and_site_pipes(tmp_path):
    c = load_cluster(write(tmp_path, SITES))
    a0, a1, b0 = c.device("a0:0").index, c.device("a1:0").index, c.device("b0:1").index
    names = [r.name for r in c.path(a0, b0).resources]
    assert names == ["nic-out:a0", "pipe:east>west", "nic-in:b0"]
    assert c.path(a0, b0).latency_s == pytest.approx(40 * MS)  # the pipe's figure, end to end
    assert [r.name for r in c.path(a1, a0).resources] == ["nic-out:a1", "nic-in:a0"]
    # a1's own NIC (25 Gbps) is not the narrowest: a0's (intra_site default, 10) is
    assert c.bandwidth[a1, a0] == pytest.approx(10 * GBPS) and c.latency[a1, a0] == pytest.approx(0.5 * MS)
    assert c.bandwidth[a0, b0] == pytest.approx(2 * GBPS)  # uncontended β = narrowest resource
    # the two H100 boxes share one pipe to the west: the very same resource
    assert c.path(a0, b0).resources[1] == c.path(a1, b0).resources[1]
    assert c.path(a0, a0 + 1).resources[0].kind == "intra"
    kinds = {r.kind for r in c.shared_resources()}
    assert kinds == {"nic_out", "nic_in", "pipe"}


def test_matrix_cluster_has_private_pair_paths(tmp_path):
    c = load_cluster(write(tmp_path, """\
        name: m
        machines: [{name: a, gpu: L4, count: 2}]
        matrix: {bandwidth_gbps: [[0, 8], [8, 0]], latency_ms: [[0, 1], [1, 0]]}
        """))
    assert c.shared_resources() == []
    p = c.path(0, 1)
    assert [r.kind for r in p.resources] == ["pair"] and p.bandwidth == pytest.approx(8 * GBPS)


@pytest.mark.parametrize("where,value", [
    ("nic", "0"), ("nic", "-5"), ("nic", "fast"), ("nic", ".inf"), ("nic", ".nan"),
    ("pipe", "0"), ("pipe", "-1"), ("pipe", "fast"), ("pipe", ".inf")])
def test_bad_nic_or_pipe_bandwidth(tmp_path, where, value):
    if where == "nic":
        text = SITES.replace("nic: {bandwidth_gbps: 25", f"nic: {{bandwidth_gbps: {value}")
        field = "machines.1.nic.bandwidth_gbps"
    else:
        text = SITES.replace("between: [east, west], bandwidth_gbps: 2", f"between: [east, west], bandwidth_gbps: {value}")
        field = "network.links.0.bandwidth_gbps"
    err = spec_error(tmp_path, text)
    assert err.field == field


def test_cpu_slots_name_the_host_whose_cores_they_share(tmp_path):
    """``cpu_host``: boxes emulated on one computer share its ``cpu_cores``; default: each box its
    own; GPUs none. Machines naming one host must agree on its cores; a host without cores is refused."""
    c = load_cluster(write(tmp_path, """
        name: pc
        machines:
          - {name: a, gpu: RTX-4090, count: 2, cpu_cores: 4, cpu_host: pc}
          - {name: b, gpu: L4, count: 1, cpu_cores: 4, cpu_host: pc}
          - {name: c, gpu: L4, count: 1, cpu_cores: 2}
          - {name: g, gpu: H100-SXM-80G, count: 1}
        network: {intra_site: {bandwidth_gbps: 10, latency_ms: 0.2}}
        """))
    assert [(d.cpu_cores, d.cpu_host) for d in c.devices] == [(4, "pc"), (4, "pc"), (4, "pc"), (2, "c"), (None, None)]
    err = spec_error(tmp_path, """
        name: pc
        machines:
          - {name: a, gpu: RTX-4090, count: 2, cpu_cores: 4, cpu_host: pc}
          - {name: b, gpu: L4, count: 1, cpu_cores: 2, cpu_host: pc}
        network: {intra_site: {bandwidth_gbps: 10, latency_ms: 0.2}}
        """)
    assert err.field == "machines.1.cpu_cores" and "4, as the other machines on host 'pc' say" in str(err)
    err = spec_error(tmp_path, """
        name: pc
        machines:
          - {name: a, gpu: RTX-4090, count: 2, cpu_host: pc}
        """)
    assert err.field == "machines.0.cpu_host" and "cpu_cores" in str(err)


def test_a_misspelt_key_is_named_before_the_field_it_left_missing(tmp_path):
    """`bandwdth_gbps` both is unknown and leaves `bandwidth_gbps` missing: the error names the
    misspelt key the user wrote (and the one required there), not only the missing one."""
    err = spec_error(tmp_path, TWO_BOXES.replace("inter_site: {bandwidth_gbps", "inter_site: {bandwdth_gbps"))
    assert err.field == "network.inter_site.bandwdth_gbps"
    assert "check its spelling" in err.expected and "'bandwidth_gbps' is required here" in err.expected


def test_an_unclosed_bracket_names_the_line_it_opened_on(tmp_path):
    err = spec_error(tmp_path, "name: t\nmachines:\n  - {name: a, gpu: L4, count: 2\n  - {name: b}\n")
    assert err.field == "(file)" and "(line 3, noticed at line 4)" in str(err), str(err)


@pytest.mark.parametrize("name", ["hexgen2-het3", "hexgen-half-price", "aladdin-a100"])
def test_matrices_are_every_device_pairs_path(name, tmp_path):
    """The bandwidth / latency matrices (resolved once per machine pair) hold each device pair's
    own path figures, across boxes, across sites, over dedicated links and inside a box."""
    box_link = SITES + "    - {between: [a1, b0], bandwidth_gbps: 7, latency_ms: 3}\n"
    clusters = [load_cluster(name), load_cluster(write(tmp_path, box_link))]
    for c in clusters:
        n = len(c.devices)
        for a in range(n):
            for b in range(n):
                if a == b:
                    assert c.bandwidth[a, b] == np.inf and c.latency[a, b] == 0.0
                else:
                    p = c.path(a, b)
                    assert (c.bandwidth[a, b], c.latency[a, b]) == (p.bandwidth, p.latency_s), (c.name, a, b)
