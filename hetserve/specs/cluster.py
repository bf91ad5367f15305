"""Cluster: machines of GPUs, the sites they sit in, and the links between every pair of devices.

A cluster file (YAML, format in docs/design.md) is resolved into a flat tuple of ``Device``s and two
N×N matrices: ``latency`` (α, seconds) and ``bandwidth`` (β, bytes/s). Everything downstream
(cost model, planner, simulator, runtime link shaping) reads only these.

Links are shared resources (docs/design.md): every machine has a NIC (``nic``, default
``network.intra_site``), every pair of sites a pipe (a site-pair ``network.links`` entry, default
``network.inter_site``), a machine-pair ``network.links`` entry is a dedicated link; inside a box
each GPU pair has its own link (the machine's ``intra`` or the default for its GPU). ``Cluster.path``
gives the resources a transfer crosses (``hetserve.specs.network``); the α/β matrices are the
uncontended view derived from those paths (β = the narrowest resource on the path). An explicit
per-device ``matrix`` replaces all of this with private per-pair links.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import cached_property
from importlib import resources
from pathlib import Path


import numpy as np
import pydantic

from hetserve.errors import SpecError
from hetserve.specs._validation import read_mapping, validate
from hetserve.specs.gpus import GpuType, gpu
from hetserve.specs.network import Path as NetPath, Resource, Topology, pair_path

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


# ----------------------------------------------------------------------------- file schema


MAX_DEVICE_MEMORY_GB = 1e5  # 100 TB per device: past any accelerator; 1e300 would overflow in bytes
MAX_DEVICES_PER_MACHINE = 1024  # far above any real machine; a typo (200000) fails here, not in allocation
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


class _Machine(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", allow_inf_nan=False)
    name: str = pydantic.Field(min_length=1, pattern=r"^[A-Za-z0-9_.\-]+$")
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
    matrix: _Matrix | None = None


# ----------------------------------------------------------------------------- resolved form


@dataclass(frozen=True)
class Device:
    """One GPU (or, without GPUs, one worker slot). ``index`` is its row in the link matrices."""

    index: int
    name: str  # "<machine>:<i>"
    machine: str
    site: str
    gpu: GpuType
    memory_bytes: float = 0.0  # 0: the GPU's own memory
    cpu_cores: int | None = None  # CPU worker slot: cores its machine's slots share (None: a GPU)
    cpu_host: str | None = None  # CPU worker slot: the host whose cores it shares (its machine, or `cpu_host`)

    def __post_init__(self) -> None:
        if self.memory_bytes <= 0:
            object.__setattr__(self, "memory_bytes", self.gpu.memory_bytes)


@dataclass(frozen=True, eq=False)
class Cluster:
    """Devices plus α (s) and β (bytes/s) between every pair. Diagonal: α=0, β=inf."""

    name: str
    devices: tuple[Device, ...]
    latency: np.ndarray  # (N, N) seconds
    bandwidth: np.ndarray  # (N, N) bytes/s
    source: str = ""
    description: str = ""
    assumptions: str = ""
    machine_addresses: dict[str, str] = field(default_factory=dict)
    topology: Topology | None = None  # None: an explicit matrix (private per-pair links)

    def __post_init__(self) -> None:
        n = len(self.devices)
        if self.latency.shape != (n, n) or self.bandwidth.shape != (n, n):
            raise ValueError("link matrices must be N×N for N devices")

    def __len__(self) -> int:
        return len(self.devices)

    @cached_property
    def _by_name(self) -> dict[str, Device]:
        return {d.name: d for d in self.devices}

    def device(self, name: str) -> Device:
        try:
            return self._by_name[name]
        except KeyError:
            raise SpecError(self.name, "device", f"a device of this cluster ({self.devices[0].name} …)",
                            name) from None

    def has_device(self, name: str) -> bool:
        return name in self._by_name

    @cached_property
    def machines(self) -> dict[str, tuple[Device, ...]]:
        out: dict[str, list[Device]] = {}
        for d in self.devices:
            out.setdefault(d.machine, []).append(d)
        return {k: tuple(v) for k, v in out.items()}

    @cached_property
    def sites(self) -> dict[str, tuple[Device, ...]]:
        out: dict[str, list[Device]] = {}
        for d in self.devices:
            out.setdefault(d.site, []).append(d)
        return {k: tuple(v) for k, v in out.items()}

    @cached_property
    def gpu_types(self) -> tuple[GpuType, ...]:
        seen: dict[str, GpuType] = {}
        for d in self.devices:
            seen.setdefault(d.gpu.name, d.gpu)
        return tuple(seen.values())

    @property
    def total_memory_bytes(self) -> float:
        return sum(d.memory_bytes for d in self.devices)

    def usd_per_hour(self, indices: list[int] | tuple[int, ...] | None = None) -> float | None:
        """Rental price of the given devices (all by default); None if any price is unknown."""
        devs = self.devices if indices is None else [self.devices[i] for i in indices]
        prices = [d.gpu.usd_per_hour for d in devs]
        return None if any(p is None for p in prices) else float(sum(prices))  # type: ignore[arg-type]

    def link(self, a: int, b: int) -> tuple[float, float]:
        """(latency s, bandwidth bytes/s) from device a to device b."""
        return float(self.latency[a, b]), float(self.bandwidth[a, b])

    def path(self, a: int, b: int) -> NetPath:
        """The shared resources a transfer from device a to device b crosses (see module doc)."""
        da, db = self.devices[a], self.devices[b]
        if self.topology is None:
            return pair_path(da.name, db.name, float(self.latency[a, b]), float(self.bandwidth[a, b]))
        return self.topology.path(da.name, da.machine, db.name, db.machine)

    def shared_resources(self) -> list[Resource]:
        """NICs (out and in), site pipes and dedicated links; [] for a matrix cluster."""
        return [] if self.topology is None else self.topology.shared_resources()

    def subset(self, indices: list[int]) -> "Cluster":
        """A cluster of only these devices (re-indexed 0..k-1), e.g. for exact search on a slice."""
        idx = np.asarray(indices)
        devs = tuple(replace(self.devices[j], index=i) for i, j in enumerate(indices))
        return Cluster(self.name, devs, self.latency[np.ix_(idx, idx)], self.bandwidth[np.ix_(idx, idx)],
                       self.source, self.description, self.assumptions, dict(self.machine_addresses),
                       self.topology)


def _resolve(spec: _ClusterFile, source: str) -> Cluster:
    devices: list[Device] = []
    machine_gpu: dict[str, GpuType] = {}
    host_cores: dict[str, int] = {}
    for mi, m in enumerate(spec.machines):
        if m.name in machine_gpu:
            raise SpecError(source, f"machines.{mi}.name", "a unique machine name", m.name)
        g = gpu(m.gpu, source, f"machines.{mi}.gpu")
        machine_gpu[m.name] = g
        memory = m.memory_gb * 1e9 if m.memory_gb else 0.0
        host = None
        if m.cpu_cores is not None:
            host = m.cpu_host or m.name
            if host_cores.setdefault(host, m.cpu_cores) != m.cpu_cores:
                raise SpecError(source, f"machines.{mi}.cpu_cores",
                                f"{host_cores[host]}, as the other machines on host {host!r} say", m.cpu_cores)
        elif m.cpu_host is not None:
            raise SpecError(source, f"machines.{mi}.cpu_host", "cpu_cores beside it (the host's cores its slots share)",
                            m.cpu_host)
        for k in range(m.count):
            devices.append(Device(len(devices), f"{m.name}:{k}", m.name, m.site, g, memory, m.cpu_cores, host))
    n = len(devices)

    topology = None
    if spec.matrix is not None:
        for key in ("bandwidth_gbps", "latency_ms"):
            rows = getattr(spec.matrix, key)
            if len(rows) != n or any(len(r) != n for r in rows):  # also catches ragged rows
                raise SpecError(source, f"matrix.{key}", f"a {n}×{n} list of lists (one row per device)",
                                f"{len(rows)} rows of lengths {sorted({len(r) for r in rows})}")
        bw, lat = (np.asarray(spec.matrix.bandwidth_gbps, float), np.asarray(spec.matrix.latency_ms, float))
        off = ~np.eye(n, dtype=bool)
        if (bw[off] <= 0).any() or (bw[off] > MAX_LINK_GBPS).any():
            raise SpecError(source, "matrix.bandwidth_gbps", f"values in (0, {MAX_LINK_GBPS:g}] off the diagonal",
                            f"{bw[off].min():g} .. {bw[off].max():g}")
        if (lat < 0).any() or (lat > MAX_LINK_LATENCY_MS).any():
            raise SpecError(source, "matrix.latency_ms", f"values in [0, {MAX_LINK_LATENCY_MS:g}]",
                            f"{lat.min():g} .. {lat.max():g}")
        bandwidth, latency = bw * GBPS, lat * MS
    else:
        topology = _topology(spec, source, machine_gpu)
        bandwidth, latency = _pair_matrices(topology, [d.machine for d in devices])
    np.fill_diagonal(bandwidth, np.inf)
    np.fill_diagonal(latency, 0.0)
    addresses = {m.name: m.address for m in spec.machines if m.address}
    return Cluster(spec.name, tuple(devices), latency, bandwidth, spec.source, spec.description,
                   spec.assumptions, addresses, topology)


def _pair_matrices(topology: Topology, machine_of: list[str]) -> tuple[np.ndarray, np.ndarray]:
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


def _topology(spec: _ClusterFile, source: str, machine_gpu: dict[str, GpuType]) -> Topology:
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


def cluster_from_dict(data: dict, source: str = "<cluster>") -> Cluster:
    """Build a cluster from an already-parsed mapping (the YAML file's content)."""
    return _resolve(validate(_ClusterFile, data, source), source)


def _preset_dir() -> Path:
    return Path(str(resources.files("hetserve") / "data" / "clusters"))


def preset_path(name: str) -> Path:
    """The file of a bundled cluster preset."""
    return _preset_dir() / f"{name}.yaml"


def cluster_presets() -> list[str]:
    """Names of the bundled cluster presets."""
    return sorted(p.stem for p in _preset_dir().glob("*.yaml"))


def load_cluster(name_or_path: str | Path) -> Cluster:
    """Load a cluster from a YAML/JSON file or a bundled preset name."""
    path = Path(name_or_path)
    if not path.exists():
        preset = preset_path(str(name_or_path))
        if not preset.exists():
            raise SpecError(str(name_or_path), "(cluster)",
                            "an existing file or a preset: " + ", ".join(cluster_presets()))
        path = preset
    return cluster_from_dict(read_mapping(path), str(path))


