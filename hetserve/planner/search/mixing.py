"""Colocated and mixed alternatives to a disaggregated pool layout (HexGen-2's last step here).

* ``colocated_alternative``: the best all-colocated pool layout cut from a few coarse units.
* ``mixed_alternative``: colocated replicas beside prefill/decode ones — from the disaggregated
  pool layout, groups turned colocated one at a time (each re-cut into the colocated replicas that
  serve most; alone, or with the devices other groups hold on its machines), and all groups of
  one site at once (an island behind a narrow pipe); from the
  colocated pool layout, pairs of well-connected colocated groups turned into a prefill and a
  decode replica, colocated groups absorbed into a prefill or decode group, and single groups
  split into the two, and prefill/decode groups halved (into one role or one of each). Greedy best-improvement rounds, each
  candidate scored by the shared ``Evaluator`` (colocated capacities add to the max flow).
"""

from __future__ import annotations

import functools
import itertools

from hetserve.planner.context import PlanContext
from hetserve.planner.search import cut_store
from hetserve.planner.search.moves import merge, split, split_devices, with_roles
from hetserve.planner.search.partition import group_bandwidth
from hetserve.planner.pool.evaluator import Evaluator
from hetserve.planner.pool.groups import Group, PoolLayout, canonical, edit

MAX_MIXED_ROUNDS = 8
MAX_PAIR_CANDIDATES = 60  # colocated pairs tried per round (best connected first)
MAX_ABSORB = 3  # third groups tried with each pair
LOOKAHEAD_MAX_DEVICES = 16  # pools up to this size look two moves ahead when one does not pay
LOOKAHEAD = 4  # non-improving candidates expanded per round
# pools up to this size also try a group turned colocated with its machine-mates: each such cut is
# of a new, larger composition (new layout searches); at 80 / 160 / 320 GPUs it never changed the
# plan and cost 1-4 s CPU (the mixed climb from the disaggregated side ends below the colocated
# plan there); the search's other small-pool extras (bound's start) stop at the same size
MACHINE_MATES_MAX_DEVICES = 64
# a climb that cannot reach the plan already in hand is cut: it stops once its value plus this many
# times its largest gain so far, for each round left, stays below that plan. A later round's gain
# was at most 2.4x an earlier one on the presets and 20-1,024-GPU pools, and the cut changed none
# of their plans (on large pools the disaggregated side starts far below the colocated plan)
REACH_SLACK = 4.0


MAX_KNAPSACK_VECTORS = 256  # sub-vectors of a group's composition the colocated knapsack enumerates
PAIR_UNITS_MAX_DEVICES = 64  # pools up to this size also cut every pair of machines together


def colocated_alternative(ctx: PlanContext, evaluator: Evaluator, groups: PoolLayout,
                          stop=None) -> tuple[PoolLayout, float]:
    """The best all-colocated pool layout cut from a few coarse units: the pool layout's own groups,
    the machines, every pair of machines beside the other machines (pools of at most
    ``PAIR_UNITS_MAX_DEVICES``), and (when its class-count space has at most
    ``MAX_KNAPSACK_VECTORS`` vectors) the whole pool. Each unit's devices are re-cut into the colocated replicas that serve most —
    a knapsack over the sub-vectors of its class-count vector (halving per class, recursively,
    beyond that size); devices no unit's cut uses are pooled and cut the same way. Colocated
    capacity is additive, so each unit is decided on its own. Returns (pool layout, tokens/s).
    ``stop()`` true (the plan's time is spent) ends it after the current unit set; the first is
    always cut."""
    by_machine: dict[str, list[int]] = {}
    for d in ctx.cluster.devices:
        by_machine.setdefault(d.machine, []).append(d.index)
    unit_sets = [[g.devices for g in groups], [tuple(ds) for ds in by_machine.values()]]
    size = 1
    for n in ctx.class_counts:
        size *= n + 1
    if size <= MAX_KNAPSACK_VECTORS:
        unit_sets.append([tuple(range(ctx.num_devices))])
    if ctx.num_devices <= PAIR_UNITS_MAX_DEVICES:
        # two machines cut together: a replica across them (2 H100 beside 2 A100 on hexgen2-het1)
        # is found whatever groups the seed's search ended with, not only when they held it
        machines = list(by_machine.values())
        for a, b in itertools.combinations(range(len(machines)), 2):
            pair = tuple(machines[a] + machines[b])
            pair_size = 1
            for _, n in ctx.composition(pair):
                pair_size *= n + 1
            if pair_size <= MAX_KNAPSACK_VECTORS:
                unit_sets.append([pair] + [tuple(ds) for i, ds in enumerate(machines) if i not in (a, b)])
    best: tuple[PoolLayout, float] = ((), -1.0)
    for units in unit_sets:
        parts: list[Group] = []
        for devices in units:
            parts.extend(Group.of(ds, "colocated") for ds in _colocated_cut(ctx, evaluator, tuple(sorted(devices))))
        used = {d for p in parts for d in p.devices}
        spare = tuple(d for d in range(ctx.num_devices) if d not in used)
        if spare and ctx.can_hold_weights(spare):
            parts.extend(Group.of(ds, "colocated") for ds in _colocated_cut(ctx, evaluator, spare))
        pool = canonical(parts)
        v = evaluator.score(pool) if pool else 0.0
        if v > best[1] * (1 + 1e-9):
            best = (pool, v)
        if stop is not None and stop():
            break
    return best


