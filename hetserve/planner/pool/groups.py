"""A pool layout's groups: devices (sorted indices) that serve one replica in a role, and the
canonical pool layout that holds them."""

from __future__ import annotations

from bisect import insort
from typing import Iterable, NamedTuple, Sequence


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


class PoolLayout(tuple):
    """A pool layout in canonical form: its non-empty groups in sorted order (``canonical``).

    It equals, orders and hashes as the plain tuple of its groups; its hash is computed once (a
    search step hashes each of its hundreds of candidates several times: to drop repeats, in the
    score cache, in the visited set, and at thousands of GPUs each hash reads every group).

    ``edited`` makes one from another by dropping and adding a few groups (each placed by
    bisection, the rest kept in order: no sort) and records what it changed: ``parent``, the
    groups ``dropped`` from it and ``added``. What sums over the groups (``Evaluator``'s capacity
    bound) is then the parent's sum updated by those, not a new sum over every group."""

    parent: "PoolLayout | None" = None
    dropped: tuple[Group, ...] = ()
    added: tuple[Group, ...] = ()

    def __hash__(self) -> int:
        h = self.__dict__.get("_hash")
        if h is None:
            h = self.__dict__["_hash"] = tuple.__hash__(self)
        return h

    def __reduce__(self):  # pickled as its groups alone (not the chain of parents)
        return PoolLayout, (tuple(self),)

    def edited(self, drop: Iterable[int], add: Iterable[Group]) -> "PoolLayout":
        """This pool layout without the groups at indices ``drop`` and with the non-empty groups
        of ``add``: what ``canonical`` returns for them, in O(n) moves and no comparisons but the
        bisections."""
        drop = sorted(set(drop), reverse=True)
        groups = list(self)
        dropped = tuple(groups[i] for i in reversed(drop))
        for i in drop:
            del groups[i]
        added = tuple(g for g in add if g.devices)
        for g in added:
            insort(groups, g)
        out = PoolLayout(groups)
        out.parent, out.dropped, out.added = self, dropped, added
        return out


def edit(groups: Sequence[Group], drop: Iterable[int], add: Iterable[Group]) -> PoolLayout:
    """``groups`` without the groups at indices ``drop`` and with those of ``add``, canonical: by
    ``PoolLayout.edited`` (no sort, what it changed recorded) where ``groups`` is one, else sorted."""
    if type(groups) is PoolLayout:
        return groups.edited(drop, add)
    drop = set(drop)
    return canonical([g for i, g in enumerate(groups) if i not in drop] + list(add))


def canonical(groups: Iterable[Group]) -> PoolLayout:
    """Pool layouts compare equal whatever the order of their groups (one already canonical is
    returned as it is)."""
    if type(groups) is PoolLayout:
        return groups
    return PoolLayout(sorted(g for g in groups if g.devices))
