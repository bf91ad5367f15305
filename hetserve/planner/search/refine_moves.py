"""The candidate edits HexGen-2's refinement (phase 3, ``hexgen2.refine``) scores each iteration.

A *mover* reads one evaluated pool layout and proposes (kind, pool layout) candidates:
``guided_moves`` (§3.3) reads the solved flow — its min cut (``guided.cut_moves``), bottleneck and
under-used groups, idle devices — and proposes edits that move capacity from where it idles to
where the flow is stuck (device moves and swaps between groups, role flips, splits and merges);
``random_moves`` (§5.3's truncated variant) proposes random edits with no flow information.
Kept apart from the search loop in ``hexgen2.py``, which only calls a mover and keeps the best.
"""

from __future__ import annotations

import itertools
import random
from typing import Callable, Sequence

import numpy as np

from hetserve.planner.context import PlanContext
from hetserve.planner.search.guided import cut_moves
from hetserve.planner.search.moves import (PoolLayout, flip, merge, move, pick_device, random_edit, split, split_devices, swap,
                                          swap_parts)
from hetserve.planner.search.partition import group_bandwidth
from hetserve.planner.pool.evaluator import Evaluation
from hetserve.planner.pool.groups import Group, canonical

SATURATED = 0.999  # flow / capacity at or above this: a bottleneck node
SLACK = 0.98  # below this: an under-used node
MAX_TARGETS = 4  # bottleneck groups that receive devices per iteration
MAX_DONORS = 3  # under-used groups considered as donors for each bottleneck group
MAX_SPLITS = 6  # groups tried for a split per iteration (largest first)
MAX_MERGES = 4  # group pairs tried for a merge per iteration (best connected first)
MAX_REGROUPS = 4  # machine-part swaps tried per iteration (most machines saved first)
RANDOM_CANDIDATES = 12  # random edits scored per iteration by random-swap

# A mover proposes (kind, pool layout) candidates; the kind names the edit for the search log.
Mover = Callable[[PlanContext, Evaluation, random.Random], list[tuple[str, PoolLayout]]]


