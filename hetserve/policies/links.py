"""One link model for both clocks: messages over shared network resources.

The simulator drives it with simulated time (``hetserve.sim.links``), the runtime's
``--shape-links`` with wall time (``hetserve.runtime.links.network``); neither keeps its own copy. Pure:
no threads, no sockets, no event loop — every method takes ``now`` and says what happened.

Model (docs/design.md, "Links are shared resources"):

* a message crosses every resource of its ``Path`` (``hetserve.specs.network``): sending NIC,
  site pipe or dedicated link, receiving NIC — or one private in-box / per-pair link;
* messages queue at their path's first resource (the sending NIC; for a private pair, the pair).
  Each queue has its own ``TransmissionPolicy`` (serial, fair, MoLink — ``policies.transmission``)
  that decides which of its messages are on the wire and how many bytes (``resolve_allocation``):
  ``concurrent=False``: one send at a time, never pre-empted (a chunk on the wire stays on it),
  the policy asked again when it ends; ``concurrent=True``: all its sends at once;
* every send on the wire, from every queue, shares every resource it crosses **max-min fairly**
  (``cost.network.max_min_rates``, the very function the cost model prices concurrent transfers
  with); rates are re-shared whenever a send starts or ends;
* a message is delivered its path's latency (+ ``overhead_s``) after its last byte leaves:
  latency once per message, whatever it shared on the way.

Parameters for calibration (defaults reproduce the plain model): ``overhead_s`` per message,
``competing_penalty`` (a resource crossed by n sends delivers ``capacity / (1 + penalty·(n−1))``).

With one private resource per device pair (an explicit matrix cluster) this is exactly the old
per-pair link: a message alone takes ``α + bytes/β`` = ``CostModel.p2p_time``.

Invariants: a queue's ``sends`` is empty iff it has nothing pending; every send's message is
pending in its queue; a non-concurrent queue holds at most one send; ``rates`` align with the
flattened sends and were set at ``since``. Running time per event: O(sends × path length ×
resources on the wire).
"""

from __future__ import annotations

import math
from operator import attrgetter
from typing import Any, Callable, Sequence

from hetserve.cost.network import max_min_rates
from hetserve.policies.base import DecodeTiming, LinkInfo, TrafficKind, TransferView, TransmissionPolicy
from hetserve.policies.transmission import resolve_allocation
from hetserve.specs.network import Path

EPS_BYTES = 1e-3
KINDS: tuple[TrafficKind, ...] = ("decode", "prefill", "kv")


class Message:
    """``copies`` identical messages (one path, one size, one start) kept as one record: each copy
    is a flow of its own in the sharing and in every counter, but they move, finish and are
    delivered together. Only a queue whose policy sends all it holds at once (``sends_all_pending``)
    takes copies: any other policy would order them one by one."""

    __slots__ = ("id", "kind", "path", "names", "total", "remaining", "enqueued", "first_byte", "copies")

    def __init__(self, mid: Any, kind: TrafficKind, path: Path, nbytes: float, now: float, copies: int = 1):
        self.id = mid
        self.kind = kind
        self.path = path
        self.names: tuple = path.names  # its flow class in the sharing (read there per send and event)
        self.total: float = float(nbytes)
        self.remaining: float = self.total
        self.enqueued: float = now
        self.first_byte: float | None = None
        self.copies: int = copies


class WireSend:
    """One message, or the chunk of it its policy allows, on the wire: the bytes of this send left
    and the rate it moves at (set by ``sim.sharing.SharedLinks``; ``LinkModel`` keeps its own)."""

    __slots__ = ("msg", "left", "rate")

    def __init__(self, msg: Message, left: float):
        self.msg = msg
        self.left: float = left
        self.rate: float = 0.0


