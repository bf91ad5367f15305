"""Aladdin's re-balancing (Algorithm 2, §4.3): a ledger of each worker's output-length error.

Each worker carries an error (l^e, b^e): requests that outlived their prediction (supplied by the
placement's per-request view), requests that finished early (``finished_early``), and the moves
made so far. After best fit picks worker x, the request moves to the feasible worker y that most
reduces Σ_i |k2·l^e_i + c2·b^e_i| / √(k2² + c2²) — the distance of each worker's error line
(Eq. 4) from the origin — if any does. Ledger entries expire after ``ttl`` placements.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

from hetserve.cost.fitted import PerformanceModel


class ErrorLedger:
    """Per-worker output-length errors and the re-balancing move they imply."""

    def __init__(self, model_for: Callable[[str], PerformanceModel], ttl: int):
        self.model_for, self.ttl = model_for, int(ttl)
        self._entries: dict[str, list[tuple[int, float, float]]] = {}  # replica -> [(expiry, l, b)]

    def error(self, rid: str, under_l: float, under_b: float, tick: int) -> tuple[float, float]:
        """(l^e, b^e) of worker ``rid`` at placement ``tick``: its outlived requests (``under_*``)
        plus the ledger's live entries (expired ones are dropped here)."""
        entries = [e for e in self._entries.get(rid, ()) if e[0] >= tick]
        self._entries[rid] = entries
        return (under_l + sum(e[1] for e in entries), under_b + sum(e[2] for e in entries))

    def distance(self, rid: str, l_err: float, b_err: float) -> float:
        d = self.model_for(rid).decode
        norm = math.hypot(d.k2, d.c2)
        return abs(d.k2 * l_err + d.c2 * b_err) / norm if norm > 0 else 0.0

    def add(self, rid: str, tick: int, l_err: float, b_err: float) -> None:
        self._entries.setdefault(rid, []).append((tick + self.ttl, l_err, b_err))

    def finished_early(self, rid: str, tick: int, output_tokens: int, predicted: float) -> None:
        """A request on ``rid`` ended before its prediction: the worker was over-estimated
        (Algorithm 2, lines 10–13)."""
        self.add(rid, tick, output_tokens - predicted, -1.0)

    def move(self, x: int, feasible: Sequence[int], ids: Sequence[str], unders: dict[int, tuple[float, float]],
             pred: float, tick: int) -> int:
        """The feasible worker the request should go to instead of best fit's ``x`` (``x`` when no
        move lowers the summed distance); a move is recorded in the ledger."""
        ex = self.error(ids[x], *unders[x], tick)
        base_x = self.distance(ids[x], *ex)
        best, best_gain = x, -1e-12
        for y in feasible:
            if y == x:
                continue
            ey = self.error(ids[y], *unders[y], tick)
            before = base_x + self.distance(ids[y], *ey)
            after = self.distance(ids[x], ex[0] - pred, ex[1] - 1) + self.distance(ids[y], ey[0] + pred, ey[1] + 1)
            if after - before < best_gain:
                best, best_gain = y, after - before
        if best != x:
            self.add(ids[x], tick, -pred, -1.0)
            self.add(ids[best], tick, pred, 1.0)
        return best
