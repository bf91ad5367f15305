"""``Replica``: what every simulated replica keeps — identity, KV accounting, busy time."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Callable

from hetserve.cost.layout import ReplicaLayout
from hetserve.planner.plan import PlanReplica
from hetserve.policies.base import ReplicaState, RunningRequest
from hetserve.sim.env import ReplicaEnv
from hetserve.sim.hosts import computing_tp
from hetserve.sim.replicas.clock import ReplicaClock


class LazyRequests(Sequence):
    """A snapshot's per-request views, built on first access. A policy that decides on the
    snapshot's totals (Aladdin's screen rules out an overloaded worker in O(1)) never pays for
    the views of a long queue, which keeps a simulation linear in requests under overload.

    The views describe the moment of the decision: built later (after the event loop has moved
    on) they would describe another moment, so that raises. A policy that keeps a snapshot past
    its decision copies the views (``tuple(state.requests)``) while deciding."""

    __slots__ = ("_build", "_items", "_loop", "_stamp")

    def __init__(self, build: Callable[[], tuple[RunningRequest, ...]], loop):
        self._build = build
        self._items: tuple[RunningRequest, ...] | None = None
        self._loop, self._stamp = loop, loop.events

    def _get(self) -> tuple[RunningRequest, ...]:
        if self._items is None:
            if self._loop.events != self._stamp:
                raise RuntimeError("a snapshot's request views were first read after its decision; "
                                   "copy them (tuple(state.requests)) while deciding")
            self._items = tuple(self._build())
        return self._items

    def __getitem__(self, i):
        return self._get()[i]

    def __len__(self) -> int:
        return len(self._get())

    def __iter__(self):
        return iter(self._get())


class Replica:
    def __init__(self, env: ReplicaEnv, index: int, spec: PlanReplica, layout: ReplicaLayout):
        self.env, self.loop, self.cost, self.req = env, ReplicaClock(env.loop), env.cost, env.req
        self.limits = env.limits
        self.index, self.id, self.role, self.layout = index, spec.id, spec.role, layout
        self.kv_capacity = float(self.cost.kv_capacity_tokens(layout))
        self.kv_used = 0.0
        self.kv_peak = 0.0
        self._kv_area = 0.0
        self._kv_t = 0.0
        self.busy_s = 0.0
        self._busy_until = 0.0
        self.served = 0
        self.capacity_norm = 1.0
        self._computing_tp: float | None = None
        self.host: str | None = None  # the CPU host it shares (``HostContention``)

    # ------------------------------------------------------------------ bookkeeping
    def kv_add(self, tokens: float) -> None:
        now = self.loop.now
        self._kv_area += self.kv_used * (now - self._kv_t)
        self._kv_t = now
        self.kv_used += tokens
        if self.kv_used > self.kv_peak:
            self.kv_peak = self.kv_used

    def _busy(self, start: float, end: float) -> None:
        """Add [start, end) to the busy time (intervals may overlap; their union counts)."""
        lo = start if start > self._busy_until else self._busy_until
        if end > lo:
            self.busy_s += end - lo
        if end > self._busy_until:
            self._busy_until = end

    def kv_mean(self, end: float) -> float:
        area = self._kv_area + self.kv_used * max(0.0, end - self._kv_t)
        return area / end if end > 0 else 0.0

    def can_hold(self, used: float, tokens: float) -> bool:
        # A request larger than the whole pool still runs once the pool is empty (never dropped).
        return used + tokens <= self.kv_capacity or used <= 0

    def busy_now(self) -> bool:
        """Whether the replica is computing now (for host contention)."""
        return self._busy_until > self.loop.now

    def reprice(self) -> None:
        """A neighbour on this host started or ended work (``sim.hosts``): re-price what runs here
        from its next step, where that can change. Default: nothing (a step is priced when it starts)."""

    def inflight(self) -> int:
        """Sequences (micro-batches) it has in flight now: how many of its stages can be busy at
        once (``sim.hosts.busy_workers``)."""
        return 1

    def computing_tp(self) -> float:
        """The TP of the stage a lone micro-batch of this replica computes on, time-weighted
        (``sim.hosts.computing_tp``; one cost-model pass, kept)."""
        if self._computing_tp is None:
            self._computing_tp = computing_tp(self.cost, self.layout)
        return self._computing_tp

    def step_rate(self) -> tuple[float, float]:
        """(steps, output tokens) per second it runs now: the front end's work (``sim.hosts``)."""
        return 0.0, 0.0

    def pending_step_rate(self) -> tuple[float, float]:
        """``step_rate`` of the work it is about to start (``sim.hosts``: priced before it runs).
        Default: the rate now."""
        return self.step_rate()

    def state(self, with_requests: bool = False, waits: bool = True) -> ReplicaState:  # pragma: no cover
        """The replica now (``with_requests``: its per-request views too); ``waits`` False: the
        reader ignores ``prefill_wait_s`` / ``queued_age_s``, which may be left 0."""
        raise NotImplementedError

    # A kind whose state changes only in its own events and in the simulator's calls into it (which
    # touch it) lets ``SnapshotCache`` keep its snapshot between decisions, asking ``snapshot_clock``.
    snapshots_kept = False

    def snapshot(self, waits: bool) -> ReplicaState:
        """The aggregates a placement decision reads (no request views); ``waits``: with the waits."""
        return self.state(False, waits)

    def deferred_load(self, waits: bool) -> int:
        """(A kept kind) its snapshot's load (``ReplicaState.load``) where the snapshot itself may be
        built later, when read, the replica unchanged since: a changed replica no policy reads then
        costs little (``SnapshotCache``); -1: ``snapshot`` builds it now."""
        return -1

    def live_figures(self) -> tuple[float, tuple[float, float, float] | None,
                                    Callable[[float], tuple[tuple[float, int], float]]]:
        """(A kind with ``deferred_load``) what its snapshot's outstanding tokens would read: its
        ``outstanding_floor`` and ``outstanding_drain``, and a function of the clock giving
        ``(outstanding tokens, context)`` then and the time until which they hold."""
        raise NotImplementedError

    def snapshot_clock(self, waits: bool = True):
        """How this replica's snapshot depends on the clock now: ``KEEP`` (not at all), a function
        ``(snapshot) -> snapshot`` bringing a kept one up to now, or None (build it again).
        ``waits`` False: the reader ignores ``prefill_wait_s`` / ``queued_age_s``."""
        return None
