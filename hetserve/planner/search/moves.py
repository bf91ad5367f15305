"""Edits of a pool layout (a tuple of ``Group``s covering every device) used by the refinements.

Each function returns a new canonical pool layout or None when the edit makes no sense (an empty
group, a no-op). Groups that cannot hold a replica keep their devices (idle) so that every device
always belongs to exactly one group: a later move can put it back to work.

* ``move``: one device from group i to group j (HexGen-2's edge swap: the links it brings
  change sides of the cut);
* ``swap``: one device each way between two groups (``swap_parts``: a set of devices each way);
* ``flip``: change a group's role (prefill ↔ decode);
* ``merge`` / ``split``: HexGen §4.3's mutations (split halves each class count: ⌊τ/2⌋, ⌈τ/2⌉).
"""

from __future__ import annotations

import random
from typing import Sequence

from hetserve.planner.context import PlanContext
from hetserve.planner.pool.groups import Group, PoolLayout, edit


def pick_device(ctx: PlanContext, group: Group, cls: int) -> int | None:
    """The device of class ``cls`` in ``group`` that a move takes (the highest index: deterministic)."""
    found = [d for d in group.devices if ctx.class_of[d] == cls]
    return found[-1] if found else None


def _replace(groups: Sequence[Group], changes: dict[int, Group | None], extra: Sequence[Group] = ()) -> PoolLayout:
    """``groups`` with group i replaced by ``changes[i]`` (None: dropped) and the groups ``extra``
    added, canonical (groups without devices dropped)."""
    return edit(groups, changes, [g for g in changes.values() if g is not None] + list(extra))


def move(groups: Sequence[Group], i: int, j: int, device: int) -> PoolLayout | None:
    if i == j or device not in groups[i].devices:
        return None
    src = Group.of((d for d in groups[i].devices if d != device), groups[i].role)
    dst = Group.of(groups[j].devices + (device,), groups[j].role)
    return _replace(groups, {i: src if src.devices else None, j: dst})


def swap(groups: Sequence[Group], i: int, j: int, di: int, dj: int) -> PoolLayout | None:
    return swap_parts(groups, i, j, (di,), (dj,))


def swap_parts(groups: Sequence[Group], i: int, j: int, part_i: Sequence[int], part_j: Sequence[int]) -> PoolLayout | None:
    """Devices ``part_i`` of group i for ``part_j`` of group j (``swap``: one device each)."""
    if i == j:
        return None
    gi = Group.of(tuple(d for d in groups[i].devices if d not in part_i) + tuple(part_j), groups[i].role)
    gj = Group.of(tuple(d for d in groups[j].devices if d not in part_j) + tuple(part_i), groups[j].role)
    return _replace(groups, {i: gi, j: gj})


def flip(groups: Sequence[Group], i: int) -> PoolLayout | None:
    other = {"prefill": "decode", "decode": "prefill"}.get(groups[i].role)
    if other is None:
        return None
    return with_roles(groups, {i: other})


def with_roles(groups: Sequence[Group], roles: dict[int, str]) -> PoolLayout:
    """Group i given the role ``roles[i]``, its devices kept."""
    return _replace(groups, {i: Group(groups[i].devices, role) for i, role in roles.items()})


def merge(groups: Sequence[Group], i: int, j: int, role: str | None = None) -> PoolLayout | None:
    if i == j:
        return None
    g = Group.of(groups[i].devices + groups[j].devices, role or groups[i].role)
    return _replace(groups, {i: g, j: None})


def split_devices(ctx: PlanContext, devices: Sequence[int]) -> tuple[list[int], list[int]]:
    """Halve every class count (⌊τ/2⌋ to the first half, ⌈τ/2⌉ to the second)."""
    by_cls: dict[int, list[int]] = {}
    for d in sorted(devices):
        by_cls.setdefault(ctx.class_of[d], []).append(d)
    a: list[int] = []
    b: list[int] = []
    flip_side = False  # odd counts alternate which half gets the extra device
    for cls in sorted(by_cls):
        ds = by_cls[cls]
        half = len(ds) // 2
        if len(ds) % 2 and flip_side:
            half += 1
        if len(ds) % 2:
            flip_side = not flip_side
        a.extend(ds[:half])
        b.extend(ds[half:])
    return a, b


def split(ctx: PlanContext, groups: Sequence[Group], i: int, roles: tuple[str, str] | None = None) -> PoolLayout | None:
    a, b = split_devices(ctx, groups[i].devices)
    if not a or not b:
        return None
    ra, rb = roles or (groups[i].role, groups[i].role)
    return _replace(groups, {i: None}, (Group.of(a, ra), Group.of(b, rb)))


def random_edit(ctx: PlanContext, groups: Sequence[Group], rng: random.Random, roles=("prefill", "decode")) -> PoolLayout | None:
    """One random move, swap or role flip (the random-swap baseline and restart kicks)."""
    n = len(groups)
    kind = rng.random()
    if n >= 2 and kind < 0.45:
        i, j = rng.sample(range(n), 2)
        return move(groups, i, j, rng.choice(groups[i].devices))
    if n >= 2 and kind < 0.8:
        i, j = rng.sample(range(n), 2)
        return swap(groups, i, j, rng.choice(groups[i].devices), rng.choice(groups[j].devices))
    if len(roles) > 1:
        return flip(groups, rng.randrange(n))
    return None
