"""Shaped links: the transmission scheduler in the runtime's data path.

Every message a worker sends to another device (stage-to-stage activations, prefill → decode KV)
can pass through a ``LinkNetwork``. For each directed device pair it keeps one ``ShapedLink``,
which

1. asks that link's ``TransmissionPolicy`` (serial, fair, MoLink — the very classes the simulator
   drives, from ``hetserve.policies.transmission``) what to put on the wire next, and
2. holds each message back until a wire of the cluster's bandwidth β and latency α for that pair
   would have delivered it, then hands it to the real transport (``deliver()``).

So a slow multi-site pool (the MoLink preset: 100 Mbps / 30 ms) is reproduced on one machine and
the scheduling policies are measured for real, not only simulated.

Allocation semantics are the simulator's (``hetserve.sim.links``), so one policy means the same
thing in both places:

* ``concurrent=False``: the first send gets the whole link until it is done; a send in flight is
  never pre-empted (a chunk on the wire stays on the wire); then the policy is asked again, so
  whatever arrived meanwhile is seen at the next decision.
* ``concurrent=True``: the sends share the bandwidth equally (processor sharing); when one
  finishes or a new message arrives, the bytes moved so far are settled and the policy is asked
  again.

A send of ``n`` bytes occupies the link for ``n / β``; a message is delivered ``α`` after its
last byte leaves. Messages on one link may be delivered out of the order they were sent in (that
is the point of decode-first scheduling): receivers must match messages by their tag.

Layout: ``LinkSchedule`` is the clock-free state machine (unit-tested with a fake clock);
``ShapedLink`` drives one schedule in real time on its own thread; ``LinkNetwork`` owns the
links of one process and is the object the engine's transport hook calls.
"""

from __future__ import annotations

import collections
import math
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from hetserve.policies.base import (DecodeTiming, LinkInfo, TrafficKind, TransferView,
                                    TransmissionPolicy)
from hetserve.policies.transmission import resolve_allocation

_EPS_BYTES = 1e-3
KINDS: tuple[TrafficKind, ...] = ("decode", "prefill", "kv")


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


# ----------------------------------------------------------------------------- the state machine


class _Message:
    __slots__ = ("id", "kind", "total", "remaining", "enqueued", "first_byte")

    def __init__(self, mid: int, kind: TrafficKind, nbytes: float, now: float):
        self.id, self.kind = mid, kind
        self.total = self.remaining = float(nbytes)
        self.enqueued = now
        self.first_byte: float | None = None


