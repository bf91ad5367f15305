"""``SharedLinks``: the one link model (``hetserve.policies.links``) re-shared only where a send
started or ended; the simulator's network (``sim.links.Network``) drives it in simulated time.

Max-min rates of one connected component of sends (sends joined by a common resource) do not
depend on sends outside it, so when a queue's sends change only the component of the resources
its old and new sends cross is re-shared; every other send keeps its rate and its finish time.
"""

from __future__ import annotations

import heapq
import math
from operator import attrgetter
from typing import Any, Callable

from hetserve.policies.base import TransmissionPolicy
from hetserve.policies.links import EPS_BYTES, LinkModel, Message, SenderQueue, WireSend, fifo_key
from hetserve.sim.fillings import Fillings

_INF = math.inf


class _QueueState:
    """Per-queue bookkeeping of ``SharedLinks`` (``SenderQueue.sharing``): the queue, its creation
    order, the time its sends were settled to (at their ``WireSend.rate``, set when it was last
    re-shared), whether they all have one rate (one flow class), whether it was alone in its
    component when last re-shared, an epoch that invalidates old heap entries; the flows on each
    path (resource names) its sends take, in order of first appearance (its flow classes), and the
    resource keys (of the paths ``paths``) it is indexed under: those its sends cross, or, idle,
    those its last sends crossed."""

    __slots__ = ("q", "order", "since", "one_rate", "alone", "epoch", "classes", "keys", "paths")

    def __init__(self, q: SenderQueue, order: int):
        self.q = q
        self.order = order
        self.since = 0.0
        self.one_rate = False
        self.alone = False
        self.epoch = 0
        self.classes: dict[tuple, int] = {}
        self.keys: set[str] = set()
        self.paths: frozenset[tuple] = frozenset()  # the paths ``keys`` were taken from


_order = attrgetter("order")


def _classes_of(sends: list[WireSend], classes: dict[tuple, int] | None = None) -> dict[tuple, int]:
    """The flows on each path (resource names) of ``sends``, in order of first appearance, added
    to ``classes`` (a new dict if None): a queue's flow classes."""
    if classes is None:
        classes = {}
    for s in sends:
        m = s.msg
        key = m.names
        classes[key] = classes.get(key, 0) + m.copies
    return classes


def _resources_of(sts: list[_QueueState]) -> dict[tuple, tuple]:
    """The resources of each path (by its names) the sends of ``sts``' queues take."""
    path_of: dict[tuple, tuple] = {}
    for st in sts:
        for s in st.q.sends:
            m = s.msg
            if m.names not in path_of:
                path_of[m.names] = m.path.resources
    return path_of


