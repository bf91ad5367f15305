"""Shared network resources of a cluster and the path a transfer takes through them.

docs/design.md, "Links are shared resources": a real pool has one network card per box and one pipe
between two sites, and every transfer that crosses them shares them. This module holds that
view; the α/β matrices of ``Cluster`` stay the *uncontended* view (one transfer alone on its
path), and they are derived from the paths built here, so the two never disagree.

Resources (each one direction, capacity in bytes/s):

* ``nic_out`` / ``nic_in`` of a machine: its ``nic`` (default ``network.intra_site``; with
  neither, an unlimited NIC: the file says nothing that could bound it);
* ``pipe`` between two sites: a site-pair ``network.links`` entry, else ``network.inter_site``;
* ``link`` between two machines: a machine-pair ``network.links`` entry (it replaces the pipe or
  the in-site fabric; the traffic still leaves and enters through the two NICs);
* ``intra``: one GPU pair inside a box (non-blocking NVLink/NVSwitch or PCIe, never shared with
  another pair);
* ``pair``: one device pair of an explicit ``matrix`` file (per-pair links, no sharing).

A ``Path`` from device a to b on different machines is ``(a's nic_out, [pipe or link], b's
nic_in)``; inside one machine it is the pair's ``intra`` resource. Its latency: the pipe's (or
dedicated link's) when it crosses one — the file gives that figure end to end, NIC included —
else the larger of the two NICs' (between boxes of one site ``network.intra_site``'s, as before).
A message pays it once, whatever it shares on the way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property

RESOURCE_KINDS = ("nic_out", "nic_in", "pipe", "link", "intra", "pair")
SHARED_KINDS = ("nic_out", "nic_in", "pipe", "link")  # what the planner books capacity on


@dataclass(frozen=True)
class Resource:
    """One direction of a network resource. Equal names mean the same resource."""

    name: str  # "nic-out:a0", "nic-in:b0", "pipe:east>west", "link:a0>b0", "intra:a0:0>a0:1"
    kind: str
    bandwidth: float  # bytes/s
    latency_s: float

    def __post_init__(self) -> None:
        if self.kind not in RESOURCE_KINDS:
            raise ValueError(f"resource kind must be one of {RESOURCE_KINDS}, got {self.kind!r}")
        if not self.bandwidth > 0:
            raise ValueError(f"resource {self.name}: bandwidth must be positive, got {self.bandwidth}")
        if not (self.latency_s >= 0 and math.isfinite(self.latency_s)):
            raise ValueError(f"resource {self.name}: latency must be finite and non-negative")

    def __hash__(self) -> int:  # the name identifies a resource; hashing every field is slow in hot loops
        return hash(self.name)

    @property
    def shared(self) -> bool:
        """True for NICs, site pipes and dedicated links: several device pairs cross it."""
        return self.kind in SHARED_KINDS


@dataclass(frozen=True)
class Path:
    """The resources a transfer from one device to another crosses, in order, and its latency."""

    resources: tuple[Resource, ...]
    latency_s: float

    @cached_property
    def names(self) -> tuple[str, ...]:
        """The resources' names (cheap dictionary keys for the sharing computations)."""
        return tuple(r.name for r in self.resources)

    @cached_property
    def bandwidth(self) -> float:
        """Uncontended rate: the narrowest resource on the path (bytes/s); cached: the link model
        asks for it on every re-plan of a queue."""
        return min(r.bandwidth for r in self.resources)

    @property
    def sender(self) -> Resource:
        """Where a message queues: the first resource (the sending NIC, or the in-box pair)."""
        return self.resources[0]


@dataclass(frozen=True)
class Topology:
    """Machines, sites and their shared resources (a cluster built from ``machines``/``network``)."""

    machine_site: dict[str, str]
    nic_out: dict[str, Resource]
    nic_in: dict[str, Resource]
    pipes: dict[tuple[str, str], Resource]  # (from site, to site)
    links: dict[tuple[str, str], Resource]  # (from machine, to machine)
    intra: dict[str, tuple[float, float]]  # machine -> (bytes/s, latency s) between two of its GPUs
    _intra_cache: dict[tuple[str, str], Resource] = field(default_factory=dict, compare=False, repr=False)

    def path(self, a_name: str, a_machine: str, b_name: str, b_machine: str) -> Path:
        """The path from device ``a_name`` (on ``a_machine``) to ``b_name`` (on ``b_machine``)."""
        if a_machine == b_machine:
            key = (a_name, b_name)
            r = self._intra_cache.get(key)
            if r is None:
                bw, lat = self.intra[a_machine]
                r = self._intra_cache[key] = Resource(f"intra:{a_name}>{b_name}", "intra", bw, lat)
            return Path((r,), r.latency_s)
        return self.machine_path(a_machine, b_machine)

    def machine_path(self, a_machine: str, b_machine: str) -> Path:
        """The path between two different machines (any of their GPUs): NIC out, the dedicated
        link or site pipe if any, NIC in."""
        out, inn = self.nic_out[a_machine], self.nic_in[b_machine]
        sa, sb = self.machine_site[a_machine], self.machine_site[b_machine]
        middle = self.links.get((a_machine, b_machine)) or (self.pipes.get((sa, sb)) if sa != sb else None)
        if middle is not None:
            return Path((out, middle, inn), middle.latency_s)
        return Path((out, inn), max(out.latency_s, inn.latency_s))

    def shared_resources(self) -> list[Resource]:
        """Every NIC (both directions), pipe and dedicated link, in a stable order."""
        out: list[Resource] = []
        for m in self.nic_out:
            out += [self.nic_out[m], self.nic_in[m]]
        out += [self.pipes[k] for k in sorted(self.pipes)]
        out += [self.links[k] for k in sorted(self.links)]
        return out


def pair_path(src: str, dst: str, latency_s: float, bandwidth: float) -> Path:
    """A private per-pair link (explicit matrix files): nothing else crosses it."""
    return Path((Resource(f"pair:{src}>{dst}", "pair", bandwidth, latency_s),), latency_s)
