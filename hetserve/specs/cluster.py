"""Cluster: machines of GPUs, the sites they sit in, and the links between every pair of devices.

A cluster file (YAML, format in DESIGN.md) is resolved into a flat tuple of ``Device``s and two
N×N matrices: ``latency`` (α, seconds) and ``bandwidth`` (β, bytes/s). Everything downstream
(cost model, planner, simulator, runtime link shaping) reads only these.

Link resolution, most specific first:
1. an explicit per-device ``matrix`` (replaces ``network`` entirely);
2. a ``network.links`` override between two machines or two sites;
3. inside one machine: the machine's ``intra`` or the default for its GPU (NVLink fabric or PCIe);
4. between machines of one site: ``network.intra_site``; across sites: ``network.inter_site``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from importlib import resources
from pathlib import Path


import numpy as np
import pydantic

from hetserve.errors import SpecError
from hetserve.specs._validation import read_mapping, validate
from hetserve.specs.gpus import GpuType, gpu

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


MAX_DEVICES_PER_MACHINE = 1024  # far above any real machine; a typo (200000) fails here, not in allocation


class _Link(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", allow_inf_nan=False)
    bandwidth_gbps: float = pydantic.Field(gt=0)
    latency_ms: float = pydantic.Field(ge=0)


class _Override(_Link):
    between: tuple[str, str]


class _Machine(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", allow_inf_nan=False)
    name: str = pydantic.Field(min_length=1, pattern=r"^[A-Za-z0-9_.\-]+$")
    gpu: str
    count: pydantic.StrictInt = pydantic.Field(gt=0, le=MAX_DEVICES_PER_MACHINE)  # strict: `true` is no count
    site: str = "default"
    intra: _Link | None = None
    address: str | None = None  # host for the Ray backend; optional
    # Memory per device, overriding the GPU's: a CPU worker slot or a MIG slice.
    memory_gb: float | None = pydantic.Field(default=None, gt=0)
    # CPU worker slots: the machine's slots share this many cores (the simulator slows work that
    # runs on several slots at once; `hetserve calibrate` measures the slow-down). None: real GPUs.
    cpu_cores: pydantic.StrictInt | None = pydantic.Field(default=None, gt=0)


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

    def subset(self, indices: list[int]) -> "Cluster":
        """A cluster of only these devices (re-indexed 0..k-1), e.g. for exact search on a slice."""
        idx = np.asarray(indices)
        devs = tuple(replace(self.devices[j], index=i) for i, j in enumerate(indices))
        return Cluster(self.name, devs, self.latency[np.ix_(idx, idx)], self.bandwidth[np.ix_(idx, idx)],
                       self.source, self.description, self.assumptions, dict(self.machine_addresses))


def _resolve(spec: _ClusterFile, source: str) -> Cluster:
    devices: list[Device] = []
    machine_gpu: dict[str, GpuType] = {}
    for mi, m in enumerate(spec.machines):
        if m.name in machine_gpu:
            raise SpecError(source, f"machines.{mi}.name", "a unique machine name", m.name)
        g = gpu(m.gpu, source, f"machines.{mi}.gpu")
        machine_gpu[m.name] = g
        memory = m.memory_gb * 1e9 if m.memory_gb else 0.0
        for k in range(m.count):
            devices.append(Device(len(devices), f"{m.name}:{k}", m.name, m.site, g, memory, m.cpu_cores))
    n = len(devices)
    machines = {m.name: m for m in spec.machines}
    sites = {m.site for m in spec.machines}

    if spec.matrix is not None:
        for key in ("bandwidth_gbps", "latency_ms"):
            rows = getattr(spec.matrix, key)
            if len(rows) != n or any(len(r) != n for r in rows):  # also catches ragged rows
                raise SpecError(source, f"matrix.{key}", f"a {n}×{n} list of lists (one row per device)",
                                f"{len(rows)} rows of lengths {sorted({len(r) for r in rows})}")
        bw, lat = (np.asarray(spec.matrix.bandwidth_gbps, float), np.asarray(spec.matrix.latency_ms, float))
        off = ~np.eye(n, dtype=bool)
        if (bw[off] <= 0).any():
            raise SpecError(source, "matrix.bandwidth_gbps", "positive values off the diagonal")
        if (lat < 0).any():
            raise SpecError(source, "matrix.latency_ms", "non-negative values")
        bandwidth, latency = bw * GBPS, lat * MS
    else:
        bandwidth, latency = np.zeros((n, n)), np.zeros((n, n))
        overrides: dict[frozenset[str], _Link] = {}
        for li, o in enumerate(spec.network.links):
            for end in o.between:
                if end not in machines and end not in sites:
                    raise SpecError(source, f"network.links.{li}.between",
                                    "machine or site names from this file", end)
            x, y = o.between
            if not ((x in machines and y in machines) or (x in sites and y in sites and x != y)):
                # a machine-site pair or one site twice would never match a device pair below
                raise SpecError(source, f"network.links.{li}.between",
                                "two machine names or two different site names", f"{x}, {y}")
            overrides[frozenset(o.between)] = o
        for a in devices:
            for b in devices:
                if a.index == b.index:
                    continue
                link = (overrides.get(frozenset((a.machine, b.machine)))
                        or (overrides.get(frozenset((a.site, b.site))) if a.site != b.site else None))
                if link is None:
                    if a.machine == b.machine:
                        intra = machines[a.machine].intra
                        gbps, ms = ((intra.bandwidth_gbps, intra.latency_ms) if intra
                                    else default_intra_link(a.gpu))
                    else:
                        key = "intra_site" if a.site == b.site else "inter_site"
                        link = getattr(spec.network, key)
                        if link is None:
                            raise SpecError(source, f"network.{key}",
                                            "{bandwidth_gbps, latency_ms} (needed between "
                                            f"{a.machine} and {b.machine})")
                if link is not None:
                    gbps, ms = link.bandwidth_gbps, link.latency_ms
                bandwidth[a.index, b.index] = gbps * GBPS
                latency[a.index, b.index] = ms * MS
    np.fill_diagonal(bandwidth, np.inf)
    np.fill_diagonal(latency, 0.0)
    addresses = {m.name: m.address for m in spec.machines if m.address}
    return Cluster(spec.name, tuple(devices), latency, bandwidth, spec.source, spec.description,
                   spec.assumptions, addresses)


def cluster_from_dict(data: dict, source: str = "<cluster>") -> Cluster:
    """Build a cluster from an already-parsed mapping (the YAML file's content)."""
    return _resolve(validate(_ClusterFile, data, source), source)


def _preset_dir() -> Path:
    return Path(str(resources.files("hetserve") / "data" / "clusters"))


def cluster_presets() -> list[str]:
    """Names of the bundled cluster presets."""
    return sorted(p.stem for p in _preset_dir().glob("*.yaml"))


def load_cluster(name_or_path: str | Path) -> Cluster:
    """Load a cluster from a YAML/JSON file or a bundled preset name."""
    path = Path(name_or_path)
    if not path.exists():
        preset = _preset_dir() / f"{name_or_path}.yaml"
        if not preset.exists():
            raise SpecError(str(name_or_path), "(cluster)",
                            "an existing file or a preset: " + ", ".join(cluster_presets()))
        path = preset
    return cluster_from_dict(read_mapping(path), str(path))


