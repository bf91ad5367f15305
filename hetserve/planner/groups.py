"""A placement's groups: devices (sorted indices) that serve one replica in a role."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable


@dataclass(frozen=True, order=True)
class Group:
    """Devices (sorted indices) that together serve one replica in ``role``."""

    devices: tuple[int, ...]
    role: str

    @staticmethod
    def of(devices: Iterable[int], role: str) -> "Group":
        return Group(tuple(sorted(devices)), role)


def canonical(groups: Iterable[Group]) -> tuple[Group, ...]:
    """Placements compare equal whatever the order of their groups."""
    return tuple(sorted(g for g in groups if g.devices))