class SenderQueue:
    """The messages waiting at one sending resource and its policy's current allocation.

    ``decode_timing(now)`` / ``decode_hint(now)`` (set by the caller, optional): the sender's decode
    timings and the predicted time to its next decode message, for MoLink's chunk sizing.
    """

    def __init__(self, name: str, policy: TransmissionPolicy):
        self.name, self.policy = name, policy
        # what the policy says of itself, read once: a queue keeps its policy for life
        self.sends_all = bool(getattr(policy, "sends_all_pending", False))
        self.replan_once = bool(getattr(policy, "replan_once", False))
        self.sharing: Any = None  # a link model's own bookkeeping of this queue (``sim.links.SharedLinks``)
        self.pending: dict[Any, Message] = {}
        self.sends: list[WireSend] = []
        self.concurrent = False
        self.decode_timing: Callable[[float], DecodeTiming | None] | None = None
        self.decode_hint: Callable[[float], float | None] | None = None
        self.busy_s = 0.0  # time with at least one send on the wire
        self.bytes_sent: dict[str, float] = {k: 0.0 for k in KINDS}
        self.messages: dict[str, int] = {k: 0 for k in KINDS}
        self.queueing_s: dict[str, float] = {k: 0.0 for k in KINDS}  # Σ first byte − enqueue

    @property
    def idle(self) -> bool:
        return not self.sends

    @property
    def pending_bytes(self) -> float:
        return sum(m.remaining * m.copies for m in self.pending.values())

    def info(self, now: float) -> LinkInfo:
        """What the policy sees: the narrowest path and the lowest latency among the pending
        messages (a NIC's queue may hold messages to several destinations)."""
        paths = [m.path for m in self.pending.values()]
        bw = min(p.bandwidth for p in paths)
        lat = min(p.latency_s for p in paths)
        timing = self.decode_timing(now) if self.decode_timing is not None else None
        return LinkInfo(lat, bw if math.isfinite(bw) else 1e18, timing)

    def replan(self, now: float) -> None:
        self.sends = []
        if not self.pending:
            return
        if self.sends_all:
            self._send_all(now)
            return
        views = [TransferView(m.id, m.kind, m.total, max(m.remaining, 0.0), m.enqueued)
                 for m in self.pending.values()]
        hint = self.decode_hint(now) if self.decode_hint is not None else None
        pairs, self.concurrent = resolve_allocation(self.policy, self.pending, views, self.info(now), now, hint)
        self.sends = [WireSend(m, n) for m, n in pairs]
        self._first_bytes([m for m, _ in pairs], now)

    def _send_all(self, now: float) -> None:
        """The allocation of a policy that sends every pending message whole, oldest first, at
        once (``sends_all_pending``), without building the views it would ignore."""
        order = list(self.pending.values())
        if len(order) > 1:
            order.sort(key=fifo_key)
        sends = []
        for m in order:
            if m.remaining <= 0:
                raise ValueError(f"transmission policy {self.policy.name!r} sent message {m.id}, "
                                 "which has nothing left to send")
            sends.append(WireSend(m, m.remaining))
        self.sends = sends
        self.concurrent = True
        self._first_bytes(order, now)

    def _first_bytes(self, messages: list[Message], now: float) -> None:
        """Messages on the wire for the first time start now: their queueing ends."""
        for m in messages:
            if m.first_byte is None:
                m.first_byte = now
                self.queueing_s[m.kind] += (now - m.enqueued) * m.copies


fifo_key = attrgetter("enqueued", "id")  # oldest first, ties by id


