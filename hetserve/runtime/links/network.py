"""Shaped links (``--shape-links``): the one link model in the runtime's data path, in wall time.

Every message a worker sends to another device (stage-to-stage activations, prefill → decode KV)
can pass through a ``LinkNetwork``. Its ``WallClockLinks`` driver feeds each message to the link
model of ``hetserve.policies.links`` — the very state machine the simulator drives in simulated
time — along the device pair's path of the cluster (NIC out, site pipe or dedicated link, NIC in;
or a private in-box link), holds it back until the model says it lands (last byte + latency),
then hands it to the real transport (``deliver()``). Read the model's docstring for the
semantics: queues per sending NIC with their transmission policy (serial, fair, MoLink), max-min
fair sharing of every resource on the wire, latency once per message.

So a slow multi-site pool (the MoLink preset: 100 Mbps / 30 ms) is reproduced on one machine and
the scheduling policies are measured for real, not only simulated. Messages may be delivered out
of the order they were sent in (decode-first scheduling): receivers match messages by their tag.

Limitation: each process drives its own model, so sharing is emulated among the messages one
worker process sends (its NIC queue, the pipes its messages cross); two workers of one box do not
see each other's traffic on their common NIC.

Layout: the wall-clock driver (``WallClockLinks``, and ``LinkSchedule`` for one private link with an
explicit clock) is in ``hetserve.runtime.links.clock``; here ``ShapedLink`` is one device pair's handle
on it and ``LinkNetwork`` owns the links of one process and is what the transport hook calls.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from hetserve.policies.base import DecodeTiming, TrafficKind, TransmissionPolicy
from hetserve.policies.links import KINDS
from hetserve.specs.network import Path, Resource, pair_path
# the wall-clock driver lives beside this file; its names stay importable from here
from hetserve.runtime.links.clock import (DecodeArrivalPredictor, LinkSchedule,  # noqa: F401
                                         WallClockLinks, private_path)


# ----------------------------------------------------------------------------- statistics


@dataclass
class LinkStats:
    """Counters of one directed link (cumulative since start; times in seconds)."""

    src: str
    dst: str
    latency_s: float
    bandwidth: float  # bytes/s (inf when not shaped)
    bytes_sent: dict[str, float] = field(default_factory=lambda: {k: 0.0 for k in KINDS})
    messages: dict[str, int] = field(default_factory=lambda: {k: 0 for k in KINDS})
    queueing_s: dict[str, float] = field(default_factory=lambda: {k: 0.0 for k in KINDS})  # Σ first byte - enqueue
    busy_s: float = 0.0  # time the wire was in use
    pending_messages: int = 0
    pending_bytes: float = 0.0

    def to_dict(self) -> dict:
        return {"src": self.src, "dst": self.dst, "latency_s": self.latency_s, "bandwidth": self.bandwidth,
                "bytes_sent": dict(self.bytes_sent), "messages": dict(self.messages),
                "queueing_s": dict(self.queueing_s), "busy_s": self.busy_s,
                "pending_messages": self.pending_messages, "pending_bytes": self.pending_bytes}

    @staticmethod
    def from_dict(d: dict) -> "LinkStats":
        s = LinkStats(d["src"], d["dst"], d["latency_s"], d["bandwidth"])
        s.bytes_sent.update(d["bytes_sent"])
        s.messages.update(d["messages"])
        s.queueing_s.update(d["queueing_s"])
        s.busy_s, s.pending_messages, s.pending_bytes = d["busy_s"], d["pending_messages"], d["pending_bytes"]
        return s


class ShapedLink:
    """One device pair's handle on a ``WallClockLinks`` driver (its own private one if none is
    given: a link of ``latency_s`` / ``bandwidth`` alone). Counts its own bytes and messages;
    ``busy_s`` / ``queueing_s`` are its sending queue's (shared by every pair out of that NIC)."""

    def __init__(self, src: str, dst: str, latency_s: float | None = None, bandwidth: float | None = None,
                 policy: TransmissionPolicy | None = None, clock: Callable[[], float] = time.monotonic,
                 decode_timing: Callable[[], DecodeTiming | None] | None = None,
                 on_error: Callable[[BaseException], None] | None = None, *,
                 driver: WallClockLinks | None = None, path: Path | None = None):
        self.src, self.dst = src, dst
        self.path = path if path is not None else private_path(latency_s, bandwidth)  # type: ignore[arg-type]
        self._own = driver is None
        if driver is None:
            if policy is None:
                raise ValueError("a ShapedLink without a driver needs a policy")
            driver = WallClockLinks(lambda: policy, clock, decode_timing, on_error, name=f"link {src}->{dst}")
        self.driver = driver
        self._lock = threading.Lock()
        self._bytes = {k: 0.0 for k in KINDS}
        self._messages = {k: 0 for k in KINDS}
        self._pending: dict[int, float] = {}
        self._seq = 0

    @property
    def errors(self) -> list[BaseException]:
        return self.driver.errors

    def send(self, nbytes: float, kind: TrafficKind, deliver: Callable[[], None]) -> None:
        with self._lock:
            self._seq += 1
            seq = self._seq
            self._pending[seq] = float(nbytes)

        def done() -> None:
            with self._lock:
                self._bytes[kind] += self._pending.pop(seq)
            deliver()

        with self._lock:
            self._messages[kind] += 1
        self.driver.send((self.src, self.dst), self.path, nbytes, kind, done)

    def stats(self) -> LinkStats:
        q = self.driver.queue_of(self.path)
        with self._lock:
            out = LinkStats(self.src, self.dst, self.path.latency_s, self.path.bandwidth)
            out.bytes_sent.update(self._bytes)
            out.messages.update(self._messages)
            out.queueing_s.update(q.queueing_s)
            out.busy_s = q.busy_s
            out.pending_messages = len(self._pending)
            out.pending_bytes = sum(self._pending.values())
            return out

    def close(self, timeout: float = 5.0) -> None:
        if self._own:
            self.driver.close(timeout)


