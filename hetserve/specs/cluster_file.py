"""A cluster file's schema (docs/design.md, "Cluster file") and the network it describes.

The pydantic models below are the file's contract: the fields other tools write and the loader
(``hetserve.specs.cluster``) reads. ``topology_of`` turns a ``machines``/``network`` file into its
shared resources (NICs, site pipes, dedicated links, in-box links) and ``pair_matrices`` into the
uncontended α/β view between every two devices.
"""

from __future__ import annotations

import math

import numpy as np
import pydantic

from hetserve.errors import SpecError
from hetserve.specs.gpus import GpuType
from hetserve.specs.network import Resource, Topology

GBPS = 1e9 / 8  # bytes/s in one Gbit/s
MS = 1e-3

# Intra-box defaults. SXM parts sit on an NVLink/NVSwitch fabric; we use the per-direction
# per-GPU NVLink bandwidth (half the bidirectional datasheet figure), which is what NCCL's
# bus bandwidth approaches. PCIe cards (even those that take a 2-GPU bridge: cloud boxes rarely
# have one) talk over PCIe: ~25 GB/s achieved on Gen4 x16, ~50 GB/s on Gen5.
_NVLINK_GBPS = {"H100-SXM-80G": 3600.0, "H200": 3600.0, "A100-SXM-80G": 2400.0, "V100-32G": 1200.0}
_PCIE_GBPS = {"H100-PCIe-80G": 400.0}
_PCIE_DEFAULT_GBPS = 200.0
_NVLINK_LATENCY_MS = 0.005
_PCIE_LATENCY_MS = 0.01


def default_intra_link(gpu_type: GpuType) -> tuple[float, float]:
    """(bandwidth_gbps, latency_ms) between two GPUs of this type in one box."""
    if gpu_type.name in _NVLINK_GBPS:
        return _NVLINK_GBPS[gpu_type.name], _NVLINK_LATENCY_MS
    return _PCIE_GBPS.get(gpu_type.name, _PCIE_DEFAULT_GBPS), _PCIE_LATENCY_MS


def intra_link_kind(gpu_type: GpuType) -> str:
    """The in-box link ``default_intra_link`` assumes for this GPU type: NVLink or PCIe."""
    return "NVLink" if gpu_type.name in _NVLINK_GBPS else "PCIe"


# ----------------------------------------------------------------------------- file schema


MAX_DEVICE_MEMORY_GB = 1e5  # 100 TB per device: past any accelerator; 1e300 would overflow in bytes
MAX_DEVICES_PER_MACHINE = 1024  # far above any real machine; a typo (200000) fails here, not in allocation
# Devices of a whole pool. Every device pair has an entry in the two N×N float64 link matrices (and
# the planner keeps a few more N×N copies): at this limit each matrix takes 0.5 GiB, at 20,480
# devices 3.1 GiB. Twice the largest pool the planner benchmarks (4,096 GPUs, bench/bench_planner.py).
MAX_POOL_DEVICES = 8192
MAX_USD_PER_GPU_HOUR = 1e4  # past any rental price: a larger figure is a typo (or a machine's, not a GPU's)
# Far above any link (NVLink 4 is 3,600 Gbit/s) and any latency: beyond them a value is a typo, and
# near float's range a rate in bytes/s overflows to inf and the transfer arithmetic to nan.
MAX_LINK_GBPS = 1e6
MAX_LINK_LATENCY_MS = 1e6


class _Link(pydantic.BaseModel):
    # allow_inf_nan=False: "inf"/"nan" would slip past gt=0 and make a link that costs nothing
    model_config = pydantic.ConfigDict(extra="forbid", allow_inf_nan=False)
    bandwidth_gbps: float = pydantic.Field(gt=0, le=MAX_LINK_GBPS)
    latency_ms: float = pydantic.Field(ge=0, le=MAX_LINK_LATENCY_MS)


class _Override(_Link):
    between: tuple[str, str]


# a machine's name goes into its devices' ids ("name:index") and into bundles' script file names:
# letters, digits, "_", "." and "-" only, so neither a ":" nor a path separator can sit in one
MACHINE_NAME = r"^[A-Za-z0-9_.\-]+$"


