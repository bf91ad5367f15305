"""Links: one directed device pair, shared by every message that crosses it.

A ``Link`` holds the messages waiting on it and asks its ``TransmissionPolicy`` what to put on
the wire (``hetserve.policies.base``). Allocation semantics:

* ``concurrent=False``: the first send gets the whole link until it is done (a send in flight is
  never pre-empted: a chunk on the wire stays on the wire); then the policy is asked again, so the
  rest of the list is re-decided with whatever arrived meanwhile.
* ``concurrent=True``: the sends share the bandwidth equally (processor sharing). When one send
  finishes, or a new message arrives, the bytes sent so far are settled and the policy is asked
  again.

Timing: a send of ``n`` bytes occupies the link for ``n / β``; a message is delivered ``α`` after
its last byte leaves, so one message alone takes ``α + bytes/β`` = ``CostModel.p2p_time``.
Links are directed device pairs, the granularity of the cluster's α/β matrices and of
``CostModel.kv_transfer_pairs``; two pairs out of one NIC do not share it (as in the cost model).

A ``Transfer`` is one logical message split over several links (a KV hand-off goes from every
prefill TP shard to the decode shards holding its heads and layers); it completes when its last
part is delivered.
"""

from __future__ import annotations

from typing import Callable

from hetserve.policies.base import DecodeTiming, LinkInfo, TrafficKind, TransferView, TransmissionPolicy
from hetserve.policies.transmission import resolve_allocation
from hetserve.sim.events import EventLoop, Priority

_EPS_BYTES = 1e-3


class Transfer:
    """A logical message over one or more links; ``on_done(now)`` once every part is delivered."""

    __slots__ = ("kind", "parts_left", "on_done", "start_s")

    def __init__(self, kind: TrafficKind, on_done: Callable[[float], None], start_s: float):
        self.kind, self.on_done, self.start_s = kind, on_done, start_s
        self.parts_left = 0


class _Message:
    __slots__ = ("id", "transfer", "total", "remaining", "enqueued")

    def __init__(self, mid: int, transfer: Transfer, nbytes: float, now: float):
        self.id, self.transfer = mid, transfer
        self.total = self.remaining = float(nbytes)
        self.enqueued = now


