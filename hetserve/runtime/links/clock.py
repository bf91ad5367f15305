"""The wall-clock driver of the one link model (``hetserve.policies.links``) for ``--shape-links``.

``WallClockLinks`` feeds each message to the model along its path of shared resources and calls its
``deliver()`` when the model says it lands, on a thread of its own (or on ``poll`` in tests);
``LinkSchedule`` is the model for one private link with an explicit clock (unit tests);
``DecodeArrivalPredictor`` is a queue's decode hint when the engine reports no decode timings. The socket
side, the per-pair handles and the counters live in ``hetserve.runtime.links.network``.
"""

from __future__ import annotations

import collections
import math
import threading
import time
from typing import Callable

from hetserve.policies.base import DecodeTiming, TrafficKind, TransmissionPolicy
from hetserve.policies.links import LinkModel
from hetserve.specs.network import Path, pair_path


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


# ----------------------------------------------------------------------------- one private pair


def private_path(latency_s: float, bandwidth: float) -> Path:
    if bandwidth <= 0:
        raise ValueError(f"bandwidth must be positive, got {bandwidth}")
    if latency_s < 0:
        raise ValueError(f"latency must be non-negative, got {latency_s}")
    return pair_path("src", "dst", float(latency_s), float(bandwidth))


class LinkSchedule:
    """The link model (``hetserve.policies.links``) for one private link, with an explicit clock:
    the caller passes ``now`` to every method (tests, and anything that wants exact times).

    ``decode_timing()`` / ``next_decode_in(now)``: the sender's decode timings and the predicted
    time to its next decode message, for MoLink's chunk sizing.
    """

    def __init__(self, latency_s: float, bandwidth: float, policy: TransmissionPolicy,
                 decode_timing: Callable[[], DecodeTiming | None] | None = None,
                 next_decode_in: Callable[[float], float | None] | None = None):
        self.path = private_path(latency_s, bandwidth)
        self.latency_s, self.bandwidth, self.policy = self.path.latency_s, self.path.bandwidth, policy
        self.model = LinkModel(lambda: policy)
        self.queue = self.model.queue(self.path)
        if decode_timing is not None:
            self.queue.decode_timing = lambda now: decode_timing()
        self.queue.decode_hint = next_decode_in

    # counters and state of the one queue
    pending = property(lambda self: self.queue.pending)
    idle = property(lambda self: self.model.idle)
    pending_bytes = property(lambda self: self.queue.pending_bytes)
    busy_s = property(lambda self: self.queue.busy_s)
    bytes_sent = property(lambda self: self.queue.bytes_sent)
    messages = property(lambda self: self.queue.messages)
    queueing_s = property(lambda self: self.queue.queueing_s)

    def next_event_s(self) -> float | None:
        return self.model.next_event_s()

    def put(self, mid: int, kind: TrafficKind, nbytes: float, now: float) -> list[tuple[int, float]]:
        return self.model.put(mid, kind, self.path, nbytes, now)

    def advance(self, now: float) -> list[tuple[int, float]]:
        return self.model.advance(now)


# ----------------------------------------------------------------------------- wall clock


class WallClockLinks:
    """The link model driven in wall time: every link out of one process, shared NICs included.

    A thread sleeps until the model's next send completion or the next message due, and calls each
    message's ``deliver()`` at its delivery time. Messages of one kind on one device pair are
    delivered in the order they were sent (the transport's promise): fair sharing can finish a
    small message before a bigger one of the same kind sent earlier, and the small one then waits.
    Across kinds and pairs the wire decides (decode may overtake prefill). ``deliver`` runs on the
    driver's thread; it must not block for long. An exception in ``deliver`` goes to ``on_error``
    and does not stop the driver. ``thread=False``: no thread; the caller calls ``poll(now)``
    (tests drive it with a fake clock and get exact times). ``predict_decode``: each sending
    queue's decode hint is a ``DecodeArrivalPredictor`` over the decode messages it saw (the
    runtime's stand-in for the simulator's exact decode timings).
    """

    def __init__(self, make_policy: Callable[[], TransmissionPolicy], clock: Callable[[], float] = time.monotonic,
                 decode_timing: Callable[[], DecodeTiming | None] | None = None,
                 on_error: Callable[[BaseException], None] | None = None, thread: bool = True,
                 overhead_s: float = 0.0, competing_penalty: float = 0.0, name: str = "links",
                 predict_decode: bool = True):
        self.model = LinkModel(make_policy, overhead_s, competing_penalty)
        self.predict_decode = predict_decode  # give each queue a DecodeArrivalPredictor as its decode hint
        self.clock = clock
        self._decode_timing = decode_timing
        self._predictors: dict[str, DecodeArrivalPredictor] = {}
        self.errors: list[BaseException] = []
        self._on_error = on_error or self.errors.append
        self._cond = threading.Condition()
        self._deliver: dict[int, Callable[[], None]] = {}
        self._order: dict[tuple, collections.deque[int]] = {}  # (pair, kind) -> ids in send order
        self._arrives: dict[int, float] = {}  # off the wire; lands at this time
        self._next_id = 0
        self._closed = False
        self._thread = None
        if thread:
            self._thread = threading.Thread(target=self._run, name=name, daemon=True)
            self._thread.start()

    def send(self, pair: tuple[str, str], path: Path, nbytes: float, kind: TrafficKind,
             deliver: Callable[[], None]) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError(f"link {pair[0]}->{pair[1]} is closed")
            self._next_id += 1
            mid = self._next_id
            now = self.clock()
            q = self.model.queue(path)
            if q.name not in self._predictors:
                self._predictors[q.name] = DecodeArrivalPredictor()
                if self.predict_decode:
                    q.decode_hint = self._predictors[q.name]
                if self._decode_timing is not None:
                    q.decode_timing = lambda _now: self._decode_timing()
            if kind == "decode":
                self._predictors[q.name].observe(now)
            self._deliver[mid] = deliver
            self._order.setdefault((pair, kind), collections.deque()).append(mid)
            self._arrives.update(self.model.put(mid, kind, path, nbytes, now))
            self._cond.notify()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread; messages still queued are dropped."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def next_wake_s(self) -> float | None:
        """When something next happens: a send ends or a message lands (None: nothing pending)."""
        heads = [self._arrives[q[0]] for q in self._order.values() if q and q[0] in self._arrives]
        wake = [t for t in (self.model.next_event_s(), min(heads) if heads else None) if t is not None]
        return min(wake) if wake else None

    def poll(self, now: float) -> list[tuple[float, Callable[[], None]]]:
        """Advance the model to ``now`` and take every message due: ``(due time, deliver)`` in
        delivery order (the caller calls them, outside any lock)."""
        self._arrives.update(self.model.advance(now))
        ready: list[tuple[float, int]] = []
        for q in self._order.values():
            last = -math.inf
            while q and self._arrives.get(q[0], math.inf) <= now:
                mid = q.popleft()
                last = max(last, self._arrives.pop(mid))  # held back behind an earlier one
                ready.append((last, mid))
        ready.sort()
        return [(t, self._deliver.pop(mid)) for t, mid in ready]

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                now = self.clock()
                calls = self.poll(now)
                if not calls:
                    wake = self.next_wake_s()
                    self._cond.wait(timeout=max(0.0, wake - now) if wake is not None else None)
                    continue
            for _, fn in calls:  # outside the lock: delivering may take a moment
                try:
                    fn()
                except BaseException as exc:  # noqa: BLE001 - reported, the driver keeps running
                    self._on_error(exc)

    def queue_of(self, path: Path):
        with self._cond:
            return self.model.queue(path)
