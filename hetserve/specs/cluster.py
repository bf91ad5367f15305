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

from dataclasses import dataclass, field, replace
from functools import cached_property
from importlib import resources
from pathlib import Path

import numpy as np

from hetserve.errors import SpecError
from hetserve.specs._validation import existing_path, read_mapping, refuse_other_kind, shown_name, validate
from hetserve.specs.cluster_file import (  # noqa: F401  (GBPS, MS, default_intra_link: re-exported)
    GBPS, MAX_LINK_GBPS, MAX_LINK_LATENCY_MS, MAX_POOL_DEVICES, MS, _ClusterFile, default_intra_link,
    pair_matrices, topology_of)
from hetserve.specs.gpus import GpuType, gpu
from hetserve.specs.network import Path as NetPath, Resource, Topology, pair_path

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


def gpu_index(device: str) -> int:
    """``a0:3`` → 3: a device name's index on its machine (the GPU index an engine there is given)."""
    return int(device.rpartition(":")[2])


def machine_of(device: str) -> str:
    """``a0:3`` → ``a0``: a device name's machine."""
    return device.rpartition(":")[0]


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
    # the optional fields each machine's entry gave (``intra``, ``nic``, ``gpu_usd_per_hour``, …):
    # where a figure comes from, the file or a default, for ``describe`` to say
    machine_fields: dict[str, frozenset[str]] = field(default_factory=dict)

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
                       self.topology, dict(self.machine_fields))


def _resolve(spec: _ClusterFile, source: str) -> Cluster:
    total = sum(m.count for m in spec.machines)
    if total > MAX_POOL_DEVICES:  # before any per-device matrix is built: they grow as the square
        raise SpecError(source, "machines", f"at most {MAX_POOL_DEVICES:,} devices in all (the link matrices hold "
                        "every device pair)", f"{total:,} devices on {len(spec.machines):,} machines")
    if spec.matrix is not None and "network" in spec.model_fields_set:
        raise SpecError(source, "network", "no network beside matrix (the matrix gives every device pair its own "
                        "link; drop one of the two)", "both")
    devices: list[Device] = []
    machine_gpu = _priced_gpus(spec, source)
    host_cores: dict[str, int] = {}
    for mi, m in enumerate(spec.machines):
        g = machine_gpu[m.name]
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
        topology = topology_of(spec, source, machine_gpu)
        bandwidth, latency = pair_matrices(topology, [d.machine for d in devices])
    np.fill_diagonal(bandwidth, np.inf)
    np.fill_diagonal(latency, 0.0)
    addresses = {m.name: m.address for m in spec.machines if m.address}
    given = {m.name: frozenset(m.model_fields_set) for m in spec.machines}
    return Cluster(spec.name, tuple(devices), latency, bandwidth, spec.source, spec.description,
                   spec.assumptions, addresses, topology, given)


def _priced_gpus(spec: _ClusterFile, source: str) -> dict[str, GpuType]:
    """Each machine's GPU type, priced by its ``gpu_usd_per_hour`` where given, else by the GPU
    table. Every consumer reads prices through ``Device.gpu``, and the planner groups devices by GPU
    type (and site) when it prices subsets under a budget: so one GPU type has one price in a file,
    and machines that disagree are refused rather than priced by whichever came first."""
    out: dict[str, GpuType] = {}
    first: dict[str, tuple[str, GpuType]] = {}  # GPU type -> (machine, its priced GPU)
    for mi, m in enumerate(spec.machines):
        if m.name in out:
            raise SpecError(source, f"machines.{mi}.name", "a unique machine name", m.name)
        g = gpu(m.gpu, source, f"machines.{mi}.gpu")
        if m.gpu_usd_per_hour is not None:
            g = replace(g, usd_per_hour=float(m.gpu_usd_per_hour))
        seen = first.setdefault(g.name, (m.name, g))
        if seen[1].usd_per_hour != g.usd_per_hour:
            other = seen[1].usd_per_hour
            said = "the GPU table lists none" if other is None else f"{other:g}"
            raise SpecError(source, f"machines.{mi}.gpu_usd_per_hour",
                            f"one price per GPU type in a file: {said} for the {g.name}s of machine {seen[0]} "
                            "(give every machine of this type the same gpu_usd_per_hour)",
                            "nothing" if m.gpu_usd_per_hour is None else m.gpu_usd_per_hour)
        out[m.name] = seen[1]  # one GpuType object per type: equal devices compare equal
    return out


def cluster_from_dict(data: dict, source: str = "<cluster>") -> Cluster:
    """Build a cluster from an already-parsed mapping (the YAML file's content)."""
    refuse_other_kind(data, source, "machines", "a cluster file (name, machines, network)")
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
    path = existing_path(name_or_path)
    if path is None:
        preset = preset_path(str(name_or_path))
        if not preset.exists():
            raise SpecError(shown_name(name_or_path), "(cluster)",
                            "an existing file or a preset: " + ", ".join(cluster_presets()))
        path = preset
    return cluster_from_dict(read_mapping(path), str(path))