class _PassThrough:
    """An unshaped link: delivers at once on the caller's thread and only counts bytes."""

    def __init__(self, src: str, dst: str):
        self._stats = LinkStats(src, dst, 0.0, float("inf"))
        self._lock = threading.Lock()

    def send(self, nbytes: float, kind: TrafficKind, deliver: Callable[[], None]) -> None:
        with self._lock:
            self._stats.bytes_sent[kind] += float(nbytes)
            self._stats.messages[kind] += 1
        deliver()

    def stats(self) -> LinkStats:
        with self._lock:
            return LinkStats.from_dict(self._stats.to_dict())

    def close(self, timeout: float = 0.0) -> None:
        pass


PolicyFactory = Callable[[], TransmissionPolicy]


def transmission_policy_factory(name: str, **options) -> PolicyFactory:
    """A factory for the named policy of ``hetserve.policies.transmission.TRANSMISSION_POLICIES``.

    Each link gets its own instance: policies such as MoLink keep per-link state (the waiting
    weight W of Algorithm 1).
    """
    from hetserve.policies.transmission import make_transmission

    make_transmission(name, **options)  # fail now, with the list of names, not on the first send
    return lambda: make_transmission(name, **options)


# The transport's priority classes (hetserve.runtime.workers.transport.Priority) as traffic kinds. Control
# messages between workers (sampled tokens going back round the pipeline, acknowledgements) are
# small and on the critical path, like decode activations, so they share the decode class.
PRIORITY_KIND: dict[int, TrafficKind] = {0: "decode", 1: "decode", 2: "prefill", 3: "kv"}


class TransportLinkScheduler:
    """A ``ShapedLink`` behind the transport's ``LinkScheduler`` interface (push / pop / pending_bytes).

    ``push(Outgoing)`` hands the encoded message to the shaped link; ``pop`` returns it, whole, once
    the emulated wire has delivered it, so the transport's sender thread writes it to the real
    socket at the emulated arrival time (no ``LinkShaper`` is needed on top). Chunking is accounted
    in the link's timing; the bytes travel in one piece on the loopback.
    """

    def __init__(self, link: "ShapedLink | _PassThrough"):
        self.link = link
        self._ready: queue.Queue = queue.Queue()
        self._bytes = 0
        self._lock = threading.Lock()

    def push(self, item) -> None:
        from hetserve.runtime.workers.link_scheduling import Chunk

        with self._lock:
            self._bytes += item.nbytes

        def deliver() -> None:
            data = b"".join(item.buffers) if len(item.buffers) > 1 else item.buffers[0]
            self._ready.put(Chunk(item.msg_id, 0, item.nbytes, data))

        self.link.send(item.nbytes, PRIORITY_KIND.get(int(item.priority), "prefill"), deliver)

    def pop(self, timeout: float | None = None):
        try:
            chunk = self._ready.get(timeout=timeout)
        except queue.Empty:
            return None
        with self._lock:
            self._bytes -= chunk.total
        return chunk

    def pending_bytes(self) -> int:
        return self._bytes


