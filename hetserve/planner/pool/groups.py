"""A pool layout's groups: devices (sorted indices) that serve one replica in a role."""

from __future__ import annotations

from typing import Iterable, NamedTuple


class Group(NamedTuple):
    """Devices (sorted indices) that together serve one replica in ``role``.

    A named tuple (it was a frozen, ordered dataclass: the same fields, equality, order and hash
    value): a search sorts and hashes pool layouts of a hundred groups millions of times, and a
    tuple's comparisons run in C where the dataclass's ``__lt__`` was a Python call (at 320 GPUs
    ~4 million of them)."""

    devices: tuple[int, ...]
    role: str

    @staticmethod
    def of(devices: Iterable[int], role: str) -> "Group":
        return Group(tuple(sorted(devices)), role)


def canonical(groups: Iterable[Group]) -> tuple[Group, ...]:
    """Pool layouts compare equal whatever the order of their groups."""
    return tuple(sorted(g for g in groups if g.devices))
