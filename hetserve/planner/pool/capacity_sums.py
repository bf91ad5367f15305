"""The capacity bound of a pool layout, min(Σ prefill, Σ decode) + Σ colocated over its groups of
positive capacity (requests per T), for ``Evaluator`` and ``BoundedChoice``.

Each sum is read correctly rounded (what the exact sum rounds to, ``math.fsum``), so the bound
does not depend on the order of the groups. A search step bounds hundreds of candidates that
differ from one pool layout in a few groups (``PoolLayout.edited``): ``CapacitySums`` holds that
layout's sums exactly, as integers in units of the smallest float (2⁻¹⁰⁷⁴), and a candidate's are
them less the groups it dropped plus those it added — rounded, the very floats a new sum over all
its groups gives, at the cost of its changes alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable

_UNIT = 1 << 1074  # every finite float times this is an integer
ROLES = ("prefill", "decode", "colocated")


def _exact(x: float) -> int:
    """``x`` in units of 2⁻¹⁰⁷⁴, exactly."""
    num, den = x.as_integer_ratio()
    return num * (_UNIT // den)


def _bound(pre: float, dec: float, col: float, n_pre: int, n_dec: int) -> float:
    """The one formula: no flow without groups on both sides; colocated groups serve alone."""
    return (min(pre, dec) if n_pre and n_dec else 0.0) + col


def bound_requests(roles_caps: Iterable[tuple[str, float]]) -> float:
    """The capacity bound (requests per T) of groups given as (role, capacity) pairs."""
    caps: dict[str, list[float]] = {r: [] for r in ROLES}
    for role, cap in roles_caps:
        if cap > 0:
            caps[role].append(cap)
    pre, dec = caps["prefill"], caps["decode"]
    return _bound(math.fsum(pre), math.fsum(dec), math.fsum(caps["colocated"]), len(pre), len(dec))


@dataclass
class CapacitySums:
    """Exact per-role sums of a pool layout's positive capacities, updatable group by group."""

    totals: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ROLES, 0))  # Σ finite cap, in 2⁻¹⁰⁷⁴
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ROLES, 0))  # groups summed
    infinite: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ROLES, 0))  # of them, cap = inf

    @staticmethod
    def of(roles_caps: Iterable[tuple[str, float]]) -> "CapacitySums":
        out = CapacitySums()
        out._add(roles_caps, 1)
        return out

    def edited(self, dropped: Iterable[tuple[str, float]], added: Iterable[tuple[str, float]]) -> "CapacitySums":
        """These sums without the ``dropped`` groups' capacities and with the ``added`` ones'."""
        out = CapacitySums(dict(self.totals), dict(self.counts), dict(self.infinite))
        out._add(dropped, -1)
        out._add(added, 1)
        return out

    def _add(self, roles_caps: Iterable[tuple[str, float]], sign: int) -> None:
        totals, counts = self.totals, self.counts
        for role, cap in roles_caps:
            if cap > 0:
                counts[role] += sign
                if cap == math.inf:
                    self.infinite[role] += sign
                else:
                    totals[role] += sign * _exact(cap)

    def _sum(self, role: str) -> float:
        return math.inf if self.infinite[role] else self.totals[role] / _UNIT

    def requests(self) -> float:
        """``bound_requests`` of the groups summed, from the exact sums."""
        n = self.counts
        return _bound(self._sum("prefill"), self._sum("decode"), self._sum("colocated"), n["prefill"], n["decode"])