class LinkSchedule:
    """One directed link's pending messages and the policy's current allocation; no threads, no clock.

    The caller passes ``now`` to every method and must call ``advance(t)`` no later than
    ``next_event_s()`` would have it (calling it late is fine: events are handled at their own
    times, so a sleepy thread does not change the schedule). Invariants: ``_sends`` is empty iff
    nothing is pending; every message in ``_sends`` is in ``pending``; non-concurrent allocations
    hold exactly one send.
    """

    def __init__(self, latency_s: float, bandwidth: float, policy: TransmissionPolicy,
                 decode_timing: Callable[[], DecodeTiming | None] | None = None,
                 next_decode_in: Callable[[float], float | None] | None = None):
        if bandwidth <= 0:
            raise ValueError(f"bandwidth must be positive, got {bandwidth}")
        if latency_s < 0:
            raise ValueError(f"latency must be non-negative, got {latency_s}")
        self.latency_s, self.bandwidth, self.policy = float(latency_s), float(bandwidth), policy
        self.decode_timing, self.next_decode_in = decode_timing, next_decode_in
        self.pending: dict[int, _Message] = {}
        self._sends: list[list] = []  # [message, bytes of this send left]
        self._concurrent = False
        self._since = 0.0  # when the current allocation's progress was last settled
        self.busy_s = 0.0
        self.bytes_sent: dict[str, float] = {k: 0.0 for k in KINDS}
        self.queueing_s: dict[str, float] = {k: 0.0 for k in KINDS}
        self.messages: dict[str, int] = {k: 0 for k in KINDS}

    # ------------------------------------------------------------------ queries
    @property
    def idle(self) -> bool:
        return not self._sends

    @property
    def pending_bytes(self) -> float:
        return sum(m.remaining for m in self.pending.values())

    def next_event_s(self) -> float | None:
        """When the current allocation's first send finishes (None: nothing on the wire)."""
        if not self._sends:
            return None
        n = len(self._sends) if self._concurrent else 1
        first = min(left for _, left in self._sends)
        return self._since + max(first, 0.0) * n / self.bandwidth

    # ------------------------------------------------------------------ actions
    def put(self, mid: int, kind: TrafficKind, nbytes: float, now: float) -> list[tuple[int, float]]:
        """Enqueue a message; returns messages already finished (``(id, deliver_at)``), see ``advance``."""
        if kind not in KINDS:
            raise ValueError(f"traffic kind must be one of {KINDS}, got {kind!r}")
        if mid in self.pending:
            raise ValueError(f"message {mid} is already pending")
        done = self.advance(now)
        self.messages[kind] += 1
        if nbytes <= 0:  # nothing to put on the wire: only the latency
            done.append((mid, now + self.latency_s))
            return done
        self.pending[mid] = _Message(mid, kind, nbytes, now)
        if not self._sends:
            self._replan(now)
        elif self._concurrent:
            self._settle(now)
            self._replan(now)
        # sequential and busy: the send in flight finishes first, then the policy sees the newcomer
        return done

    def advance(self, now: float) -> list[tuple[int, float]]:
        """Handle every send that finished by ``now``; returns ``(id, deliver_at)`` of finished messages.

        ``deliver_at`` = time the last byte left + α. Running time: O(events × pending).
        """
        done: list[tuple[int, float]] = []
        while True:
            t = self.next_event_s()
            if t is None or t > now:
                return done
            done.extend(self._on_send_done(t))

    # ------------------------------------------------------------------ internals
    def _account(self, m: _Message, nbytes: float) -> None:
        m.remaining -= nbytes
        self.bytes_sent[m.kind] += nbytes

    def _settle(self, now: float) -> None:
        """Account the bytes every current send has moved since ``_since`` (concurrent sharing)."""
        dt = now - self._since
        if dt > 0 and self._sends:
            share = self.bandwidth * dt / len(self._sends)
            for s in self._sends:
                s[1] -= share
                self._account(s[0], share)
            self.busy_s += dt
        self._since = max(self._since, now)

    def _replan(self, now: float) -> None:
        self._sends = []
        if not self.pending:
            return
        views = [TransferView(m.id, m.kind, m.total, max(m.remaining, 0.0), m.enqueued)
                 for m in self.pending.values()]
        timing = self.decode_timing() if self.decode_timing is not None else None
        hint = self.next_decode_in(now) if self.next_decode_in is not None else None
        pairs, self._concurrent = resolve_allocation(
            self.policy, self.pending, views, LinkInfo(self.latency_s, self.bandwidth, timing), now, hint)
        # A concurrent allocation stays concurrent with one send: a newcomer shares the link at once
        # (fair share), rather than waiting as it would behind a non-pre-emptible send.
        sends = [[m, n] for m, n in pairs]
        for m, _ in sends:
            if m.first_byte is None:
                m.first_byte = now
                self.queueing_s[m.kind] += now - m.enqueued
        self._sends, self._since = sends, now

    def _on_send_done(self, now: float) -> list[tuple[int, float]]:
        if self._concurrent:
            self._settle(now)
        else:
            s = self._sends[0]
            self._account(s[0], s[1])
            self.busy_s += s[1] / self.bandwidth
            s[1] = 0.0
            self._since = now
        done = []
        for m, left in self._sends:
            if left <= _EPS_BYTES + 1e-12 * m.total and m.remaining <= _EPS_BYTES + 1e-9 * m.total:
                del self.pending[m.id]
                done.append((m.id, now + self.latency_s))
        self._replan(now)
        return done


# ----------------------------------------------------------------------------- real time