class LinkModel:
    """Every queue and every send on the wire of one network (see the module doc)."""

    def __init__(self, make_policy: Callable[[], TransmissionPolicy], overhead_s: float = 0.0,
                 competing_penalty: float = 0.0):
        if overhead_s < 0 or competing_penalty < 0:
            raise ValueError("overhead_s and competing_penalty must be non-negative")
        self.make_policy = make_policy
        self.overhead_s, self.competing_penalty = float(overhead_s), float(competing_penalty)
        self.queues: dict[str, SenderQueue] = {}
        self._wire: list[WireSend] = []  # the sends of every queue, flattened (same objects)
        self._queue_of: list[SenderQueue] = []
        self._rates: list[float] = []
        self._since = 0.0
        # rates stale since a send started or ended at ``_since``: they are re-shared once, before
        # time moves on (a KV hand-off puts one message per TP shard / layer piece at one instant)
        self._stale = False

    # ------------------------------------------------------------------ queries
    def queue(self, path: Path) -> SenderQueue:
        """The queue a message on ``path`` waits in (created on first use, with its own policy)."""
        name = path.resources[0].name  # the sending resource, ``path.sender`` without the property call
        q = self.queues.get(name)
        if q is None:
            q = self.queues[name] = self._new_queue(name)
        return q

    def _new_queue(self, name: str) -> SenderQueue:
        return SenderQueue(name, self.make_policy())

    @property
    def idle(self) -> bool:
        self._fresh()
        return not self._wire

    def next_event_s(self) -> float | None:
        """When the first send on the wire finishes (None: nothing on the wire)."""
        self._fresh()
        if not self._wire:
            return None
        dt = min((s.left / r if r > 0 else math.inf) for s, r in zip(self._wire, self._rates))
        return self._since + max(dt, 0.0) if math.isfinite(dt) else None

    # ------------------------------------------------------------------ actions
    def put(self, mid: Any, kind: TrafficKind, path: Path, nbytes: float, now: float,
            copies: int = 1) -> list[tuple[Any, float]]:
        """Enqueue a message (``copies`` of it: see ``Message``); returns ``(id, deliver_at)`` of
        every message finished by ``now`` (this one too, when it has no bytes: it only pays the
        latency)."""
        q = self._queue_for(mid, kind, path, copies)
        done = self.advance(now)
        q.messages[kind] += copies
        if nbytes <= 0:
            done.append((mid, now + path.latency_s + self.overhead_s))
            return done
        self._settle(now)
        self._enqueue(q, Message(mid, kind, path, nbytes, now, copies), now)
        if not math.isfinite(path.bandwidth):
            self._fresh()  # an unlimited path finishes at once: let the next advance see it
        return done

    def _queue_for(self, mid: Any, kind: TrafficKind, path: Path, copies: int = 1) -> SenderQueue:
        """The queue a new message ``mid`` of ``kind`` joins on ``path``; refuses a kind off the list,
        an id already pending there, or copies its policy would not send together."""
        if kind not in KINDS:
            raise ValueError(f"traffic kind must be one of {KINDS}, got {kind!r}")
        q = self.queue(path)
        if mid in q.pending:
            raise ValueError(f"message {mid} is already pending")
        if copies != 1 and (copies < 1 or not q.sends_all):
            raise ValueError(f"message {mid}: {copies} copies on a {q.policy.name!r} link (only a link whose "
                             "policy sends every pending message at once takes copies, at least 1)")
        return q

    def put_many(self, items: Sequence[tuple], now: float) -> list[tuple[Any, float]]:
        """``put`` of several ``(id, kind, path, bytes)`` or ``(id, kind, path, bytes, copies)``
        messages at one instant (a KV hand-off's parts), with the same state and returns as
        putting them one by one in order.

        A queue whose policy allocates from its pending messages alone (``replan_once``) and that
        would re-decide on each of them (idle, or sharing) re-decides once, after the last: the
        allocation it ends with is the one it would have ended with. Messages done at once (no
        bytes, unlimited path) go through ``put`` one by one."""
        for it in items:
            if it[3] <= 0 or not math.isfinite(it[2].bandwidth):
                return [d for it in items for d in self.put(*it[:4], now, *it[4:])]  # type: ignore[call-arg]
        groups: dict[SenderQueue, list[Message]] = {}
        seen = set()
        for it in items:
            mid, kind, path, nbytes = it[0], it[1], it[2], it[3]
            n = it[4] if len(it) > 4 else 1
            q = self._queue_for(mid, kind, path, n)
            if (q.name, mid) in seen:
                raise ValueError(f"message {mid} is already pending")
            seen.add((q.name, mid))
            msgs = groups.get(q)
            if msgs is None:
                msgs = groups[q] = []
            msgs.append(Message(mid, kind, path, nbytes, now, n))
        # the first put handles what finished by ``now``; after it nothing more does in zero time
        done = self.advance(now)
        self._settle(now)
        for q, msgs in groups.items():
            counts = q.messages
            for m in msgs:
                counts[m.kind] += m.copies
            if q.replan_once and (not q.sends or q.concurrent):
                self._enqueue_all(q, msgs, now)
            else:
                for m in msgs:
                    self._enqueue(q, m, now)
        return done

    def _enqueue(self, q: SenderQueue, msg: Message, now: float) -> None:
        """Queue ``msg`` on ``q``, whose sends are settled up to ``now``."""
        q.pending[msg.id] = msg
        if not q.sends or q.concurrent:
            # idle, or sharing: re-decide now; sequential and busy: the send in flight ends first
            q.replan(now)
        self._stale = True

    def _enqueue_all(self, q: SenderQueue, msgs: list[Message], now: float) -> None:
        """Queue ``msgs`` on ``q`` and re-decide once (``put_many``)."""
        for m in msgs:
            q.pending[m.id] = m
        q.replan(now)
        self._stale = True

    def advance(self, now: float) -> list[tuple[Any, float]]:
        """Handle every send that finished by ``now``; ``(id, deliver_at)`` of finished messages.

        Calling late is fine: events are handled at their own times."""
        done: list[tuple[Any, float]] = []
        if self._stale and now <= self._since:
            return done  # a send started at ``now``: nothing finishes in zero time
        while True:
            t = self.next_event_s()
            if t is None or t > now:
                return done
            done.extend(self._on_event(t))

    # ------------------------------------------------------------------ internals
    def _settle(self, now: float) -> None:
        """Move every send on the wire forward to ``now`` at its current rate."""
        dt = now - self._since
        if dt > 0:
            self._fresh()
        if dt > 0 and self._wire:
            busy = set()
            for s, r, q in zip(self._wire, self._rates, self._queue_of):
                moved = min(s.left, r * dt) if math.isfinite(r) else s.left
                s.left -= moved
                m = s.msg
                m.remaining -= moved
                q.bytes_sent[m.kind] += moved * m.copies
                busy.add(q.name)
            for name in busy:
                self.queues[name].busy_s += dt
        self._since = max(self._since, now)

    def _fresh(self) -> None:
        if self._stale:
            self._stale = False
            self._reshare()

    def _reshare(self) -> None:
        """Max-min fair rates for everything on the wire now."""
        wire, owner = [], []
        for q in self.queues.values():
            for s in q.sends:
                wire.append(s)
                owner.append(q)
        self._wire, self._queue_of = wire, owner
        self._rates = (max_min_rates([s.msg.path.resources for s in wire], self.competing_penalty,
                                     keys=[s.msg.names for s in wire],
                                     weights=[s.msg.copies for s in wire]) if wire else [])

    def _on_event(self, t: float) -> list[tuple[Any, float]]:
        # the sends finishing now end exactly (no float residue from rate × dt)
        ending = {id(s) for s, r in zip(self._wire, self._rates)
                  if (r > 0 and self._since + s.left / r <= t + 1e-12 * max(1.0, abs(t))) or math.isinf(r)}
        self._settle(t)
        for s, q in zip(self._wire, self._queue_of):
            if id(s) in ending and s.left > 0:
                s.msg.remaining -= s.left
                q.bytes_sent[s.msg.kind] += s.left * s.msg.copies
                s.left = 0.0
        done = []
        for q in self.queues.values():
            finished = [s.msg for s in q.sends if s.left <= EPS_BYTES + 1e-12 * s.msg.total]
            if not finished:
                continue
            for m in finished:
                if m.remaining <= EPS_BYTES + 1e-9 * m.total:
                    del q.pending[m.id]
                    done.append((m.id, t + m.path.latency_s + self.overhead_s))
            q.replan(t)
        self._stale = True
        return done
