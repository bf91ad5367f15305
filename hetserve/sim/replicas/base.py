"""``Replica``: what every simulated replica keeps — identity, KV accounting, busy time."""

from __future__ import annotations

from hetserve.cost.layout import ReplicaLayout
from hetserve.planner.plan import PlanReplica
from hetserve.policies.base import ReplicaState
from hetserve.sim.env import ReplicaEnv


class Replica:
    def __init__(self, env: ReplicaEnv, index: int, spec: PlanReplica, layout: ReplicaLayout):
        self.env, self.loop, self.cost, self.req = env, env.loop, env.cost, env.req
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

    # ------------------------------------------------------------------ bookkeeping
    def _kv_add(self, tokens: float) -> None:
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

    def _can_hold(self, used: float, tokens: float) -> bool:
        # A request larger than the whole pool still runs once the pool is empty (never dropped).
        return used + tokens <= self.kv_capacity or used <= 0

    def busy_now(self) -> bool:
        """Whether the replica is computing now (for host contention)."""
        return self._busy_until > self.loop.now

    def state(self, with_requests: bool = False) -> ReplicaState:  # pragma: no cover - overridden
        raise NotImplementedError
