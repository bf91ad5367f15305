"""``Replica``: what every simulated replica keeps — identity, KV accounting, busy time; and
``SnapshotCache``: the placement snapshots of many replicas, kept between decisions."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable

from hetserve.cost.layout import ReplicaLayout
from hetserve.planner.plan import PlanReplica
from hetserve.policies.base import ReplicaState, RunningRequest
from hetserve.sim.env import ReplicaEnv
from hetserve.sim.hosts import computing_tp


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


class ReplicaClock:
    """The event loop as one replica uses it: the same clock and queue, and each event the replica
    schedules marks it changed (``watch``) when handled, so ``SnapshotCache`` knows whose snapshot
    to look at again without asking every replica."""

    __slots__ = ("loop", "_dirty", "_key")

    def __init__(self, loop):
        self.loop = loop
        self._dirty: set[int] | None = None
        self._key = 0

    @property
    def now(self) -> float:
        return self.loop.now

    @property
    def events(self) -> int:
        return self.loop.events

    def watch(self, dirty: set[int], key: int) -> None:
        """From now on, each event of this replica adds ``key`` to ``dirty`` before it is handled."""
        self._dirty, self._key = dirty, key

    def schedule(self, time: float, priority: int, handler: Callable[[Any], None], arg: Any = None) -> None:
        self.loop.schedule(time, priority, self._handle, (handler, arg))

    def _handle(self, item: tuple[Callable[[Any], None], Any]) -> None:
        if self._dirty is not None:
            self._dirty.add(self._key)
        item[0](item[1])


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

    def state(self, with_requests: bool = False) -> ReplicaState:  # pragma: no cover - overridden
        raise NotImplementedError


class SnapshotCache:
    """The placement snapshots of ``replicas`` (aggregates only, no request views), each rebuilt
    only where it may differ from the one kept: the replica was changed (one of its own events was
    handled, or the caller ``touch``-ed it after calling into it), or the kept one reads the clock
    (rebuilt at every decision, or, where only a wait moves with the clock, that field re-set). A
    replica whose kind has no rule (``_RULES``) is rebuilt at every decision, so every snapshot
    equals what ``state()`` gives now.

    Sound only where a replica's state changes in its own events or in the caller's calls into it
    (the simulator touches what it calls): the kinds in ``_rules``."""

    def __init__(self, replicas: Sequence[Replica]):
        self._reps = list(replicas)
        self._snaps: list[ReplicaState | None] = [None] * len(self._reps)
        self._pos = {rep.index: i for i, rep in enumerate(self._reps)}
        self._dirty: set[int] = set(range(len(self._reps)))
        # kept snapshots that read the clock -> how to bring one up to now (None: rebuild it)
        self._timed: dict[int, Callable[[Replica, ReplicaState], ReplicaState] | None] = {}
        rules = _rules()
        self._rules = [rules.get(type(rep), _always) for rep in self._reps]
        for i, rep in enumerate(self._reps):
            if type(rep) in rules:
                rep.loop.watch(self._dirty, i)

    def touch(self, rep: Replica) -> None:
        """``rep`` may have changed outside its own events (a call into it)."""
        i = self._pos.get(rep.index)
        if i is not None:
            self._dirty.add(i)

    def states(self) -> list[ReplicaState]:
        """Every replica's snapshot now, in the order given."""
        reps, snaps, rules, timed, dirty = self._reps, self._snaps, self._rules, self._timed, self._dirty
        for i, retime in list(timed.items()):
            if retime is not None and i not in dirty:
                snaps[i] = retime(reps[i], snaps[i])
                how = rules[i](reps[i])
                if how is _KEEP:
                    del timed[i]
                else:
                    timed[i] = how
            else:
                dirty.add(i)
        for i in dirty:
            rep = reps[i]
            snaps[i] = rep.state(False)
            how = rules[i](rep)
            if how is _KEEP:
                timed.pop(i, None)
            else:
                timed[i] = how
        dirty.clear()
        return list(snaps)  # type: ignore[arg-type]


def _KEEP(rep: Replica, snap: ReplicaState) -> ReplicaState:
    """(Marker) the snapshot holds until the replica changes."""
    return snap


def _always(rep: Replica) -> None:
    return None  # a kind without a rule: rebuilt at every decision


def _with_wait(snap: ReplicaState, wait: float) -> ReplicaState:
    """``snap`` with its ``prefill_wait_s`` set (a copy, without a pass through every field)."""
    new = object.__new__(ReplicaState)
    new.__dict__.update(snap.__dict__)
    new.__dict__["prefill_wait_s"] = wait
    return new


def _prefill_retime(rep, snap: ReplicaState) -> ReplicaState:
    return _with_wait(snap, max(0.0, rep._free[0] - rep.loop.now))  # as PrefillReplica.state


def _prefill_rule(rep):
    # the clock enters a prefill snapshot through the oldest prompt's wait (rebuilt) and the wait
    # for its first stage to be free (re-set alone while nothing is queued)
    if rep.queue:
        return None
    return _KEEP if rep._free[0] <= rep.loop.now else _prefill_retime


def _colocated_rule(rep):
    # ... and a colocated one's through its running batch (tokens made, context), a paused step
    # (prefill wait) and the oldest waiting prompt
    b = rep.batch
    return _KEEP if not rep.waiting and not b.size and not b.active and not rep._paused else None


def _rules() -> dict[type, Callable[[Replica], Any]]:
    """Replica kind -> how one's snapshot depends on the clock now: ``_KEEP`` (not at all), a
    function bringing a kept one up to now, or None (rebuild it)."""
    from hetserve.sim.replicas.colocated import ColocatedReplica
    from hetserve.sim.replicas.prefill import PrefillReplica

    return {PrefillReplica: _prefill_rule, ColocatedReplica: _colocated_rule}
