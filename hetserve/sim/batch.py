"""Continuous-batching state of one replica, kept as aggregates so no loop runs per token.

Invariants between events:

* ``size`` rows are running (a request with n choices is n rows, ``sim.choices``); ``context`` is
  the sum of their current context lengths (prompt + tokens generated so far); ``iteration``
  counts decode iterations completed since the replica started;
* every running request sits in ``_finish`` as ``(finish_iteration, rid, final_context, rows)``
  (its rows' context together): it emits its last token when iteration ``finish_iteration`` completes;
* a *segment* is a run of iterations with constant membership, from ``t0`` until the next
  request finishes (``k`` iterations). Iteration ``j`` of the segment (0-based) has context
  ``c0 + j·size`` and takes ``a + slope·j`` seconds, where ``a`` and ``a + slope·(k-1)`` are the
  cost model's ``decode_step_time`` at the first and last iteration (exact when the step time is
  linear in context over the segment, as it is whenever the roofline regime does not change).
  So the segment's iteration boundaries are ``t0 + T(j)``, ``T(j) = j·a + slope·j(j-1)/2``,
  computed and inverted in O(1).
"""

from __future__ import annotations

import heapq
import math
from typing import Callable


class DecodeBatch:
    __slots__ = ("size", "context", "iteration", "_finish", "members", "rows", "_step",
                 "t0", "c0", "a", "slope", "k", "active", "join_sum", "_asked")

    def __init__(self, step_time: Callable[[int, float], float]):
        self._step = step_time  # (batch size, total context) -> seconds per iteration
        self.size = 0
        self.context = 0.0
        self.iteration = 0
        self._finish: list[tuple[int, int, int, int]] = []
        self.members: dict[int, int] = {}  # rid -> iteration at which it joined
        self.rows: dict[int, int] = {}  # rid -> the rows it decodes (its choices)
        self.t0 = self.c0 = self.a = self.slope = 0.0
        self.k = 0
        self.active = False
        self.join_sum = 0  # Σ join iteration over running rows
        # the last ``boundary_at_or_after`` answer of this segment, (now, j): a snapshot asks for the
        # same instant several times (tokens made, context, the wait for the boundary)
        self._asked: tuple[float, int] | None = None

    # ------------------------------------------------------------------ membership
    def add(self, rid: int, context: int, iterations: int, final_context: int, rows: int = 1) -> None:
        """A request joins with ``rows`` rows of ``context`` tokens each and needs ``iterations`` (≥ 1)
        more iterations, ending with ``final_context`` tokens a row."""
        heapq.heappush(self._finish, (self.iteration + iterations, rid, final_context * rows, rows))
        self.members[rid] = self.iteration
        self.rows[rid] = rows
        self.join_sum += self.iteration * rows
        self.size += rows
        self.context += context * rows

    def remove(self, rid: int, context: float) -> None:
        """Take a running request out between segments (pre-emption); ``context``: what its rows hold now."""
        assert not self.active, "remove only at an iteration boundary"
        rows = self.rows.pop(rid)
        self.join_sum -= self.members.pop(rid) * rows
        self.size -= rows
        self.context = self.context - context if self.size else 0.0
        self._finish = [e for e in self._finish if e[1] != rid]
        heapq.heapify(self._finish)

    def advance(self, j: int) -> list[int]:
        """Complete ``j`` iterations of the current segment; return the requests that finished."""
        self.iteration += j
        self.context += j * self.size
        done = []
        fin = self._finish
        while fin and fin[0][0] <= self.iteration:
            _, rid, final, rows = heapq.heappop(fin)
            self.size -= rows
            self.context -= final
            self.join_sum -= self.members.pop(rid) * rows
            del self.rows[rid]
            done.append(rid)
        if self.size == 0:
            self.context = 0.0  # no drift left behind
        self.active = False
        return done

    # ------------------------------------------------------------------ segments
    def start(self, now: float, limit: int | None = None) -> float:
        """Begin a segment at ``now``; return the time its first finishing request is done (or its
        ``limit``-th iteration ends, if sooner)."""
        assert self.size > 0, "no segment without running requests"
        self.k = self._finish[0][0] - self.iteration
        if limit is not None and 1 <= limit < self.k:
            self.k = limit
        self.t0, self.c0 = now, self.context
        self._asked = None
        self.a = self._step(self.size, self.context)
        if self.k > 1:
            last = self._step(self.size, self.context + (self.k - 1) * self.size)
            self.slope = (last - self.a) / (self.k - 1)
        else:
            self.slope = 0.0
        self.active = True
        return now + self.elapsed(self.k)

    def shortest_iteration(self) -> float:
        """Seconds of the segment's shortest iteration: its first or its last (they change linearly)."""
        last = self.a + self.slope * (self.k - 1)
        return last if last < self.a else self.a

    def elapsed(self, j: int) -> float:
        """Seconds from the segment start to the end of its ``j``-th iteration."""
        return j * self.a + self.slope * j * (j - 1) / 2.0

    def boundary_at_or_after(self, now: float) -> int:
        """Smallest j ≤ k whose iteration boundary is at or after ``now``."""
        asked = self._asked
        if asked is not None and asked[0] == now:
            return asked[1]
        dt = now - self.t0
        if dt <= 0:
            return 0
        k, a, s = self.k, self.a, self.slope
        e = dt - 1e-12 * (now if now > 1.0 else 1.0)
        # the last answer of this segment bounds a later one from below (boundaries only move on):
        # a few steps on from it, else the root of ``elapsed``; either corrected against ``elapsed``
        # (written out: asked at every snapshot)
        j = asked[1] if asked is not None and asked[0] < now else -1
        if j >= 0:
            stop = j + 4
            while j < k and j * a + s * j * (j - 1) / 2.0 < e:
                j += 1
                if j == stop:
                    j = -1
                    break
        if j < 0:
            j = math.ceil(self._solve(dt))
            if j < 0:
                j = 0
            elif j > k:
                j = k
        while j > 0 and (j - 1) * a + s * (j - 1) * (j - 2) / 2.0 >= e:
            j -= 1
        while j < k and j * a + s * j * (j - 1) / 2.0 < e:
            j += 1
        self._asked = (now, j)
        return j

    def iterations_done(self, now: float) -> int:
        """Iterations of the current segment completed by ``now`` (0 when inactive)."""
        if not self.active:
            return 0
        j = self.boundary_at_or_after(now)
        return j if self.elapsed(j) <= now - self.t0 + 1e-12 else j - 1

    def progress(self, now: float) -> tuple[int, float]:
        """(``iterations_done(now)``, the time the iteration after those ends) of an active segment."""
        j = self.boundary_at_or_after(now)
        a, s = self.a, self.slope
        done = j if j * a + s * j * (j - 1) / 2.0 <= now - self.t0 + 1e-12 else j - 1
        j = done + 1
        return done, self.t0 + (j * a + s * j * (j - 1) / 2.0)

    def _solve(self, dt: float) -> float:
        """Real root of slope/2·j² + (a − slope/2)·j = dt."""
        a, s = self.a, self.slope
        if s <= 1e-18 * max(a, 1e-30):
            return dt / a if a > 0 else 0.0
        p = a - s / 2.0
        return (-p + math.sqrt(p * p + 2.0 * s * dt)) / s

    def generated_after(self, done: int) -> int:
        """``generated`` once ``done`` iterations of the current segment have completed."""
        return self.size * (self.iteration + done + 1) - self.join_sum

    def context_after(self, done: int) -> int:
        """Σ context tokens of the running requests once ``done`` iterations of the segment have completed."""
        return int(self.context + done * self.size)

    @property
    def next_finish_iteration(self) -> int | None:
        return self._finish[0][0] if self._finish else None