def _colocated_cut(ctx: PlanContext, evaluator: Evaluator, devices: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Device sets of the colocated replicas that serve most on ``devices`` (see above).

    Memoised by class composition (``Evaluator.colocated_cuts``): the cut reads only the class
    counts and, within each class, the devices' order, so it is computed once on the first
    devices of each class and moved onto any other devices of the same classes. The mixed climb
    re-cuts the same groups every round (at 320 GPUs ~1,400 cuts, most of them repeats). Behind
    that memo, ``cut_store`` keeps the cuts for every evaluator of the same problem (the other
    algorithms and plan calls on it)."""
    comp = ctx.composition(devices)
    hit = evaluator.colocated_cuts.get(comp)
    if hit is None:
        shared = cut_store.shared_cuts(ctx, (MAX_KNAPSACK_VECTORS,))
        hit = shared.get(comp)
        if hit is None:
            first = tuple(d for k, n in comp for d in ctx.classes[k][:n])
            hit = _colocated_cut_fresh(ctx, evaluator, first, comp)
            cut_store.keep(shared, comp, hit)
        evaluator.colocated_cuts[comp] = hit
    where: dict[int, int] = {}  # the k-th device of a class on the memo's devices -> on ``devices``
    by_cls: dict[int, list[int]] = {}
    for d in sorted(devices):
        by_cls.setdefault(ctx.class_of[d], []).append(d)
    for k, ds in by_cls.items():
        where.update(zip(ctx.classes[k], ds))
    return [tuple(where[d] for d in part) for part in hit]


def _colocated_cut_fresh(ctx: PlanContext, evaluator: Evaluator, devices: tuple[int, ...],
                         comp: tuple[tuple[int, int], ...]) -> list[tuple[int, ...]]:
    """``_colocated_cut`` computed (``devices``: the first of each class of ``comp``)."""
    size = 1
    for _, n in comp:
        size *= n + 1
    by_cls: dict[int, list[int]] = {}
    for d in sorted(devices):
        by_cls.setdefault(ctx.class_of[d], []).append(d)
    if size > MAX_KNAPSACK_VECTORS:
        whole = evaluator.capacity(devices, "colocated")
        a, b = split_devices(ctx, devices)
        if a and b and ctx.can_hold_weights(a) and ctx.can_hold_weights(b):
            ca, cb = _colocated_cut(ctx, evaluator, tuple(a)), _colocated_cut(ctx, evaluator, tuple(b))
            if sum(evaluator.capacity(x, "colocated") for x in ca + cb) > whole * (1 + 1e-9):
                return ca + cb
        return [devices] if whole > 0 else []
    classes = [k for k, _ in comp]
    vecs = [v for v in itertools.product(*(range(n + 1) for _, n in comp)) if any(v)]
    first = {k: by_cls[k] for k in classes}

    def devs(v):
        return tuple(d for k, n in zip(classes, v) for d in first[k][:n])

    items = [(v, c) for v in vecs if ctx.can_hold_weights(devs(v)) and (c := evaluator.capacity(devs(v), "colocated")) > 0]

    @functools.lru_cache(maxsize=None)
    def best(left: tuple[int, ...]) -> tuple[float, tuple]:
        out: tuple[float, tuple] = (0.0, ())
        for v, cap in items:
            if all(n <= m for n, m in zip(v, left)):
                sub = best(tuple(m - n for n, m in zip(v, left)))
                if cap + sub[0] > out[0] * (1 + 1e-12):
                    out = (cap + sub[0], (v,) + sub[1])
        return out

    _, chosen = best(tuple(n for _, n in comp))
    out, offset = [], [0] * len(classes)
    for v in chosen:
        out.append(tuple(d for j, (k, n) in enumerate(zip(classes, v)) for d in first[k][offset[j]:offset[j] + n]))
        offset = [o + n for o, n in zip(offset, v)]
    return out




def _recut(ctx: PlanContext, evaluator: Evaluator, groups: PoolLayout, idx) -> PoolLayout:
    """``groups`` with the groups at ``idx`` replaced by the best colocated cut of their devices."""
    take = set(idx)
    devices = tuple(sorted(d for i in idx for d in groups[i].devices))
    cut = [Group.of(ds, "colocated") for ds in _colocated_cut(ctx, evaluator, devices)]
    used = {d for g in cut for d in g.devices}
    idle = tuple(d for d in devices if d not in used)
    if idle:  # devices no colocated replica uses stay in a (zero-capacity) group: movable later
        cut.append(Group.of(idle, "colocated"))
    return edit(groups, take, cut)


def _recut_with_machine_mates(ctx: PlanContext, evaluator: Evaluator, groups: PoolLayout, i: int) -> PoolLayout | None:
    """``groups`` with group ``i`` turned colocated together with the devices other groups hold on
    its machines (taken from them): one move where two lose alone — on hexgen2-het2 the H100 pair
    prefilling, joined by the decode group's third H100, serves more colocated (1,684 -> 1,749
    tokens/s) while neither the flip nor the device move pays by itself. None if no other group
    holds a device there."""
    machine = lambda d: ctx.cluster.devices[d].machine  # noqa: E731
    here = {machine(d) for d in groups[i].devices}
    taken = [d for j, g in enumerate(groups) if j != i for d in g.devices if machine(d) in here]
    if not taken:
        return None
    gone = set(taken)
    out = [Group.of(tuple(d for d in g.devices if d not in gone), g.role) for j, g in enumerate(groups) if j != i]
    joined = Group.of(groups[i].devices + tuple(taken), groups[i].role)
    pool = canonical(out + [joined])
    return _recut(ctx, evaluator, pool, [pool.index(joined)])


def _climb(evaluator: Evaluator, start: PoolLayout, candidates, lookahead: int = 0,
           stop=None, target: float = 0.0) -> tuple[PoolLayout, float]:
    """Greedy best-improvement rounds. With ``lookahead`` k > 0, a round with no improving move
    tries two-move paths through its k best non-improving candidates: turning a colocated pair into
    prefill and decode often loses until the prefill half is split again (small pools only).
    ``stop()`` true ends the climb at the best pool layout scored so far. ``target``: the value
    of the plan already in hand (``REACH_SLACK``; the lookahead climbs of small pools run on)."""
    cur, cur_v = start, evaluator.score(start)
    if not lookahead:
        return _climb_bounded(evaluator, cur, cur_v, candidates, stop, target)
    stopped = False
    for _ in range(MAX_MIXED_ROUNDS):
        pick, pick_v, near = None, cur_v, []
        for cand in candidates(cur):
            if cand is None or cand == cur:
                continue
            v = evaluator.score(cand, floor=-1.0 if lookahead else pick_v)  # ranked below: exact
            if v > pick_v * (1 + 1e-9):
                pick, pick_v = cand, v
            elif lookahead and v > 0:
                near.append((v, cand))
            if stop is not None and stop():
                stopped = True
                break
        if stopped:
            return (pick, pick_v) if pick is not None else (cur, cur_v)
        if pick is None and near:
            for _, first in sorted(near, key=lambda x: -x[0])[:lookahead]:
                for cand in candidates(first):
                    if cand is not None and cand != cur:
                        v = evaluator.score(cand, floor=pick_v)
                        if v > pick_v * (1 + 1e-9):
                            pick, pick_v = cand, v
        if pick is None:
            break
        cur, cur_v = pick, pick_v
    return cur, cur_v


def _climb_bounded(evaluator: Evaluator, cur: PoolLayout, cur_v: float, candidates, stop,
                   target: float = 0.0) -> tuple[PoolLayout, float]:
    """``_climb`` without lookahead: each round's candidates go to ``Evaluator.best_of``, which
    solves the flows of only those whose bounds can still beat the best (a scan solves every one
    that beats the best so far). Stops early where ``target`` is out of reach (``REACH_SLACK``)."""
    gain = 0.0
    for done in range(1, MAX_MIXED_ROUNDS + 1):
        cands = []
        for cand in candidates(cur):
            if cand is not None and cand != cur:
                cands.append(cand)
            if stop is not None and stop():
                break
        i, v = evaluator.best_of(cands, floor=cur_v, stop=stop)
        if i is None:
            break
        gain = max(gain, v - cur_v)
        cur, cur_v = cands[i], v
        if stop is not None and stop():
            break
        if cur_v + (MAX_MIXED_ROUNDS - done) * REACH_SLACK * gain < target:
            break
    return cur, cur_v


def mixed_alternative(ctx: PlanContext, evaluator: Evaluator, disaggregated: PoolLayout,
                      colocated: PoolLayout, stop=None, target: float = 0.0) -> tuple[PoolLayout, float]:
    """The best mixed pool layout found from either end (see the module docstring); ``stop()`` true
    ends each climb where it is, ``target`` (the plan in hand) where it cannot reach it (``_climb``)."""

    def from_disaggregated(groups: PoolLayout):
        pd = [i for i, g in enumerate(groups) if g.role in ("prefill", "decode")]
        for i in pd:
            yield _recut(ctx, evaluator, groups, [i])
        by_site: dict[str, list[int]] = {}
        for i in pd:
            sites = {ctx.cluster.devices[d].site for d in groups[i].devices}
            if len(sites) == 1:
                by_site.setdefault(sites.pop(), []).append(i)
        for idx in by_site.values():
            if 1 < len(idx) < len(pd):
                yield _recut(ctx, evaluator, groups, idx)
        if ctx.num_devices <= MACHINE_MATES_MAX_DEVICES:
            for i in pd:
                yield _recut_with_machine_mates(ctx, evaluator, groups, i)
        yield from _splits(groups, pd)

    def from_colocated(groups: PoolLayout):
        col = [i for i, g in enumerate(groups) if g.role == "colocated" and g.devices]
        if len(col) >= 2:
            w = group_bandwidth(ctx, [g.devices for g in groups])
            pairs = sorted(((a, b) for a in col for b in col if a < b), key=lambda p: (-w[p], p))
            for a, b in pairs[:MAX_PAIR_CANDIDATES]:
                for ra, rb in (("prefill", "decode"), ("decode", "prefill")):
                    # every group keeps its place (groups are ordered by their devices, which no
                    # two share), so a, b and c below index the same groups in ``out``
                    out = with_roles(groups, {a: ra, b: rb})
                    yield out
                    # the pair alone may not pay; with a third colocated group absorbed into one of
                    # them it may (a two-step move a greedy climb would not take)
                    near = sorted((c for c in col if c not in (a, b)), key=lambda c: (-w[a, c] - w[b, c], c))
                    for c in near[:MAX_ABSORB]:
                        for host in (a, b):
                            yield merge(out, host, c)
        # a colocated group absorbed into a prefill or decode group (more devices for the bottleneck)
        pd = [i for i, g in enumerate(groups) if g.role in ("prefill", "decode")]
        if col and pd:
            w = group_bandwidth(ctx, [g.devices for g in groups])
            pairs = sorted(((c, g) for c in col for g in pd), key=lambda p: (-w[p], p))
            for c, g in pairs[:MAX_PAIR_CANDIDATES]:
                yield merge(groups, g, c)
        for i in col:
            a, b = split_devices(ctx, groups[i].devices)
            if a and b and ctx.can_hold_weights(a) and ctx.can_hold_weights(b):
                yield split(ctx, groups, i, ("prefill", "decode"))
        yield from _splits(groups, pd)

    def _splits(groups: PoolLayout, idx):
        """Prefill or decode groups halved into two replicas of the same role (or one of each): beside colocated
        replicas the P/D side is small, and two one-GPU prefill replicas can serve more than
        one TP-2 replica (HexGen §4.3's split, which the partition step does not revisit)."""
        for i in idx:
            a, b = split_devices(ctx, groups[i].devices)
            if a and b and ctx.can_hold_weights(a) and ctx.can_hold_weights(b):
                yield split(ctx, groups, i)
                # or one half on each side: one L4 prefilling for another beside two decoding
                # A6000s (the two-box pool), a pair the partition never proposes
                for roles in (("prefill", "decode"), ("decode", "prefill")):
                    yield split(ctx, groups, i, roles)

    best: tuple[PoolLayout, float] = ((), -1.0)
    for start, gen in ((disaggregated, from_disaggregated), (colocated, from_colocated)):
        if start:
            p, v = _climb(evaluator, start, gen, LOOKAHEAD if ctx.num_devices <= LOOKAHEAD_MAX_DEVICES else 0, stop,
                          max(target, best[1]))
            if v > best[1] * (1 + 1e-9):
                best = (p, v)
    return best
