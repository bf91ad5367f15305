"""KV hand-offs priced once per *kind* of prefill → decode pair (``PlanContext.kv_capacity`` /
``kv_load`` read it).

A hand-off's transfers (``CostModel.kv_transfers``) are fixed by the two layouts' stage shapes
(layers, TP degree, devices per stage) and, for every device pair, the path between them: inside
one machine its in-box link, else the sender's NIC, the dedicated link or site pipe if any, the
receiver's NIC. So two pairs price the same when, with devices, machines and sites numbered in
the order they first appear (prefill devices, then decode devices), they agree on

* the stage shapes and the sequence of device, machine and site numbers;
* every machine's NICs and in-box link (bandwidth, latency);
* for every (prefill machine, decode machine) pair of different machines, the link or pipe
  between them (kind, bandwidth, latency);

— then their transfers cross resources that are the same the same way (a NIC is its machine's, a
pipe its site pair's, a link its machine pair's, an in-box link its device pair's), with the same
bytes and prices. That ``signature`` keys the memo: the capacity (requests per T) and the bytes
per request on each shared resource, the resources named by kind and numbers and named again
for each pair. On a pool of many alike machines nearly every pair is one of a few kinds.
Clusters given as a matrix (no topology: private per-pair links) are not memoised.
"""

from __future__ import annotations

from typing import Callable

from hetserve.cost.layout import ReplicaLayout

Priced = tuple[float, dict[str, float]]  # (requests per T, bytes per request on each shared resource)
_Abstract = tuple  # ("nic_out" | "nic_in", machine no.) | ("pipe", site no., site no.) | ("link", machine no., machine no.)


class KVPairs:
    """The memo of ``PlanContext``'s KV hand-off prices by pair kind (see the module doc)."""

    def __init__(self, cluster):
        self.topology = topo = cluster.topology
        self._memo: dict[tuple, tuple[float, tuple[tuple[_Abstract, float], ...]]] = {}
        self._routes: dict[tuple[str, str], tuple | None] = {}
        if topo is None:
            return
        self.machine_of = [d.machine for d in cluster.devices]
        self._machine = {m: (topo.nic_out[m].bandwidth, topo.nic_out[m].latency_s, topo.nic_in[m].bandwidth,
                             topo.nic_in[m].latency_s, topo.intra.get(m)) for m in topo.nic_out}
        # a shared resource's name -> (kind, the machines or sites it belongs to)
        self._owner: dict[str, tuple[str, str] | tuple[str, str, str]] = {}
        for m in topo.nic_out:
            self._owner[topo.nic_out[m].name] = ("nic_out", m)
            self._owner[topo.nic_in[m].name] = ("nic_in", m)
        for (a, b), r in topo.pipes.items():
            self._owner[r.name] = ("pipe", a, b)
        for (a, b), r in topo.links.items():
            self._owner[r.name] = ("link", a, b)

    def price(self, src: ReplicaLayout, dst: ReplicaLayout, fresh: Callable[[], Priced]) -> Priced:
        """(capacity, loads) of the hand-off ``src`` → ``dst``: from the memo, else ``fresh()``
        (the full pricing), then memoised."""
        if self.topology is None:
            return fresh()
        key, machines, sites = self.signature(src, dst)
        hit = self._memo.get(key)
        if hit is not None:
            cap, loads = hit
            return cap, {self._name(a, machines, sites): b for a, b in loads}
        cap, loads = fresh()
        number = {m: i for i, m in enumerate(machines)}
        site_no = {s: i for i, s in enumerate(sites)}
        abstract = []
        for name, b in loads.items():
            owner = self._owner.get(name)
            if owner is None:  # not a NIC, pipe or link: this kind is not memoised
                return cap, loads
            kind, *owners = owner
            abstract.append(((kind, *(site_no[o] if kind == "pipe" else number[o] for o in owners)), b))
        self._memo[key] = (cap, tuple(abstract))
        return cap, loads

    def signature(self, src: ReplicaLayout, dst: ReplicaLayout) -> tuple[tuple, list[str], list[str]]:
        """(the pair's kind, its machines and its sites in order of first appearance)."""
        machine_of, site_of = self.machine_of, self.topology.machine_site
        devices = src.devices + dst.devices
        device_no: dict[int, int] = {}
        machine_no: dict[str, int] = {}
        machines: list[str] = []
        seq = []
        for d in devices:
            m = machine_of[d]
            k = machine_no.get(m)
            if k is None:
                k = machine_no[m] = len(machines)
                machines.append(m)
            seq.append((device_no.setdefault(d, len(device_no)), k))
        site_no: dict[str, int] = {}
        for m in machines:
            site_no.setdefault(site_of[m], len(site_no))
        src_machines = sorted({machine_no[machine_of[d]] for d in src.devices})
        dst_machines = sorted({machine_no[machine_of[d]] for d in dst.devices})
        routes = tuple(self._route(machines[a], machines[b]) for a in src_machines for b in dst_machines if a != b)
        key = (tuple((s.layers, s.tp, len(s.devices)) for s in src.stages),
               tuple((s.layers, s.tp, len(s.devices)) for s in dst.stages), tuple(seq),
               tuple(site_no[site_of[m]] for m in machines), tuple(self._machine[m] for m in machines), routes)
        return key, machines, list(site_no)

    def _route(self, a: str, b: str) -> tuple | None:
        """What lies between two different machines besides their NICs (as ``Topology.machine_path``)."""
        hit = self._routes.get((a, b), False)
        if hit is False:
            topo = self.topology
            sa, sb = topo.machine_site[a], topo.machine_site[b]
            middle = topo.links.get((a, b)) or (topo.pipes.get((sa, sb)) if sa != sb else None)
            hit = self._routes[(a, b)] = None if middle is None else (middle.kind, middle.bandwidth, middle.latency_s)
        return hit

    def _name(self, resource: _Abstract, machines: list[str], sites: list[str]) -> str:
        topo, kind = self.topology, resource[0]
        if kind == "nic_out":
            return topo.nic_out[machines[resource[1]]].name
        if kind == "nic_in":
            return topo.nic_in[machines[resource[1]]].name
        if kind == "pipe":
            return topo.pipes[(sites[resource[1]], sites[resource[2]])].name
        return topo.links[(machines[resource[1]], machines[resource[2]])].name