class _Machine(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", allow_inf_nan=False)
    name: str = pydantic.Field(min_length=1, pattern=MACHINE_NAME)
    gpu: str
    count: pydantic.StrictInt = pydantic.Field(gt=0, le=MAX_DEVICES_PER_MACHINE)  # strict: `true` is no count
    site: str = pydantic.Field(default="default", min_length=1)
    intra: _Link | None = None
    nic: _Link | None = None  # the box's network card, each direction (default: network.intra_site)
    address: str | None = None  # host for the Ray backend; optional
    # Memory per device, overriding the GPU's: a CPU worker slot or a MIG slice.
    memory_gb: float | None = pydantic.Field(default=None, gt=0, le=MAX_DEVICE_MEMORY_GB)
    # CPU worker slots: the machine's slots share this many cores (the simulator slows work that
    # runs on several slots at once; `hetserve calibrate` measures the slow-down). None: real GPUs.
    cpu_cores: pydantic.StrictInt | None = pydantic.Field(default=None, gt=0)
    # the host whose cores those are, where boxes are emulated on one machine (the CPU demo's two
    # boxes on one computer): machines naming the same host share its ``cpu_cores``. None: this box.
    cpu_host: str | None = pydantic.Field(default=None, min_length=1)
    # USD per hour for ONE of its GPUs, replacing the GPU table's price (gpus.csv
    # typical_cloud_usd_per_hour) for this machine: the price a pool actually pays, or one the table
    # lacks. One price per GPU type in a file (``cluster._priced_gpus`` says why).
    gpu_usd_per_hour: float | None = pydantic.Field(default=None, ge=0, le=MAX_USD_PER_GPU_HOUR)


class _Network(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    intra_site: _Link | None = None
    inter_site: _Link | None = None
    links: list[_Override] = []


class _Matrix(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", allow_inf_nan=False)
    bandwidth_gbps: list[list[float]]
    latency_ms: list[list[float]]


class _ClusterFile(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    name: str = pydantic.Field(min_length=1)
    description: str = ""
    source: str = ""  # where the numbers come from (presets cite the paper)
    assumptions: str = ""  # what had to be assumed
    machines: list[_Machine] = pydantic.Field(min_length=1)
    network: _Network = _Network()
    matrix: _Matrix | None = None  # private per-pair links instead of ``network`` (never both)


def pair_matrices(topology: Topology, machine_of: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(bandwidth, latency) between every two devices (device i on machine ``machine_of[i]``): a
    device pair's path depends only on its two machines, so each machine pair is resolved once
    and spread over its devices (the diagonal is left to the caller)."""
    names = list(dict.fromkeys(machine_of))
    mbw, mlat = np.empty((len(names), len(names))), np.empty((len(names), len(names)))
    for i, a in enumerate(names):
        for j, b in enumerate(names):
            if i == j:  # two GPUs of one box: its in-box link (unused on a one-GPU machine)
                mbw[i, j], mlat[i, j] = topology.intra.get(a, (np.inf, 0.0))
            else:
                path = topology.machine_path(a, b)
                mbw[i, j], mlat[i, j] = path.bandwidth, path.latency_s
    pos = {x: k for k, x in enumerate(names)}
    at = np.array([pos[x] for x in machine_of], dtype=np.intp)
    return mbw[np.ix_(at, at)], mlat[np.ix_(at, at)]


def topology_of(spec: _ClusterFile, source: str, machine_gpu: dict[str, GpuType]) -> Topology:
    """NICs, site pipes, dedicated links and in-box links of a ``machines``/``network`` file."""
    machines = {m.name: m for m in spec.machines}
    site_of = {m.name: m.site for m in spec.machines}
    sites = sorted(set(site_of.values()))
    net = spec.network
    links: dict[tuple[str, str], Resource] = {}
    pipes: dict[tuple[str, str], Resource] = {}
    for li, o in enumerate(net.links):
        for end in o.between:
            if end not in machines and end not in sites:
                raise SpecError(source, f"network.links.{li}.between", "machine or site names from this file", end)
        x, y = o.between
        if not ((x in machines and y in machines and x != y) or (x in sites and y in sites and x != y)):
            # a machine-site pair or one name twice would never match a device pair
            raise SpecError(source, f"network.links.{li}.between",
                            "two machine names or two different site names", f"{x}, {y}")
        if (x, y) in links or (x, y) in pipes:  # a second entry would silently replace the first
            first = next(i for i, e in enumerate(net.links) if set(e.between) == {x, y})
            raise SpecError(source, f"network.links.{li}.between",
                            f"each pair once (network.links.{first} already joins {x} and {y})", f"{x}, {y}")
        kind, table = ("link", links) if x in machines else ("pipe", pipes)
        for a, b in ((x, y), (y, x)):
            table[(a, b)] = Resource(f"{kind}:{a}>{b}", kind, o.bandwidth_gbps * GBPS, o.latency_ms * MS)
    for a in sites:
        for b in sites:
            if a != b and (a, b) not in pipes:
                link = net.inter_site
                if link is None:
                    # only an error if some machine pair across these sites has no dedicated link
                    needed = [(p, q) for p in machines for q in machines if site_of[p] == a and site_of[q] == b
                              and (p, q) not in links]
                    if needed:
                        raise SpecError(source, "network.inter_site", "{bandwidth_gbps, latency_ms} (needed "
                                        f"between {needed[0][0]} and {needed[0][1]})")
                    continue
                pipes[(a, b)] = Resource(f"pipe:{a}>{b}", "pipe", link.bandwidth_gbps * GBPS, link.latency_ms * MS)
    nic_out, nic_in, intra = {}, {}, {}
    for mi, m in enumerate(spec.machines):
        nic = m.nic or net.intra_site
        if nic is None:
            same_site = [q for q in machines if q != m.name and site_of[q] == m.site and (m.name, q) not in links]
            if same_site:
                raise SpecError(source, "network.intra_site", "{bandwidth_gbps, latency_ms} (needed "
                                f"between {m.name} and {same_site[0]})")
            # nothing in the file bounds this card: only pipes / dedicated links limit its traffic
            bw, lat = math.inf, 0.0
        else:
            bw, lat = nic.bandwidth_gbps * GBPS, nic.latency_ms * MS
        nic_out[m.name] = Resource(f"nic-out:{m.name}", "nic_out", bw, lat)
        nic_in[m.name] = Resource(f"nic-in:{m.name}", "nic_in", bw, lat)
        gbps, ms = ((m.intra.bandwidth_gbps, m.intra.latency_ms) if m.intra
                    else default_intra_link(machine_gpu[m.name]))
        intra[m.name] = (gbps * GBPS, ms * MS)
    return Topology(site_of, nic_out, nic_in, pipes, links, intra)