class ShapedLink:
    """One directed link driven in real time: a thread sleeps until the next send finishes or the
    next message is due, and calls each message's ``deliver()`` at its delivery time.

    Messages of one kind are delivered in the order they were sent (the transport's promise): fair
    sharing can finish a small message before a bigger one of the same kind sent earlier, and the
    small one then waits for it. Across kinds the wire decides (decode may overtake prefill).
    ``deliver`` runs on this link's thread; it must not block for long (hand the bytes to a socket
    or a queue). An exception in ``deliver`` goes to ``on_error`` (default: kept in ``errors``) and
    does not stop the link.
    """

    def __init__(self, src: str, dst: str, latency_s: float, bandwidth: float, policy: TransmissionPolicy,
                 clock: Callable[[], float] = time.monotonic,
                 decode_timing: Callable[[], DecodeTiming | None] | None = None,
                 on_error: Callable[[BaseException], None] | None = None):
        self.src, self.dst = src, dst
        self.predictor = DecodeArrivalPredictor()
        self.schedule = LinkSchedule(latency_s, bandwidth, policy, decode_timing, self.predictor)
        self.clock = clock
        self.errors: list[BaseException] = []
        self._on_error = on_error or self.errors.append
        self._cond = threading.Condition()
        self._deliver: dict[int, Callable[[], None]] = {}
        self._order: dict[str, collections.deque[int]] = {k: collections.deque() for k in KINDS}  # send order
        self._kind: dict[int, str] = {}
        self._arrives: dict[int, float] = {}  # off the wire; lands at this time
        self._next_id = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"link {src}->{dst}", daemon=True)
        self._thread.start()

    def send(self, nbytes: float, kind: TrafficKind, deliver: Callable[[], None]) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError(f"link {self.src}->{self.dst} is closed")
            self._next_id += 1
            mid = self._next_id
            now = self.clock()
            self._deliver[mid], self._kind[mid] = deliver, kind
            self._order[kind].append(mid)
            if kind == "decode":
                self.predictor.observe(now)
            self._arrives.update(self.schedule.put(mid, kind, nbytes, now))
            self._cond.notify()

    def stats(self) -> LinkStats:
        with self._cond:
            s = self.schedule
            out = LinkStats(self.src, self.dst, s.latency_s, s.bandwidth)
            out.bytes_sent.update(s.bytes_sent)
            out.messages.update(s.messages)
            out.queueing_s.update(s.queueing_s)
            out.busy_s = s.busy_s
            out.pending_messages = len(self._deliver)
            out.pending_bytes = s.pending_bytes
            return out

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread; messages still queued are dropped."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout)

    def _next_due(self) -> float | None:
        heads = [self._arrives[q[0]] for q in self._order.values() if q and q[0] in self._arrives]
        return min(heads) if heads else None

    def _run(self) -> None:
        while True:
            ready: list[tuple[float, int]] = []
            with self._cond:
                if self._closed:
                    return
                now = self.clock()
                self._arrives.update(self.schedule.advance(now))
                for q in self._order.values():
                    last = -math.inf
                    while q and self._arrives.get(q[0], math.inf) <= now:
                        mid = q.popleft()
                        last = max(last, self._arrives.pop(mid))  # held back behind an earlier one
                        ready.append((last, mid))
                if not ready:
                    wake = [t for t in (self.schedule.next_event_s(), self._next_due()) if t is not None]
                    self._cond.wait(timeout=max(0.0, min(wake) - now) if wake else None)
                    continue
                ready.sort()
                calls = [self._deliver.pop(mid) for _, mid in ready]
                for _, mid in ready:
                    del self._kind[mid]
            for fn in calls:  # outside the lock: delivering may take a moment
                try:
                    fn()
                except BaseException as exc:  # noqa: BLE001 - reported, the link keeps running
                    self._on_error(exc)


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


class DecodeArrivalPredictor:
    """Predicts when the next decode message will reach a link, from the decode messages seen on it.

    This is the link-local stand-in for MoLink's just-in-time window (§4.2, case 3) when the
    engine reports no decode timings: decode traffic is periodic (one message per micro-batch per
    iteration), so the next one is expected ``min gap`` after the last. ``min`` rather than the
    mean: a chunk that ends early costs nothing here (the policy is asked again at once), one that
    ends late delays a decode message. With no recent decode traffic the answer is 0 (smallest
    chunk), since a decode message may follow a prefill at any moment.
    """

    def __init__(self, history: int = 8, horizon_s: float = 2.0):
        self.history, self.horizon_s = history, horizon_s
        self._times: list[float] = []

    def observe(self, t: float) -> None:
        self._times.append(t)
        del self._times[:-self.history - 1]

    def __call__(self, now: float) -> float:
        ts = [t for t in self._times if now - t <= self.horizon_s]
        if len(ts) < 2:
            return 0.0
        gap = min(b - a for a, b in zip(ts, ts[1:]))
        return max(0.0, ts[-1] + gap - now)


