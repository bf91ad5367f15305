"""The simulator's driver of the one link model (``hetserve.policies.links``) in simulated time.

``Network.send`` puts a transfer's parts on the model (each part a message along its device
pair's ``Cluster.path``: NIC out, site pipe, NIC in, or a private in-box link), arms one event
at the model's next send completion (which also handles each later completion no other event
precedes: the loop is run to its end, never stopped at a time in between), and schedules each
message's delivery at the time the model gives (last byte + path latency). The allocation and sharing semantics are the model's: read its
docstring. The runtime's ``--shape-links`` drives the same model with wall time.

A ``Transfer`` is one logical message split over several device pairs (a KV hand-off goes from
every prefill TP shard to the decode shards holding its heads and layers); it completes when its
last part is delivered.
"""

from __future__ import annotations

from typing import Callable

from hetserve.policies.base import TrafficKind, TransmissionPolicy
from hetserve.policies.links import LinkModel, SenderQueue
from hetserve.sim.events import EventLoop, Priority
from hetserve.sim.sharing import SharedLinks
from hetserve.specs.network import Path, pair_path


class Transfer:
    """A logical message over one or more paths; ``on_done(start_s)`` once every part is delivered."""

    __slots__ = ("kind", "parts_left", "on_done", "start_s", "deliver_s")

    def __init__(self, kind: TrafficKind, on_done: Callable[[float], None], start_s: float):
        self.kind, self.on_done, self.start_s = kind, on_done, start_s
        self.parts_left = 0
        self.deliver_s = start_s  # the latest delivery among the parts whose bytes have left


class Network:
    """The link model of one simulation, driven by its event loop.

    ``paths(src, dst)`` gives a device pair's ``Path`` (``Cluster.path``); without it every pair
    is a private link from the ``latency`` / ``bandwidth`` matrices (no sharing). ``model``: the
    link model class (default ``SharedLinks``)."""

    def __init__(self, latency, bandwidth, make_policy: Callable[[], TransmissionPolicy], loop: EventLoop,
                 paths: Callable[[int, int], Path] | None = None, overhead_s: float = 0.0,
                 competing_penalty: float = 0.0, model: type[LinkModel] | None = None):
        self._lat, self._bw, self.loop = latency, bandwidth, loop
        self._paths = paths
        self._path_cache: dict[tuple[int, int], Path] = {}
        self._routes: dict[tuple[int, int], tuple[Path, bool]] = {}
        # ``SharedLinks`` by default (the same rule, re-shared per component); ``LinkModel`` re-shares all
        self.model = (model or SharedLinks)(make_policy, overhead_s, competing_penalty)
        self.policy_name = getattr(make_policy(), "name", "?")
        self._transfers: dict[int, Transfer] = {}
        self._next_id = 0
        self._version = 0

    @property
    def links(self) -> dict[str, SenderQueue]:
        """The model's queues by sending resource (NIC out or private pair), with their counters."""
        return self.model.queues

    def path(self, src: int, dst: int) -> Path:
        key = (src, dst)
        p = self._path_cache.get(key)
        if p is None:
            p = (self._paths(src, dst) if self._paths is not None
                 else pair_path(str(src), str(dst), float(self._lat[src, dst]), float(self._bw[src, dst])))
            self._path_cache[key] = p
        return p

    def _route(self, src: int, dst: int) -> tuple[Path, bool]:
        """The pair's path and whether its queue takes copies (its policy sends all at once)."""
        key = (src, dst)
        r = self._routes.get(key)
        if r is None:
            p = self.path(src, dst)
            r = self._routes[key] = (p, getattr(self.model.queue(p).policy, "sends_all_pending", False))
        return r

    def link(self, src: int, dst: int) -> SenderQueue:
        """The queue messages from ``src`` to ``dst`` wait in (a pipeline sets its decode timing)."""
        return self.model.queue(self.path(src, dst))

    def send(self, kind: TrafficKind, parts: list[tuple[int, int, float]], on_done: Callable[[float], None]) -> Transfer:
        """Start a transfer of ``(src device, dst device, bytes)`` parts; pairs are merged.

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
        # equal parts on one path of a link that sends everything at once travel as one message
        # with copies: the same flows in the sharing, one record to move, finish and deliver
        parts_of: dict[tuple, list] = {}  # (path, bytes) or (src, dst) -> [path, bytes, copies]
        routes = self._routes
        for pair, nbytes in merged.items():
            p, together = routes.get(pair) or self._route(*pair)
            key = (p.names, nbytes) if together else pair
            part = parts_of.get(key)
            if part is None:
                parts_of[key] = [p, nbytes, 1]
            else:
                part[2] += 1
        t.parts_left = len(parts_of)
        items = []
        for p, nbytes, n in parts_of.values():
            self._next_id += 1
            self._transfers[self._next_id] = t
            items.append((self._next_id, kind, p, nbytes, n))
        self._deliver_at(self.model.put_many(items, now))
        self._arm(self.model.next_event_s())
        return t

    def _deliver_at(self, done: list[tuple[int, float]]) -> None:
        for mid, at in done:
            # a part is delivered a fixed latency after its last byte leaves: the transfer is done
            # at the latest of those, known once its last part has left (one event, not one a part)
            t = self._transfers.pop(mid)
            t.parts_left -= 1
            t.deliver_s = max(t.deliver_s, at)
            if t.parts_left == 0:
                self.loop.schedule(t.deliver_s, Priority.LINK, _deliver, t)

    def _arm(self, t: float | None) -> None:
        """One event at ``t``, the model's next finish (none if None); earlier ones go stale."""
        self._version += 1
        if t is not None:
            self.loop.schedule(max(t, self.loop.now), Priority.LINK, self._on_event, self._version)

    def _on_event(self, version: int) -> None:
        """Handle the model's finishes due now, and then each next one that no other loop event
        precedes (one with an earlier time, or the same time and ``Priority.LINK``: it was
        scheduled before the event ``_arm`` would add): the very calls, in the same order, as one
        event per finish, with one event and one arm."""
        if version != self._version:
            return
        model, loop = self.model, self.loop
        now = loop.now
        while True:
            self._deliver_at(model.advance(now))
            at = model.next_event_s()
            if at is None:
                break
            if at < now:
                at = now
            first = loop.next_at()
            if first is not None and (first[0] < at or (first[0] == at and first[1] <= Priority.LINK)):
                break
            now = at
        self._arm(at)


def _deliver(transfer: Transfer) -> None:
    transfer.on_done(transfer.start_s)