class Link:
    """One directed device pair with its pending messages and its current allocation."""

    def __init__(self, key: tuple[int, int], latency_s: float, bandwidth: float, policy: TransmissionPolicy,
                 loop: EventLoop):
        self.key, self.policy, self.loop = key, policy, loop
        self.info = LinkInfo(latency_s, bandwidth)
        self.pending: dict[int, _Message] = {}
        self._sends: list[tuple[_Message, float]] = []  # (message, bytes of this send left)
        self._concurrent = False
        self._since = 0.0  # when the current allocation's progress was last settled
        self._first = 0.0  # bytes left of the allocation's smallest send
        self._version = 0
        # Set by a pipeline whose stage sends over this link: the sender's decode timings
        # (MoLink's just-in-time chunk sizing) and the predicted time to its next decode message.
        self.decode_timing: Callable[[float], DecodeTiming | None] | None = None
        self.decode_hint: Callable[[float], float | None] | None = None
        self.busy_s = 0.0
        self.bytes_sent = 0.0
        self.messages = 0

    # ------------------------------------------------------------------ queries
    @property
    def idle(self) -> bool:
        return not self._sends

    # ------------------------------------------------------------------ actions
    def put(self, mid: int, transfer: Transfer, nbytes: float) -> None:
        now = self.loop.now
        self.pending[mid] = _Message(mid, transfer, nbytes, now)
        self.messages += 1
        if not self._sends:
            self._replan(now)
        elif self._concurrent:
            self._settle(now)
            self._replan(now)
        # sequential and busy: the send in flight finishes first, then the policy sees the newcomer

    def _settle(self, now: float, share: float | None = None) -> None:
        """Account the bytes each current send has moved since ``_since`` (concurrent sharing).

        ``share``: the exact bytes per send (when the allocation's smallest send has just
        finished); otherwise from the elapsed time, never more than that smallest send.
        """
        n = len(self._sends)
        if n:
            if share is None:
                share = min(self.info.bandwidth * (now - self._since) / n, self._first)
            if share > 0:
                self._sends = [(m, left - share) for m, left in self._sends]
                for m, _ in self._sends:
                    m.remaining -= share
                self.busy_s += share * n / self.info.bandwidth
                self.bytes_sent += share * n
                self._first -= share
        self._since = now

    def _replan(self, now: float) -> None:
        self._version += 1
        self._sends = []
        if not self.pending:
            return
        views = [TransferView(m.id, m.transfer.kind, m.total, max(m.remaining, 0.0), m.enqueued)
                 for m in self.pending.values()]
        hint = self.decode_hint(now) if self.decode_hint is not None else None
        info = self.info
        if self.decode_timing is not None:
            info = LinkInfo(info.latency_s, info.bandwidth, self.decode_timing(now))
        sends, self._concurrent = resolve_allocation(self.policy, self.pending, views, info, now, hint)
        self._sends, self._since = sends, now
        n = len(sends)
        self._first = first = min(left for _, left in sends)
        self.loop.schedule(now + first * n / self.info.bandwidth, Priority.LINK, self._on_send_done, self._version)

    def _on_send_done(self, version: int) -> None:
        if version != self._version:
            return
        now = self.loop.now
        if self._concurrent:
            self._settle(now, self._first)  # exactly the smallest send has finished
        else:
            m, left = self._sends[0]
            dt = left / self.info.bandwidth
            m.remaining -= left
            self.busy_s += dt
            self.bytes_sent += left
            self._sends = [(m, 0.0)]
        for m, left in self._sends:
            if left <= _EPS_BYTES and m.remaining <= _EPS_BYTES + 1e-9 * m.total:
                del self.pending[m.id]
                self.loop.schedule(now + self.info.latency_s, Priority.LINK, _deliver, m.transfer)
        self._replan(now)


def _deliver(transfer: Transfer) -> None:
    transfer.parts_left -= 1
    if transfer.parts_left == 0:
        transfer.on_done(transfer.start_s)


class Network:
    """Creates links on first use (each with its own policy instance) and starts transfers."""

    def __init__(self, latency, bandwidth, make_policy: Callable[[], TransmissionPolicy], loop: EventLoop):
        self._lat, self._bw, self.make_policy, self.loop = latency, bandwidth, make_policy, loop
        self.policy_name = getattr(make_policy(), "name", "?")
        self.links: dict[tuple[int, int], Link] = {}
        self._next_id = 0

    def link(self, src: int, dst: int) -> Link:
        key = (src, dst)
        link = self.links.get(key)
        if link is None:
            link = Link(key, float(self._lat[src, dst]), float(self._bw[src, dst]), self.make_policy(), self.loop)
            self.links[key] = link
        return link

    def send(self, kind: TrafficKind, parts: list[tuple[int, int, float]], on_done: Callable[[float], None]) -> Transfer:
        """Start a transfer of ``(src device, dst device, bytes)`` parts; pairs are merged per link.

        ``on_done(start_s)`` is called when the last part is delivered (at once if there are none).
        """
        now = self.loop.now
        t = Transfer(kind, on_done, now)
        merged: dict[tuple[int, int], float] = {}
        for d, e, nbytes in parts:
            if d != e and nbytes > 0:
                merged[(d, e)] = merged.get((d, e), 0.0) + nbytes
        if not merged:
            self.loop.schedule(now, Priority.LINK, lambda _: on_done(now))
            return t
        t.parts_left = len(merged)
        for (d, e), nbytes in merged.items():
            self._next_id += 1
            self.link(d, e).put(self._next_id, t, nbytes)
        return t