PolicyFactory = Callable[[], TransmissionPolicy]


def transmission_policy_factory(name: str, **options) -> PolicyFactory:
    """A factory for the named policy of ``hetserve.policies.transmission.TRANSMISSION_POLICIES``.

    Each link gets its own instance: policies such as MoLink keep per-link state (the waiting
    weight W of Algorithm 1).
    """
    from hetserve.policies.transmission import make_transmission

    make_transmission(name, **options)  # fail now, with the list of names, not on the first send
    return lambda: make_transmission(name, **options)


# The transport's priority classes (hetserve.runtime.transport.Priority) as traffic kinds. Control
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
        from hetserve.runtime.transport import Chunk

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
    """The cluster's α (s) and β (bytes/s) per device pair, as plain picklable data (workers get a copy)."""

    devices: tuple[str, ...]
    latency: tuple[tuple[float, ...], ...]
    bandwidth: tuple[tuple[float, ...], ...]

    @staticmethod
    def from_cluster(cluster) -> "LinkTable":
        return LinkTable(tuple(d.name for d in cluster.devices),
                         tuple(tuple(float(x) for x in row) for row in cluster.latency),
                         tuple(tuple(float(x) for x in row) for row in cluster.bandwidth))

    def lookup(self, src: str, dst: str) -> tuple[float, float] | None:
        """(latency s, bandwidth bytes/s) from ``src`` to ``dst``; None if either is not a device."""
        index = {d: i for i, d in enumerate(self.devices)}
        if src not in index or dst not in index:
            return None
        i, j = index[src], index[dst]
        return self.latency[i][j], self.bandwidth[i][j]


class LinkNetwork:
    """The links out of one process, created on first use from the cluster's α/β per device pair.

    ``send(src, dst, nbytes, kind, deliver)`` puts a message on the ``src`` → ``dst`` link (device
    names, ``machine:index``); ``kind`` is ``decode`` (small, latency-critical activations),
    ``prefill`` (a prompt's activations) or ``kv`` (a KV-cache hand-off). With ``shape=False``
    nothing is delayed or reordered; bytes are only counted. ``time_scale`` divides every
    latency and multiplies every bandwidth (1: as in the cluster file). A pair where either end is
    not a device of the cluster (the engine's coordinator endpoint) is never shaped.
    """

    def __init__(self, cluster, policy: str | PolicyFactory = "serial", shape: bool = True,
                 clock: Callable[[], float] = time.monotonic, time_scale: float = 1.0):
        if time_scale <= 0:
            raise ValueError(f"time_scale must be positive, got {time_scale}")
        self.table = cluster if isinstance(cluster, LinkTable) else LinkTable.from_cluster(cluster)
        self.shape, self.clock, self.time_scale = shape, clock, time_scale
        self.policy_factory = transmission_policy_factory(policy) if isinstance(policy, str) else policy
        self._links: dict[tuple[str, str], ShapedLink | _PassThrough] = {}
        self._lock = threading.Lock()
        self._decode_timing: DecodeTiming | None = None

    def link(self, src: str, dst: str) -> ShapedLink | _PassThrough:
        key = (src, dst)
        with self._lock:
            link = self._links.get(key)
            if link is None:
                pair = self.table.lookup(src, dst)
                if self.shape and src != dst and pair is not None:
                    lat, bw = pair
                    link = ShapedLink(src, dst, lat / self.time_scale, bw * self.time_scale, self.policy_factory(),
                                      self.clock, decode_timing=lambda: self._decode_timing)
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
            return [e for link in self._links.values() for e in getattr(link, "errors", ())]

    def close(self) -> None:
        with self._lock:
            links, self._links = list(self._links.values()), {}
        for link in links:
            link.close()


