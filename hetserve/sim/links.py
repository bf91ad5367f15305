"""The simulator's driver of the one link model (``hetserve.policies.links``) in simulated time.

``Network.send`` puts a transfer's parts on the model (each part a message along its device
pair's ``Cluster.path``: NIC out, site pipe, NIC in, or a private in-box link), arms one event
at the model's next send completion, and schedules each message's delivery at the time the model
gives (last byte + path latency). The allocation and sharing semantics are the model's: read its
docstring. The runtime's ``--shape-links`` drives the same model with wall time.

A ``Transfer`` is one logical message split over several device pairs (a KV hand-off goes from
every prefill TP shard to the decode shards holding its heads and layers); it completes when its
last part is delivered.
"""

from __future__ import annotations

import heapq
import math
from typing import Any, Callable

from hetserve.cost.network import capacities, class_rates
from hetserve.policies.base import TrafficKind, TransmissionPolicy
from hetserve.policies.links import EPS_BYTES, LinkModel, Message, SenderQueue
from hetserve.sim.events import EventLoop, Priority
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
        for (d, e), nbytes in merged.items():
            p, together = self._route(d, e)
            key = (p.names, nbytes) if together else (d, e)
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
        self._arm()
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

    def _arm(self) -> None:
        self._version += 1
        t = self.model.next_event_s()
        if t is not None:
            self.loop.schedule(max(t, self.loop.now), Priority.LINK, self._on_event, self._version)

    def _on_event(self, version: int) -> None:
        if version != self._version:
            return
        self._deliver_at(self.model.advance(self.loop.now))
        self._arm()


def _deliver(transfer: Transfer) -> None:
    transfer.on_done(transfer.start_s)


_FILLED_MAX = 1 << 16  # cached water fillings kept per network (a component's few shapes recur)


class _QueueState:
    """Per-queue bookkeeping of ``SharedLinks``: the rates of the queue's sends (aligned with
    ``SenderQueue.sends``), the time they were settled to, an epoch that invalidates old heap
    entries, and the resource keys the sends cross (with multiplicity)."""

    __slots__ = ("order", "since", "rates", "epoch", "keys")

    def __init__(self, order: int):
        self.order, self.since, self.rates, self.epoch = order, 0.0, [], 0
        self.keys: dict = {}