@dataclass(frozen=True)
class LinkTable:
    """The cluster's α (s) and β (bytes/s) per device pair and each pair's ``Path`` of shared
    resources, as plain picklable data (workers get a copy)."""

    devices: tuple[str, ...]
    latency: tuple[tuple[float, ...], ...]
    bandwidth: tuple[tuple[float, ...], ...]
    paths: tuple[tuple[Path | None, ...], ...] = ()  # () : private per-pair links from α/β

    @staticmethod
    def from_cluster(cluster) -> "LinkTable":
        n = len(cluster.devices)
        return LinkTable(tuple(d.name for d in cluster.devices),
                         tuple(tuple(float(x) for x in row) for row in cluster.latency),
                         tuple(tuple(float(x) for x in row) for row in cluster.bandwidth),
                         tuple(tuple(cluster.path(i, j) if i != j else None for j in range(n)) for i in range(n)))

    def _index(self, src: str, dst: str) -> tuple[int, int] | None:
        index = {d: i for i, d in enumerate(self.devices)}
        if src not in index or dst not in index:
            return None
        return index[src], index[dst]

    def lookup(self, src: str, dst: str) -> tuple[float, float] | None:
        """(latency s, bandwidth bytes/s) from ``src`` to ``dst``; None if either is not a device."""
        ij = self._index(src, dst)
        if ij is None:
            return None
        i, j = ij
        return self.latency[i][j], self.bandwidth[i][j]

    def path(self, src: str, dst: str, time_scale: float = 1.0) -> Path | None:
        """The pair's path (latencies ÷ ``time_scale``, bandwidths × it); None if not both devices."""
        ij = self._index(src, dst)
        if ij is None or src == dst:
            return None
        i, j = ij
        p = self.paths[i][j] if self.paths else pair_path(src, dst, self.latency[i][j], self.bandwidth[i][j])
        if p is None:
            return None
        if time_scale == 1.0:
            return p
        return Path(tuple(Resource(r.name, r.kind, r.bandwidth * time_scale, r.latency_s / time_scale)
                          for r in p.resources), p.latency_s / time_scale)


class LinkNetwork:
    """The links out of one process: one ``WallClockLinks`` driver, one handle per device pair.

    ``send(src, dst, nbytes, kind, deliver)`` puts a message on the ``src`` → ``dst`` path (device
    names, ``machine:index``); ``kind`` is ``decode`` (small, latency-critical activations),
    ``prefill`` (a prompt's activations) or ``kv`` (a KV-cache hand-off). With ``shape=False``
    nothing is delayed or reordered; bytes are only counted. ``time_scale`` divides every
    latency and multiplies every bandwidth (1: as in the cluster file). A pair where either end is
    not a device of the cluster (the engine's coordinator endpoint) is never shaped.
    """

    def __init__(self, cluster, policy: str | PolicyFactory = "serial", shape: bool = True,
                 clock: Callable[[], float] = time.monotonic, time_scale: float = 1.0,
                 overhead_s: float = 0.0, competing_penalty: float = 0.0):
        if time_scale <= 0:
            raise ValueError(f"time_scale must be positive, got {time_scale}")
        self.table = cluster if isinstance(cluster, LinkTable) else LinkTable.from_cluster(cluster)
        self.shape, self.clock, self.time_scale = shape, clock, time_scale
        self.policy_factory = transmission_policy_factory(policy) if isinstance(policy, str) else policy
        self._links: dict[tuple[str, str], ShapedLink | _PassThrough] = {}
        self._lock = threading.Lock()
        self._decode_timing: DecodeTiming | None = None
        self._driver: WallClockLinks | None = None
        self._overhead_s, self._penalty = overhead_s, competing_penalty

    def link(self, src: str, dst: str) -> ShapedLink | _PassThrough:
        key = (src, dst)
        with self._lock:
            link = self._links.get(key)
            if link is None:
                path = self.table.path(src, dst, self.time_scale)
                if self.shape and path is not None:
                    if self._driver is None:
                        self._driver = WallClockLinks(self.policy_factory, self.clock, lambda: self._decode_timing,
                                                      overhead_s=self._overhead_s, competing_penalty=self._penalty)
                    link = ShapedLink(src, dst, driver=self._driver, path=path)
                else:
                    link = _PassThrough(src, dst)
                self._links[key] = link
            return link

    def send(self, src: str, dst: str, nbytes: float, kind: TrafficKind, deliver: Callable[[], None]) -> None:
        self.link(src, dst).send(nbytes, kind, deliver)

    def observe_decode(self, timing: DecodeTiming) -> None:
        """The sender's latest decode execution timings, for MoLink's just-in-time chunk sizing."""
        self._decode_timing = timing

    def stats(self, devices_only: bool = True) -> list[LinkStats]:
        """Counters of every link used so far (``devices_only``: skip links to non-device endpoints)."""
        with self._lock:
            items = list(self._links.items())
        return [link.stats() for (a, b), link in items
                if not devices_only or self.table.lookup(a, b) is not None]

    def errors(self) -> list[BaseException]:
        with self._lock:
            return list(self._driver.errors) if self._driver is not None else []

    def close(self) -> None:
        with self._lock:
            driver, self._driver, self._links = self._driver, None, {}
        if driver is not None:
            driver.close()