class SharedLinks(LinkModel):
    """``LinkModel`` with the same sharing rule, re-shared only where a send started or ended.

    Each queue is settled (bytes moved at its rates) lazily, when its rates change or it is
    re-planned; each queue's first finish time sits in a heap, stale entries skipped by the
    queue's epoch. Water fillings are cached by the component's shape (``sim.fillings``).
    Running time per event: O(sends in the touched component × path length + log heap), not
    O(all sends on the wire). Figures equal ``LinkModel``'s up to float rounding of the bytes
    moved (settled once per rate change instead of at every event of the network).
    """

    def __init__(self, make_policy: Callable[[], TransmissionPolicy], overhead_s: float = 0.0,
                 competing_penalty: float = 0.0):
        super().__init__(make_policy, overhead_s, competing_penalty)
        self._on_res: dict[str, set[_QueueState]] = {}  # resource key -> the queues indexed under it
        self._touched: set[str] = set()  # resource keys whose sends changed since the last re-share
        self._solo: list[_QueueState] = []  # re-shared alone at the next re-share (see ``_reindex``)
        self._heap: list[tuple[float, int, _QueueState, int]] = []  # (first finish s of the queue, seq, it, epoch)
        self._seq = 0
        self._fillings = Fillings(self.competing_penalty)

    def _new_queue(self, name: str) -> SenderQueue:
        q = super()._new_queue(name)
        q.sharing = _QueueState(q, len(self.queues))
        return q

    @property
    def idle(self) -> bool:
        self._fresh()
        return not any(q.sends for q in self.queues.values())

    def next_event_s(self) -> float | None:
        if self._stale:
            self._fresh()
        heap = self._heap
        while heap:
            top = heap[0]
            if top[2].epoch == top[3]:
                t, since = top[0], self._since
                return (since if since > t else t) if t < _INF else None
            heapq.heappop(heap)
        return None

    # ------------------------------------------------------------------ internals
    def _settle(self, now: float) -> None:
        """Only the clock moves; queues are settled when their rates change. Rates go stale on
        every start and end but are re-shared once, before time moves on (a KV hand-off puts
        one message per TP shard / layer piece at one instant)."""
        if now > self._since:
            self._fresh()
            self._since = now

    @staticmethod
    def _settle_queue(st: _QueueState, now: float) -> None:
        dt = now - st.since
        if dt > 0:
            q = st.q
            if q.sends:
                sent = q.bytes_sent
                for s in q.sends:
                    # an unlimited rate moves all that is left (inf × dt is never below it)
                    left, moved = s.left, s.rate * dt
                    if not moved < left:
                        moved = left
                    s.left = left - moved
                    m = s.msg
                    m.remaining -= moved
                    sent[m.kind] += moved * m.copies
                q.busy_s += dt
            st.since = now

    def _replan(self, st: _QueueState, now: float) -> None:
        """Re-decide the queue's sends (its bytes settled up to ``now``) and re-index them."""
        q = st.q
        q.replan(now)
        self._reindex(st, _classes_of(q.sends))

    def _reindex(self, st: _QueueState, classes: dict[tuple, int]) -> None:
        """The queue's sends changed to ``classes``: mark the resources of its old and new sends
        touched, its rates stale, and index it under the new ones.

        An idle queue stays indexed under the resources it last used (``_fresh`` passes it by):
        it mostly comes back on the same paths, and then its entries are already there.

        A queue alone in its component that keeps to (some of) its paths touches nothing: no other
        send crosses its resources (one that joined since it was re-shared touched them itself),
        so only its own rates change; it is re-shared alone (``_solo``), or not at all once idle."""
        touched = self._touched
        solo = st.alone and len(st.classes) > 0 and classes.keys() <= st.paths
        if solo:
            if classes:
                self._solo.append(st)
        elif st.classes:
            touched.update(st.keys)
        if classes:
            if classes.keys() != st.paths:
                old, new = st.keys, set().union(*classes)
                # a resource keeps its (maybe empty) set of users: queues come and go on it all the time
                on_res = self._on_res
                for k in old - new:
                    on_res[k].discard(st)
                for k in new - old:
                    users = on_res.get(k)
                    if users is None:
                        on_res[k] = {st}
                    else:
                        users.add(st)
                st.keys, st.paths = new, frozenset(classes)
                if not solo:
                    touched.update(new)
            elif not st.classes:
                touched.update(st.keys)
        st.classes = classes
        st.one_rate = False  # its sends' rates are stale until re-shared (before time moves on)
        st.epoch += 1
        self._stale = True

    def _append(self, st: _QueueState, msgs: list[Message], now: float) -> bool:
        """The re-decision of a queue that sends all it holds (``sends_all``) when ``msgs`` come
        after all it sends, oldest first: its sends and theirs (``SenderQueue._send_all`` sorts
        them so; a kept send's bytes left are its message's, as both move together). False, and
        nothing done, when they do not come after."""
        q = st.q
        sends = q.sends
        prev = fifo_key(sends[-1].msg) if sends else None
        for m in msgs:
            key = fifo_key(m)
            if prev is not None and not prev < key:
                return False
            prev = key
        queueing = q.queueing_s
        new = [WireSend(m, m.remaining) for m in msgs]
        classes = _classes_of(new, dict(st.classes))
        sends.extend(new)
        for m in msgs:
            if m.first_byte is None:
                m.first_byte = now
                queueing[m.kind] += (now - m.enqueued) * m.copies
        q.concurrent = True
        self._reindex(st, classes)
        return True

    def _fresh(self) -> None:
        if not self._stale:
            return
        self._stale = False
        # each component: every queue reachable from a touched resource through shared resources.
        # Components are re-shared one by one: a water filling over several gives each the very
        # floats it gets alone (no share crosses from one to another), and one alone recurs more
        touched, on_res, solo = self._touched, self._on_res, self._solo
        seen_q: set[_QueueState] = set()
        if solo:
            self._solo = []
        if not touched:  # only queues alone changed (or went idle): nothing to search
            self._reshare_alone(solo, seen_q)
            return
        self._touched = set()
        seen_k: set[str] = set()
        for k0 in touched:
            if k0 in seen_k:
                continue
            seen_k.add(k0)
            todo, comp = [k0], []
            while todo:
                users = on_res.get(todo.pop())
                if users:
                    for st in users:
                        if st not in seen_q and st.classes:  # an idle queue links nothing
                            seen_q.add(st)
                            comp.append(st)
                            more = st.keys - seen_k
                            if more:
                                seen_k |= more
                                todo.extend(more)
            if comp:
                self._reshare(comp)
        self._reshare_alone(solo, seen_q)

    def _reshare_alone(self, solo: list[_QueueState], seen: set[_QueueState]) -> None:
        """Re-share each queue of ``solo`` as a component of its own, unless a touched resource
        reached it (it is in ``seen``) or it went idle since."""
        for st in solo:
            if st not in seen and st.classes:
                seen.add(st)
                self._reshare([st])

    def _reshare(self, comp: list[_QueueState]) -> None:  # type: ignore[override]
        """New rates, settled bytes and heap entries for the queues of one component."""
        # flows in the order ``LinkModel`` flattens them (queue creation order), so the water
        # filling visits resources and subtracts shares in the same order
        alone = len(comp) == 1
        if not alone:
            comp.sort(key=_order)
        rate_of = self._rates_of(comp)
        now, heap = self._since, self._heap
        for st in comp:
            if st.since < now:
                self._settle_queue(st, now)
            sends = st.q.sends
            st.epoch += 1
            st.alone = alone
            if not sends:
                st.one_rate = False
                continue
            # one heap entry per queue: when its first send finishes at its current rates (the
            # earliest of since + left / rate, found as since + the least left / rate: both
            # operations keep order); each send's finish time is left for its event
            st.one_rate = len(st.classes) == 1
            if st.one_rate:
                r = rate_of[sends[0].msg.names]
                least = _INF
                for s in sends:
                    s.rate = r
                    if s.left < least:
                        least = s.left
                first = (st.since + least / r if r > 0 else _INF) if r < _INF else st.since
            else:
                least = _INF
                for s in sends:
                    s.rate = r = rate_of[s.msg.names]
                    if r < _INF:
                        if r > 0 and s.left / r < least:
                            least = s.left / r
                    else:
                        least = 0.0  # no later send finishes sooner
                first = st.since + least
            self._seq += 1
            heapq.heappush(heap, (first, self._seq, st, st.epoch))

    def _rates_of(self, sts: list[_QueueState]) -> dict[tuple, float]:
        """Max-min rate by path (resource names) of the sends of ``sts``' queues, each copy a flow,
        the paths in order of first appearance (as ``max_min_rates`` orders them)."""
        if len(sts) == 1:
            counts = sts[0].classes
            if len(counts) == 1:  # one class alone: its filling is one division
                (key, n), = counts.items()
                r = self._fillings.alone(sts[0].q.sends[0].msg.path, n)
                if r is not None:
                    return {key: r}
        else:
            counts = {}
            for st in sts:
                for key, n in st.classes.items():
                    counts[key] = counts.get(key, 0) + n
        return self._fillings.rate_of(counts, _resources_of, sts)

    @staticmethod
    def _finish_times(st: _QueueState, inf: float = _INF) -> list[float]:
        since = st.since
        return [since + (s.left / s.rate if s.rate > 0 else inf) if s.rate < inf else since for s in st.q.sends]

    def _on_event(self, t: float) -> list[tuple[Any, float]]:
        tol = t + 1e-12 * max(1.0, abs(t))
        heap = self._heap
        due: list[_QueueState] = []
        while heap and heap[0][0] <= tol:
            _, _, st, epoch = heapq.heappop(heap)
            if st.epoch == epoch:
                due.append(st)
        if t > self._since:
            self._since = t
        if len(due) > 1:
            due.sort(key=_order)
        done: list[tuple[Any, float]] = []
        overhead = self.overhead_s
        for st in due:
            q = st.q
            sends, since = q.sends, st.since
            if st.one_rate:
                r = sends[0].rate
                ending = ([s for s in sends if since + s.left / r <= tol] if r > 0 else []) if r < _INF else sends
            else:
                ending = [s for s, f in zip(sends, self._finish_times(st)) if f <= tol]
            if not ending:
                fin = self._finish_times(st)
                ending = [sends[fin.index(min(fin))]]
            if st.since < t:
                self._settle_queue(st, t)
            sent = q.bytes_sent
            for s in ending:
                if s.left > 0:  # the sends finishing now end exactly (no float residue from rate × dt)
                    m = s.msg
                    m.remaining -= s.left
                    sent[m.kind] += s.left * m.copies
                    s.left = 0.0
            pending, gone = q.pending, 0
            kept: list[WireSend] = []
            for s in sends:
                m = s.msg
                if s.left <= EPS_BYTES + 1e-12 * m.total and m.remaining <= EPS_BYTES + 1e-9 * m.total:
                    del pending[m.id]
                    done.append((m.id, t + m.path.latency_s + overhead))
                    gone += m.copies
                else:
                    kept.append(s)
            if not q.sends_all:
                self._replan(st, t)
                continue
            # its re-decision: the sends still pending, in their order (see ``_append``); one
            # class keeps its path with fewer flows, several are counted again (their order of
            # first appearance may change)
            q.sends = kept
            if kept and st.one_rate:
                (key, n), = st.classes.items()
                self._reindex(st, {key: n - gone})
            else:
                self._reindex(st, _classes_of(kept))
        return done

    def _enqueue(self, q: SenderQueue, msg: Message, now: float) -> None:
        """Queue ``msg`` with ``q``'s bytes caught up first, and re-share only what ``q`` touches."""
        st = q.sharing
        self._settle_queue(st, now)
        q.pending[msg.id] = msg
        if not q.sends or q.concurrent:
            # idle, or sharing: re-decide now; sequential and busy: the send in flight ends first
            self._replan(st, now)

    def _enqueue_all(self, q: SenderQueue, msgs: list[Message], now: float) -> None:
        """Queue ``msgs`` and re-decide once; the index and the re-share see ``q``'s old sends and
        its final ones, as after re-deciding per message (its sends only grew in between)."""
        st = q.sharing
        self._settle_queue(st, now)
        for m in msgs:
            q.pending[m.id] = m
        if not (q.sends_all and self._append(st, msgs, now)):
            self._replan(st, now)