class LinkSchedulerFactory:
    """The engine's ``link_scheduler`` hook: a picklable ``(src endpoint, dst endpoint) -> LinkScheduler``.

    ``Engine.from_plan(..., link_scheduler=LinkSchedulerFactory(cluster, "molink"))`` ships a copy
    to every worker process; each process builds its own ``LinkNetwork`` on first use (endpoint
    names are device names; other endpoints, such as the engine's coordinator, pass unshaped).

    Link counters live in the sending processes. With ``stats_dir`` set, every process writes its
    counters there (``links-<pid>.json``, every ``stats_every_s``) and ``read_stats()`` merges them
    — a stand-in until the engine can report per-worker link statistics itself.
    """

    def __init__(self, cluster, policy: str = "serial", shape: bool = True, time_scale: float = 1.0,
                 stats_dir: str | None = None, stats_every_s: float = 0.5, **policy_options):
        transmission_policy_factory(policy, **policy_options)  # unknown names fail here, in the parent
        self.table = cluster if isinstance(cluster, LinkTable) else LinkTable.from_cluster(cluster)
        self.policy, self.policy_options = policy, dict(policy_options)
        self.shape, self.time_scale = shape, float(time_scale)
        self.stats_dir, self.stats_every_s = stats_dir, float(stats_every_s)
        self._net: LinkNetwork | None = None
        self._pid: int | None = None
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_net"], state["_pid"], state["_lock"] = None, None, None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def network(self) -> LinkNetwork:
        """This process's links (created on first use)."""
        import os

        with self._lock:
            if self._net is None or self._pid != os.getpid():
                self._net = LinkNetwork(self.table, transmission_policy_factory(self.policy, **self.policy_options),
                                        shape=self.shape, time_scale=self.time_scale)
                self._pid = os.getpid()
                if self.stats_dir:
                    threading.Thread(target=self._write_stats_loop, args=(self._net,), daemon=True,
                                     name="link-stats").start()
            return self._net

    def __call__(self, src: str, dst: str) -> TransportLinkScheduler:
        return TransportLinkScheduler(self.network().link(src, dst))

    def _write_stats_loop(self, net: LinkNetwork) -> None:
        import json
        import os

        path = os.path.join(self.stats_dir, f"links-{os.getpid()}.json")
        while True:
            time.sleep(self.stats_every_s)
            try:
                tmp = path + ".tmp"
                with open(tmp, "w") as f:
                    json.dump([s.to_dict() for s in net.stats()], f)
                os.replace(tmp, path)
            except OSError:
                return  # the directory is gone: the server shut down

    def read_stats(self) -> list[LinkStats]:
        """Every process's counters, merged per link (those written by other processes lag by up to
        ``stats_every_s``)."""
        import glob
        import json
        import os

        groups: list[list[LinkStats]] = []
        if self.stats_dir:
            for path in glob.glob(os.path.join(self.stats_dir, "links-*.json")):
                if path.endswith(f"links-{os.getpid()}.json"):
                    continue
                try:
                    with open(path) as f:
                        groups.append([LinkStats.from_dict(d) for d in json.load(f)])
                except (OSError, ValueError):
                    continue  # being replaced right now; the next scrape reads it
        if self._net is not None:
            groups.append(self._net.stats())
        return merge_stats(groups)

    def close(self) -> None:
        if self._net is not None:
            self._net.close()


def merge_stats(groups: Iterable[Sequence[LinkStats]]) -> list[LinkStats]:
    """Sum the stats of the same (src, dst) link reported by several processes."""
    out: dict[tuple[str, str], LinkStats] = {}
    for group in groups:
        for s in group:
            cur = out.get((s.src, s.dst))
            if cur is None:
                out[(s.src, s.dst)] = LinkStats.from_dict(s.to_dict())
                continue
            for k in KINDS:
                cur.bytes_sent[k] += s.bytes_sent.get(k, 0.0)
                cur.messages[k] += s.messages.get(k, 0)
                cur.queueing_s[k] += s.queueing_s.get(k, 0.0)
            cur.busy_s += s.busy_s
            cur.pending_messages += s.pending_messages
            cur.pending_bytes += s.pending_bytes
    return list(out.values())