class SharedLinks(LinkModel):
    """``LinkModel`` with the same sharing rule, re-shared only where a send started or ended.

    Max-min rates of one connected component of sends (sends joined by a common resource) do not
    depend on sends outside it, so when a queue's sends change only the component of the
    resources its old and new sends cross is re-shared; every other send keeps its rate and its
    finish time. Each queue is settled (bytes moved at its rates) lazily, when its rates change or
    it is re-planned; each queue's first finish time sits in a heap, stale entries skipped by the
    queue's epoch.
    Running time per event: O(sends in the touched component × path length + log heap), not
    O(all sends on the wire). Figures equal ``LinkModel``'s up to float rounding of the bytes
    moved (settled once per rate change instead of at every event of the network).
    """

    def __init__(self, make_policy: Callable[[], TransmissionPolicy], overhead_s: float = 0.0,
                 competing_penalty: float = 0.0):
        super().__init__(make_policy, overhead_s, competing_penalty)
        self._state: dict[str, _QueueState] = {}
        self._on_res: dict = {}  # resource key -> {queue name: sends crossing it}
        self._touched: set = set()  # resource keys whose sends changed since the last re-share
        self._heap: list = []  # (first finish s of the queue, seq, queue name, epoch)
        self._seq = 0
        self._busy: set[str] = set()  # queues with sends on the wire
        self._filled: dict[tuple, list[float]] = {}  # class signature -> max-min rate per class

    def queue(self, path: Path) -> SenderQueue:
        q = super().queue(path)
        if q.name not in self._state:
            self._state[q.name] = _QueueState(len(self._state))
        return q

    @property
    def idle(self) -> bool:
        self._fresh()
        return not self._busy

    def next_event_s(self) -> float | None:
        self._fresh()
        heap = self._heap
        while heap:
            t, _, name, epoch = heap[0]
            if self._state[name].epoch == epoch:
                return max(t, self._since) if math.isfinite(t) else None
            heapq.heappop(heap)
        return None

    # ------------------------------------------------------------------ internals
    def _settle(self, now: float) -> None:
        """Only the clock moves; queues are settled when their rates change. Rates go stale on
        every start and end but are re-shared once, before time moves on (a KV hand-off puts
        one message per TP shard / layer piece at one instant)."""
        if now > self._since:
            self._fresh()
        self._since = max(self._since, now)

    def _settle_queue(self, q: SenderQueue, now: float) -> None:
        st = self._state[q.name]
        dt = now - st.since
        if dt > 0 and q.sends:
            for s, r in zip(q.sends, st.rates):
                moved = min(s[1], r * dt) if math.isfinite(r) else s[1]
                s[1] -= moved
                s[0].remaining -= moved
                q.bytes_sent[s[0].kind] += moved * s[0].copies
            q.busy_s += dt
        st.since = max(st.since, now)

    def _rekey(self, q: SenderQueue) -> None:
        """Move ``q``'s entries in the resource index to its current sends; mark both touched."""
        st = self._state[q.name]
        for k in st.keys:
            users = self._on_res[k]
            del users[q.name]
            if not users:
                del self._on_res[k]
            self._touched.add(k)
        keys: dict = {}
        for s in q.sends:
            for k in s[0].path.names:
                keys[k] = keys.get(k, 0) + 1
        for k, n in keys.items():
            self._on_res.setdefault(k, {})[q.name] = n
            self._touched.add(k)
        st.keys = keys
        st.rates = []
        st.epoch += 1
        if q.sends:
            self._busy.add(q.name)
        else:
            self._busy.discard(q.name)
        self._stale = True

    def _replan(self, q: SenderQueue, now: float) -> None:
        self._settle_queue(q, now)
        q.replan(now)
        self._rekey(q)

    def _fresh(self) -> None:
        if not self._stale:
            return
        self._stale = False
        # the component: every queue reachable from the touched resources through shared resources
        seen_k, seen_q, todo = set(self._touched), set(), list(self._touched)
        self._touched = set()
        while todo:
            for name in self._on_res.get(todo.pop(), ()):
                if name not in seen_q:
                    seen_q.add(name)
                    for k in self._state[name].keys:
                        if k not in seen_k:
                            seen_k.add(k)
                            todo.append(k)
        # flows in the order ``LinkModel`` flattens them (queue creation order), so the water
        # filling visits resources and subtracts shares in the same order
        state = self._state
        qs = [self.queues[n] for n in sorted(seen_q, key=lambda n: state[n].order)]
        rate_of = self._rates_of(qs)
        now = self._since
        for q in qs:
            st = state[q.name]
            if st.since < now:
                self._settle_queue(q, now)
            st.rates = [rate_of[s[0].path.names] for s in q.sends]
            st.epoch += 1
            self._push(q, st)

    def _rates_of(self, qs: list[SenderQueue]) -> dict[tuple, float]:
        """Max-min rate by path (resource names) of the sends of ``qs``, each copy a flow; the
        water filling is cached by the classes' signature (paths and counts in order of first
        appearance, as ``max_min_rates`` orders them), all it depends on in one network."""
        counts: dict[tuple, int] = {}
        path_of: dict[tuple, tuple] = {}  # path -> its resources
        for q in qs:
            for s in q.sends:
                m = s[0]
                key = m.path.names
                n = counts.get(key)
                if n is None:
                    counts[key] = m.copies
                    path_of[key] = m.path.resources
                else:
                    counts[key] = n + m.copies
        members, count = tuple(counts), tuple(counts.values())
        rate = self._filled.get((members, count))
        if rate is None:
            if len(self._filled) >= _FILLED_MAX:
                self._filled.clear()
            rate = self._filled[(members, count)] = class_rates(members, count, capacities(members, path_of),
                                                                self.competing_penalty)
        return dict(zip(members, rate))

    def _finish_times(self, q: SenderQueue, st: _QueueState) -> list[float]:
        return [st.since + (s[1] / r if r > 0 else math.inf) if math.isfinite(r) else st.since
                for s, r in zip(q.sends, st.rates)]

    def _push(self, q: SenderQueue, st: _QueueState) -> None:
        """One heap entry per queue: when its first send finishes at its current rates."""
        if q.sends:
            self._seq += 1
            heapq.heappush(self._heap, (min(self._finish_times(q, st)), self._seq, q.name, st.epoch))

    def _on_event(self, t: float) -> list[tuple[Any, float]]:
        tol = t + 1e-12 * max(1.0, abs(t))
        heap, names = self._heap, []
        while heap and heap[0][0] <= tol:
            _, _, name, epoch = heapq.heappop(heap)
            if self._state[name].epoch == epoch:
                names.append(name)
        self._since = max(self._since, t)
        done = []
        for name in sorted(names, key=lambda n: self._state[n].order):
            q, st = self.queues[name], self._state[name]
            fin = self._finish_times(q, st)
            ending = [s for s, f in zip(q.sends, fin) if f <= tol] or [q.sends[fin.index(min(fin))]]
            self._settle_queue(q, t)
            for s in ending:
                if s[1] > 0:  # the sends finishing now end exactly (no float residue from rate × dt)
                    s[0].remaining -= s[1]
                    q.bytes_sent[s[0].kind] += s[1] * s[0].copies
                    s[1] = 0.0
            finished = [s for s in q.sends if s[1] <= EPS_BYTES + 1e-12 * s[0].total]
            for m, _ in finished:
                if m.remaining <= EPS_BYTES + 1e-9 * m.total:
                    del q.pending[m.id]
                    done.append((m.id, t + m.path.latency_s + self.overhead_s))
            self._replan(q, t)
        return done

    def _enqueue(self, q: SenderQueue, msg: Message, now: float) -> None:
        """Queue ``msg`` with ``q``'s bytes caught up first, and re-share only what ``q`` touches."""
        self._settle_queue(q, now)
        q.pending[msg.id] = msg
        if not q.sends or q.concurrent:
            # idle, or sharing: re-decide now; sequential and busy: the send in flight ends first
            self._replan(q, now)

    def _enqueue_all(self, q: SenderQueue, msgs: list[Message], now: float) -> None:
        """Queue ``msgs`` and re-decide once; the index and the re-share see ``q``'s old sends and
        its final ones, as after re-deciding per message (its sends only grew in between)."""
        self._settle_queue(q, now)
        for m in msgs:
            q.pending[m.id] = m
        self._replan(q, now)