def guided_moves(ctx: PlanContext, ev: Evaluation, rng: random.Random) -> list[tuple[str, PoolLayout]]:
    """Edits suggested by the flow: first those that relieve its min cut (``guided.cut_moves``),
    then capacity from idle and under-used groups to the bottleneck side, splits and merges."""
    groups, caps = ev.groups, ev.capacities
    n = len(groups)
    util = [ev.utilization(i) for i in range(n)]
    live = [i for i in range(n) if caps[i] > 0]
    dead = [i for i in range(n) if caps[i] <= 0]
    pre = [i for i in live if groups[i].role == "prefill"]
    dec = [i for i in live if groups[i].role == "decode"]
    flow = ev.flow.value
    prefill_bound = bool(pre) and flow >= SATURATED * sum(caps[i] for i in pre)
    decode_bound = bool(dec) and flow >= SATURATED * sum(caps[i] for i in dec)
    # the one side that limits the flow (None: both or neither), and the other side
    bottleneck = ("prefill" if prefill_bound and not decode_bound
                  else "decode" if decode_bound and not prefill_bound else None)
    other = {"prefill": "decode", "decode": "prefill", None: None}[bottleneck]

    def on_side(indices: list[int], role: str | None) -> list[int]:
        return indices if role is None else [i for i in indices if groups[i].role == role]

    sat = [i for i in live if util[i] >= SATURATED]
    slack = [i for i in live if util[i] < SLACK]
    targets = on_side(sat, bottleneck)
    targets = sorted(targets, key=lambda i: (caps[i], i))[:MAX_TARGETS]
    w = group_bandwidth(ctx, [g.devices for g in groups])
    out: list[tuple[str, PoolLayout | None]] = list(cut_moves(ctx, ev))

    # idle devices first: fold a group that cannot hold a replica into its best-connected neighbours
    for h in dead:
        for g in sorted((g for g in range(n) if g != h), key=lambda g: (-w[h, g], g))[:3]:
            out.append(("merge idle group", merge(groups, g, h)))
        for h2 in dead:
            if h2 > h:
                out.append(("merge idle group", merge(groups, h, h2)))

    # idle devices (left out by their group's layout) are free capacity: give one to a group of the
    # bottleneck side, or gather them (per machine and all together) into new groups
    idle = {i: ev.idle_devices(i) for i in live}
    idle = {i: ds for i, ds in idle.items() if ds}
    if idle:
        receivers = targets or live
        for g in receivers[:MAX_TARGETS]:
            for h in sorted((h for h in idle if h != g), key=lambda h: (-w[g, h], h))[:MAX_DONORS]:
                for k in sorted({ctx.class_of[d] for d in idle[h]}):
                    d = max(x for x in idle[h] if ctx.class_of[x] == k)
                    out.append(("give idle device", move(groups, h, g, d)))
        spare = sorted(d for ds in idle.values() for d in ds)
        for bundle in [spare] + [ds for ds in _by_machine(ctx, spare).values() if len(ds) < len(spare)]:
            if ctx.can_hold_weights(bundle):
                for role in ("prefill", "decode"):
                    out.append(("gather idle devices", _new_group(groups, bundle, role)))

    # move or swap one device from an under-used (or idle) group into a bottleneck group
    for g in targets:
        donors = sorted((h for h in slack + dead if h != g), key=lambda h: (-w[g, h], h))[:MAX_DONORS]
        for h in donors:
            g_classes = {ctx.class_of[d] for d in groups[g].devices}
            h_classes = sorted({ctx.class_of[d] for d in groups[h].devices},
                               key=lambda k: (-ctx.bandwidth_gbps[ctx.classes[k][0], list(groups[g].devices)].sum(), k))
            for k in h_classes[:2]:
                d = pick_device(ctx, groups[h], k)
                out.append(("move device", move(groups, h, g, d)))
                for kg in sorted(g_classes - {k}):
                    out.append(("swap devices", swap(groups, h, g, d, pick_device(ctx, groups[g], kg))))

    # role flips toward the bottleneck side
    flip_from = on_side(slack, other)
    for i in sorted(flip_from, key=lambda i: (util[i], i))[:4]:
        out.append(("flip role", flip(groups, i)))
        # donate-and-flip: hand one device to the best-connected group of the old role first, so
        # the side that loses a group gains capacity (one move alone may not raise the flow)
        same = sorted((g for g in live if g != i and groups[g].role == groups[i].role), key=lambda g: (-w[i, g], g))
        for g in same[:2]:
            for k in sorted({ctx.class_of[d] for d in groups[i].devices}):
                moved = move(groups, i, g, pick_device(ctx, groups[i], k))
                if moved is not None:
                    j = moved.index(Group.of((d for d in groups[i].devices if d != pick_device(ctx, groups[i], k)),
                                             groups[i].role)) if len(groups[i].devices) > 1 else None
                    if j is not None:
                        out.append(("donate and flip", flip(moved, j)))
    # a balanced network with spare KV links: flip the strongest group of each side
    if prefill_bound and decode_bound:
        for side in (pre, dec):
            if len(side) > 1:
                out.append(("flip role", flip(groups, max(side, key=lambda i: (caps[i], -i)))))

    # restructure: split groups whose halves can each hold the weights (the largest first), merge
    # well-connected groups of one role on the bottleneck side and under-used neighbours
    splittable = [i for i in live if len(groups[i].devices) > 1
                  and all(ctx.can_hold_weights(h) for h in split_devices(ctx, groups[i].devices))]
    for i in sorted(splittable, key=lambda i: (-len(groups[i].devices), -caps[i], i))[:MAX_SPLITS]:
        out.append(("split group", split(ctx, groups, i)))
        out.append(("split group", split(ctx, groups, i, ("prefill", "decode"))))
    pairs = _best_connected(groups, on_side(live, bottleneck), w, MAX_MERGES)
    pairs += _best_connected(groups, slack, w, MAX_MERGES)
    for a, b in pairs:
        out.append(("merge groups", merge(groups, a, b)))
    for i, j, part_i, part_j in machine_regroups(ctx, groups, live, MAX_REGROUPS):
        out.append(("regroup machine parts", swap_parts(groups, i, j, part_i, part_j)))
    return _distinct(groups, out)


