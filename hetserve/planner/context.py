"""What every planning algorithm shares for one (cluster, model, workload): the cost model, the
workload's mean lengths, interchangeable-device classes, the per-replica layout search and the
KV-edge cache.

Device classes: two devices are interchangeable when they have the same GPU type, sit in the same
machine and have identical latency/bandwidth rows (true for every cluster built from machines;
an explicit per-device matrix may break it, and then each device is its own class). Every search
reasons about *how many devices of each class* a group holds, never which ones, which is what
makes the layout cache hit (HexGen §4.2's GPU-type count vectors, refined by machine).
"""

from __future__ import annotations

import dataclasses
import math
from functools import cached_property

import numpy as np

from hetserve.cost.analytic import CostModel
from hetserve.cost.layout import ReplicaLayout
from hetserve.cost.network import concurrent_time
from hetserve.errors import InfeasibleError
from hetserve.planner.kv_pairs import KVPairs
from hetserve.planner.layout.search import LayoutSearch
from hetserve.planner.options import PlanOptions
from hetserve.planner.slo import SLOTargets, kv_loads_within
from hetserve.specs.cluster import Cluster
from hetserve.specs.gpus import fmt_gb
from hetserve.specs.model import ModelSpec
from hetserve.specs.workload import Workload


class PlanContext:
    """Shared state of one planning problem. Build once per (cluster, model, workload, options)."""

    def __init__(self, cluster: Cluster, model: ModelSpec, workload: Workload, options: PlanOptions | None = None):
        self.options = options or PlanOptions()
        self.cluster, self.model, self.workload = cluster, model, workload
        if len(workload) == 0:
            raise InfeasibleError(f"workload {workload.name} has no requests to plan for")
        self.cost = CostModel(cluster, model, self.options.efficiency)
        self.input_tokens = float(workload.mean_input)
        self.output_tokens = float(workload.mean_output)
        self.period_s = float(self.options.period_s)
        self.num_devices = len(cluster)
        usable = self.cost.eff.usable_memory
        self.memory = [d.memory_bytes for d in cluster.devices]
        self.usable_memory = [m * usable for m in self.memory]
        # Bandwidth in Gbit/s with a zero diagonal: the device graph of HexGen-2 §3.1.
        bw = np.array(cluster.bandwidth, dtype=float) * 8 / 1e9
        np.fill_diagonal(bw, 0.0)
        self.bandwidth_gbps = bw
        # SLO-aware capacities (``planner.slo``) for the goodput and cost objectives
        o = self.options
        targets = SLOTargets(o.slo_ttft_s, o.slo_tpot_s)
        self.slo: SLOTargets | None = targets if o.objective != "throughput" and targets.any else None
        self._init_classes()
        self._kv_cache: dict[tuple, float] = {}
        self._kv_kinds = KVPairs(cluster)  # hand-off prices by pair kind
        self._kv_time_cache: dict[tuple, float] = {}  # transfer_shape → seconds
        self._kv_load_cache: dict[tuple, dict[str, float]] = {}
        self._node_load_cache: dict[tuple, dict[str, float]] = {}
        self._group_ids: dict[tuple, int] = {}
        # Shared NICs / site pipes / dedicated links: capacity nodes of the flow network (bytes per T)
        self.resources = {r.name: r for r in cluster.shared_resources() if math.isfinite(r.bandwidth)}
        self.resource_cap = {name: r.bandwidth * self.period_s for name, r in self.resources.items()}
        self.layouts = LayoutSearch(self)  # reads the fields above

    # ------------------------------------------------------------------ device classes
    def _init_classes(self) -> None:
        c = self.cluster
        lat, bw = c.latency, c.bandwidth
        by_key: dict[tuple[str, str], list[int]] = {}
        for d in c.devices:
            by_key.setdefault((d.machine, d.gpu.name), []).append(d.index)
        classes: list[tuple[int, ...]] = []
        for members in by_key.values():
            if _interchangeable(members, lat, bw):
                classes.append(tuple(members))
            else:
                classes.extend((m,) for m in members)
        classes.sort()
        self.classes: list[tuple[int, ...]] = classes
        self.class_of = [0] * len(c)
        for k, members in enumerate(classes):
            for d in members:
                self.class_of[d] = k
        self.class_counts = tuple(len(m) for m in classes)

    @cached_property
    def class_bandwidth_gbps(self) -> np.ndarray:
        """Symmetrised bandwidth (Gbit/s) between a device of class k and one of class l (k = l:
        two members of one class; 0 for a class of one): ``partition.group_bandwidth`` sums it."""
        bw = (self.bandwidth_gbps + self.bandwidth_gbps.T) / 2
        reps = [m[0] for m in self.classes]
        b = bw[np.ix_(reps, reps)].copy()
        for k, m in enumerate(self.classes):
            b[k, k] = bw[m[0], m[1]] if len(m) > 1 else 0.0
        return b

    def class_name(self, k: int) -> str:
        d = self.cluster.devices[self.classes[k][0]]
        return f"{d.machine}/{d.gpu.name}"

    def composition(self, devices) -> tuple[tuple[int, int], ...]:
        """The class-count vector of a device set, as sorted ``(class, count)`` pairs."""
        counts: dict[int, int] = {}
        for d in devices:
            k = self.class_of[d]
            counts[k] = counts.get(k, 0) + 1
        return tuple(sorted(counts.items()))

    # ------------------------------------------------------------------ memory
    @cached_property
    def replica_memory_bytes(self) -> float:
        """HexGen-2 App. A: weights + 32 requests' KV at the workload's mean lengths."""
        return self.cost.replica_memory_required(self.input_tokens, self.output_tokens)

    def group_memory(self, devices) -> float:
        return sum(self.memory[d] for d in devices)

    def can_hold_weights(self, devices) -> bool:
        """Early rejection (HexGen §4.3): usable memory below the weights alone."""
        return sum(self.usable_memory[d] for d in devices) >= self.model.weight_bytes

    def num_replicas_by_memory(self, devices=None) -> int:
        """K of HexGen-2 §3.1: pool memory / one replica's memory (App. A)."""
        mem = self.group_memory(range(self.num_devices) if devices is None else devices)
        return int(mem // self.replica_memory_bytes)

    def check_feasible(self) -> None:
        """Raise ``InfeasibleError`` with the numbers if no replica fits the whole pool."""
        check_weights_fit(self.cluster, self.model, self.cost)

    def no_replica_error(self) -> InfeasibleError:
        """The pool has memory for the weights but no group found a layout that fits (or, under SLOs,
        none that meets them: ``_slo_error``)."""
        m = self.model
        if self.slo is not None and (err := self._slo_error()) is not None:
            return err
        return InfeasibleError(
            f"{m.name} ({fmt_gb(m.weight_bytes)} of weights) found no pipeline layout on the pool "
            f"{self.cluster.name} ({fmt_gb(sum(self.usable_memory))} usable): every stage also needs its "
            f"activation buffers and at least one request's KV cache "
            f"({fmt_gb((self.input_tokens + self.output_tokens) * m.kv_bytes_per_token)})")

    def without_slo(self) -> "PlanContext":
        """This context without its SLOs: the same pool, model, workload, period and efficiencies, with
        throughput capacities (what bounds goodput; ``self`` when it has no SLOs)."""
        if self.slo is None:
            return self
        options = dataclasses.replace(self.options, objective="throughput", slo_ttft_s=None, slo_tpot_s=None,
                                      rate=None, budget_usd_per_hour=None)
        return PlanContext(self.cluster, self.model, self.workload, options)

    def _slo_error(self) -> InfeasibleError | None:
        """Under SLOs, when the pool has layouts without them: the fastest one found, one machine's
        devices each, and how far its stand-alone TTFT / TPOT are from the targets (an SLO no replica
        meets gives every layout a capacity of 0, which is not a memory problem)."""
        free = self.without_slo()
        best = None
        for devices in self.cluster.machines.values():
            found = free.layouts.best([d.index for d in devices], "colocated")
            if found is None:
                continue
            lay = found[0]
            ttft = self.cost.ttft(lay, max(1, round(self.input_tokens)))  # as planner.slo prices it
            tpot = self.cost.decode_step_time(lay, 1, self.input_tokens + self.output_tokens / 2)
            if best is None or (ttft, tpot) < best[:2]:
                best = (ttft, tpot, lay)
        if best is None:
            return None
        ttft, tpot, lay = best
        wanted = " and ".join(f"{name} ≤ {v:g} s" for name, v in (("TTFT", self.slo.ttft_s), ("TPOT", self.slo.tpot_s))
                              if v is not None)
        devices = ", ".join(self.cluster.devices[d].name for d in lay.devices)
        return InfeasibleError(
            f"no replica of {self.model.name} on {self.cluster.name} meets {wanted}: the fastest found "
            f"({devices}) takes TTFT {ttft:.3g} s for the mean prompt ({self.input_tokens:.0f} tokens) and "
            f"TPOT {tpot:.3g} s, each alone (cost model); loosen the SLOs, or plan --objective throughput")

    # ------------------------------------------------------------------ KV edges
    def kv_capacity(self, src: ReplicaLayout, dst: ReplicaLayout, key=None) -> float:
        """Requests per period whose KV cache can move from ``src`` to ``dst`` (App. A).

        ``key``: a cheaper cache key that determines both layouts (e.g. the two device tuples)."""
        key = key or (src, dst)
        cap = self._kv_cache.get(key)
        if cap is None:
            cap = self._kv_pair(src, dst, key)[0]
        return cap

    def _kv_pair(self, src: ReplicaLayout, dst: ReplicaLayout, key) -> tuple[float, dict[str, float]]:
        """(capacity, loads) of a hand-off, cached under ``key`` (``kv_capacity`` / ``kv_load``: a
        search needs both for every new pair), from the memo of pair kinds (``kv_pairs``)."""
        cap, load = self._kv_kinds.price(src, dst, lambda: self._kv_priced(src, dst))
        self._kv_cache[key], self._kv_load_cache[key] = cap, load
        return cap, load

    def _kv_priced(self, src: ReplicaLayout, dst: ReplicaLayout) -> tuple[float, dict[str, float]]:
        """(capacity, loads) of a hand-off, both priced from one list of its transfers."""
        transfers = self.cost.kv_transfers(src, dst, self.input_tokens)
        t = self._kv_time(transfers)
        cap = self.period_s / t if t > 0 else float("inf")
        raw: dict = {}  # what ``CostModel.kv_resource_bytes`` sums, from the same transfers
        for path, nbytes in transfers:
            for r in path.resources:
                if r.shared:
                    raw[r] = raw.get(r, 0.0) + nbytes
        loads = {r.name: b for r, b in raw.items() if r.name in self.resources}
        # within the SLOs a route's KV loads a link only as far as its queueing allows (planner.slo)
        within = kv_loads_within(loads, self.resources, self.slo)
        return (0.0, loads) if within is None else (cap, within)

    def _kv_time(self, transfers) -> float:
        """``CostModel.kv_transfer_time`` memoised by the hand-off's shape (``transfer_shape``):
        on a pool of many alike machines most new prefill/decode pairs repeat one already priced,
        and the max-min sharing is most of a KV edge's cost."""
        if not transfers:
            return 0.0
        shape = transfer_shape(transfers)
        t = self._kv_time_cache.get(shape)
        if t is None:
            t = self._kv_time_cache[shape] = concurrent_time(transfers)
        return t

    def group_id(self, devices: tuple[int, ...], choice: int = 0) -> int:
        """A small integer naming (device tuple, layout choice): KV-edge cache keys of two ints
        hash and compare far faster than two device tuples (a 320-GPU search looks up millions)."""
        key = (devices, choice)
        gid = self._group_ids.get(key)
        if gid is None:
            gid = self._group_ids[key] = len(self._group_ids)
        return gid

    def kv_load(self, src: ReplicaLayout, dst: ReplicaLayout, key=None) -> dict[str, float]:
        """Bytes one request's KV (mean prompt) puts on each shared resource from ``src`` to ``dst``
        (within the SLOs: as the flow network charges them, ``planner.slo.kv_loads_within``)."""
        key = key or (src, dst)
        load = self._kv_load_cache.get(key)
        if load is None:
            load = self._kv_pair(src, dst, key)[1]
        return load

    def node_load(self, layout: ReplicaLayout, role: str) -> dict[str, float]:
        """Bytes one request served by this replica in ``role`` puts on each shared resource by
        itself: activations crossing stage boundaries (prompt tokens for prefill, generated
        tokens for decode, both for colocated) and TP groups across machines."""
        key = (layout, role)
        load = self._node_load_cache.get(key)
        if load is None:
            tokens = {"prefill": self.input_tokens, "decode": self.output_tokens,
                      "colocated": self.input_tokens + self.output_tokens}[role]
            raw = self.cost.pp_resource_bytes(layout, tokens) if len(layout.stages) > 1 or any(
                len({self.cluster.devices[d].machine for d in s.devices}) > 1 for s in layout.stages) else {}
            load = self._node_load_cache[key] = {r.name: b for r, b in raw.items() if r.name in self.resources}
        return load

    def tokens_per_s(self, requests_per_period: float) -> float:
        """The one throughput estimate of every algorithm: requests per T × mean output / T."""
        return requests_per_period * self.output_tokens / self.period_s


def transfer_shape(transfers) -> tuple:
    """What ``cost.network.concurrent_time`` reads of ``(Path, bytes)`` transfers: per transfer
    its bytes, latency and resources, each resource named by the order it first appears in and
    priced by its bandwidth. Transfers of the same shape share the same resources the same way,
    so they take the same time, bit for bit (the sharing iterates resources in that order too);
    which machines or sites they are does not matter."""
    label: dict[str, int] = {}
    bandwidths: list[float] = []
    parts = []
    for path, nbytes in transfers:
        ids = []
        for r in path.resources:
            i = label.get(r.name)
            if i is None:
                i = label[r.name] = len(bandwidths)
                bandwidths.append(r.bandwidth)
            ids.append(i)
        parts.append((tuple(ids), nbytes, path.latency_s))
    return tuple(parts), tuple(bandwidths)


def _interchangeable(members: list[int], lat: np.ndarray, bw: np.ndarray) -> bool:
    if len(members) < 2:
        return True
    first = members[0]
    others = np.ones(lat.shape[0], dtype=bool)
    others[members] = False
    for d in members[1:]:
        if not (np.array_equal(lat[d, others], lat[first, others]) and np.array_equal(bw[d, others], bw[first, others])
                and np.array_equal(lat[others, d], lat[others, first])
                and np.array_equal(bw[others, d], bw[others, first])):
            return False
    inner = np.ix_(members, members)
    off = ~np.eye(len(members), dtype=bool)
    return len(set(lat[inner][off].tolist())) == 1 and len(set(bw[inner][off].tolist())) == 1


def check_weights_fit(cluster: Cluster, model: ModelSpec, cost: CostModel) -> None:
    """Raise ``InfeasibleError`` with the numbers if the pool's usable memory (``cost``'s share of
    each device's) is below the weights alone: no replica fits the whole pool. It reads no request,
    so a command asks it before loading its trace."""
    usable = cost.eff.usable_memory
    memory = [d.memory_bytes for d in cluster.devices]
    have = sum(m * usable for m in memory)
    if have < model.weight_bytes:
        n = len(cluster)
        raise InfeasibleError(
            f"{model.name} needs {fmt_gb(model.weight_bytes)} for its weights alone, the pool {cluster.name} has "
            f"{fmt_gb(sum(memory))} ({fmt_gb(have)} usable at {usable:.0%}) over {n} device{'' if n == 1 else 's'}")