def machine_regroups(ctx: PlanContext, groups: Sequence[Group], idx: list[int],
                     k: int) -> list[tuple[int, int, tuple[int, ...], tuple[int, ...]]]:
    """Up to ``k`` swaps ``(i, j, part of i, part of j)`` of equal-sized machine parts between two
    groups of one role spanning several machines, each leaving the pair on fewer machines, the
    most saved first (ties by index). Two pipelines that each pair a machine's half with another's
    become one group on the shared machine and one across the other two: a move of several
    devices at once that single-device moves reach only through worse layouts (het3: 2 A6000 +
    2 L40 twice becomes 4 A6000 and 2 + 2 L40)."""
    parts = {i: {m: tuple(ds) for m, ds in by.items()}
             for i in sorted(idx) if len(by := _by_machine(ctx, groups[i].devices)) > 1}
    found = []
    for i, j in itertools.combinations(parts, 2):
        if groups[i].role != groups[j].role:
            continue
        for (mi, pi), (mj, pj) in itertools.product(parts[i].items(), parts[j].items()):
            if mi == mj or len(pi) != len(pj):
                continue
            after = len(parts[i].keys() - {mi} | {mj}) + len(parts[j].keys() - {mj} | {mi})
            saved = len(parts[i]) + len(parts[j]) - after
            if saved > 0:
                found.append((-saved, i, j, pi, pj))
    return [(i, j, pi, pj) for _, i, j, pi, pj in sorted(found)[:k]]


def _by_machine(ctx: PlanContext, devices: Sequence[int]) -> dict[str, list[int]]:
    """``devices`` by machine, in their order."""
    out: dict[str, list[int]] = {}
    for d in devices:
        out.setdefault(ctx.cluster.devices[d].machine, []).append(d)
    return out


def _best_connected(groups: Sequence[Group], idx: list[int], w: np.ndarray, k: int) -> list[tuple[int, int]]:
    """The ``k`` pairs a < b of groups in ``idx`` of one role with the most bandwidth between them
    (``w``), ties by (a, b): at thousands of GPUs ``idx`` holds hundreds of groups, so the pairs
    are ranked as arrays."""
    if len(idx) < 2:
        return []
    at = np.asarray(idx)
    roles = np.asarray([groups[i].role for i in idx])
    ii, jj = np.nonzero((at[:, None] < at[None, :]) & (roles[:, None] == roles[None, :]))
    a, b = at[ii], at[jj]
    best = np.lexsort((b, a, -w[a, b]))[:k]
    return [(int(x), int(y)) for x, y in zip(a[best], b[best])]


def _new_group(groups: Sequence[Group], devices: Sequence[int], role: str) -> PoolLayout:
    """Take ``devices`` out of their groups into a new group of ``role``."""
    take = set(devices)
    rest = [Group(tuple(d for d in g.devices if d not in take), g.role) for g in groups]
    return canonical(rest + [Group.of(devices, role)])


def _distinct(groups: PoolLayout, out: list[tuple[str, PoolLayout | None]]) -> list[tuple[str, PoolLayout]]:
    """Candidates that change the pool layout, each once (the first kind that proposed it)."""
    seen, result = set(), []
    for kind, p in out:
        if p is not None and p != groups and p not in seen:
            seen.add(p)
            result.append((kind, p))
    return result


def random_moves(ctx: PlanContext, ev: Evaluation, rng: random.Random) -> list[tuple[str, PoolLayout]]:
    """The truncated variant's edits: random moves, swaps and flips, no flow information."""
    out = []
    for _ in range(RANDOM_CANDIDATES):
        p = random_edit(ctx, ev.groups, rng)
        if p is not None and p != ev.groups:
            out.append(("random edit", p))
    return out
