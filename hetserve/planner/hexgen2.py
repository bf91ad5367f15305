"""HexGen-2 (§3): disaggregated placement by graph partition, max flow and max-flow-guided refinement.

1. Phase 1 (``partition``): spectral partition + Kernighan–Lin into K memory-balanced groups,
   then coarsen and partition again to type each group prefill or decode.
2. Phase 2 (``placement.Evaluator``): best layout per group (latency-optimal for prefill,
   throughput-optimal for decode), the flow network of §3.2, preflow-push.
3. Phase 3 (``refine``): read bottleneck and under-used nodes from the flow, generate local
   edits that move capacity from where it idles to where the flow is stuck (device moves and
   swaps between groups, role flips, splits and merges), score each, keep the best improving
   one, repeat until none improves. Then, while ``options.restarts`` allows, kick the best
   placement with a few random edits and refine again (a restart that does not beat the best
   uses one up). The best value after every iteration is recorded (``Budget.history``).

Finally an all-colocated alternative is priced (the refined groups, the machines and, on
small pools, the whole pool, each re-cut into the colocated replicas that serve most;
``colocated_alternative``) and the better of the two plans is returned,
its note saying which was chosen: on pools whose links are too slow for KV caches (home GPUs)
or workloads where one phase dominates, colocation wins.

On pools of up to ``POPULATION_MAX_DEVICES`` devices one more chain starts from the upper bound's
own plan (``bound_start``: the group programme of ``planner/bound.py`` sees every group composition
at once, where the partition may not reach), and its refined result is returned when it serves more.

``random_swap`` is the truncated variant of §5.3: the same loop with random edits in place of
the guided ones. Neither ever returns a worse placement than its phase-1 start.

Running time per iteration: O(#candidates × (layout-cache lookups + K KV edges + one Dinic max
flow)); a layout search is only paid once per new group composition.
"""

from __future__ import annotations

import random
from typing import Callable, Sequence

from hetserve.planner.context import PlanContext
from hetserve.planner.estimate import to_plan
from hetserve.planner.guided import cut_moves
from hetserve.planner.mixing import colocated_alternative, mixed_alternative
from hetserve.planner.moves import Placement, flip, merge, move, pick_device, random_edit, split, split_devices, swap
from hetserve.planner.options import Budget, PlanOptions, default_restarts
from hetserve.planner.partition import assign_roles, group_bandwidth, initial_partition
from hetserve.planner.placement import Evaluation, Evaluator, Group, canonical, start_search
from hetserve.planner.plan import Plan
from hetserve.specs.cluster import Cluster
from hetserve.specs.model import ModelSpec
from hetserve.specs.workload import Workload

SATURATED = 0.999  # flow / capacity at or above this: a bottleneck node
SLACK = 0.98  # below this: an under-used node
MAX_TARGETS = 4  # bottleneck groups that receive devices per iteration
MAX_DONORS = 3  # under-used groups considered as donors for each bottleneck group
MAX_SPLITS = 6  # groups tried for a split per iteration (largest first)
MAX_MERGES = 4  # group pairs tried for a merge per iteration (best connected first)
RANDOM_CANDIDATES = 12  # random edits scored per iteration by random-swap
DEFAULT_RANDOM_PATIENCE = 25  # random-swap: iterations without improvement before stopping
KICK_EDITS = (2, 4)  # random edits applied to the best placement at a restart
POPULATION_MAX_DEVICES = 64  # pools up to this size refine every phase-1 start, not only the best

# A mover proposes (kind, placement) candidates; the kind names the edit for the search log.
Mover = Callable[[PlanContext, Evaluation, random.Random], list[tuple[str, Placement]]]


# ----------------------------------------------------------------------------- phase 1


def phase1_starts(ctx: PlanContext, ev: Evaluator, seed: int) -> list[Placement]:
    """Initial partitions into K groups and their types (§3.1), best-scoring first.

    K = pool memory / replica memory (App. A). That replica memory assumes 32 requests of KV, a
    guess; the partition is also built for K·¾ and K·3⁄2.
    """
    k0 = max(2, ctx.num_replicas_by_memory())
    scored, orders = [], {}
    for k in sorted({k0, max(2, round(k0 * 0.75)), min(ctx.num_devices, round(k0 * 1.5))}):
        groups = initial_partition(ctx, range(ctx.num_devices), k, seed, orders)
        roles = assign_roles(ev, groups)
        start = canonical(Group.of(g, r) for g, r in zip(groups, roles))
        scored.append((-ev.score(start), k, start))
    return [s for _, _, s in sorted(scored)]


def bound_start(ctx: PlanContext) -> Placement | None:
    """The upper bound's own best integer point as a placement (``planner/bound.py``: its column
    groups, devices of each machine's GPU type taken in index order), or None where the bound's
    columns are not machines. A start the partition may not reach: the bound sees every group
    composition at once (on het3 its plan scores above the guided climb's)."""
    from hetserve.planner.bound import group_bound

    g = group_bound(ctx)
    if g is None or not g.incumbent:
        return None
    free: dict[str, list[int]] = {}
    for d in ctx.cluster.devices:
        free.setdefault(f"{d.machine}/{d.gpu.name}", []).append(d.index)
    groups = []
    for comp, role, count in g.incumbent:
        for _ in range(count):
            devices: list[int] = []
            for kind, n in comp.items():
                devices += free[kind][:n]
                free[kind] = free[kind][n:]
            groups.append(Group.of(devices, role))
    return canonical(groups)


def phase1(ctx: PlanContext, ev: Evaluator, seed: int) -> Placement:
    """The best-scoring initial partition (``phase1_starts``)."""
    return phase1_starts(ctx, ev, seed)[0]


# ----------------------------------------------------------------------------- guided edits


def guided_moves(ctx: PlanContext, ev: Evaluation, rng: random.Random) -> list[tuple[str, Placement]]:
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
    out: list[tuple[str, Placement | None]] = list(cut_moves(ctx, ev))

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
        by_machine: dict[str, list[int]] = {}
        for d in spare:
            by_machine.setdefault(ctx.cluster.devices[d].machine, []).append(d)
        for bundle in [spare] + [ds for ds in by_machine.values() if len(ds) < len(spare)]:
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
    side = on_side(live, bottleneck)
    pairs = [(a, b) for a in side for b in side if a < b and groups[a].role == groups[b].role]
    pairs = sorted(pairs, key=lambda p: (-w[p], p))[:MAX_MERGES]
    pairs += sorted(((a, b) for a in slack for b in slack if a < b and groups[a].role == groups[b].role),
                    key=lambda p: (-w[p], p))[:MAX_MERGES]
    for a, b in pairs:
        out.append(("merge groups", merge(groups, a, b)))
    return _distinct(groups, out)


def _new_group(groups: Sequence[Group], devices: Sequence[int], role: str) -> Placement:
    """Take ``devices`` out of their groups into a new group of ``role``."""
    take = set(devices)
    rest = [Group(tuple(d for d in g.devices if d not in take), g.role) for g in groups]
    return canonical(rest + [Group.of(devices, role)])


def _distinct(groups: Placement, out: list[tuple[str, Placement | None]]) -> list[tuple[str, Placement]]:
    """Candidates that change the placement, each once (the first kind that proposed it)."""
    seen, result = set(), []
    for kind, p in out:
        if p is not None and p != groups and p not in seen:
            seen.add(p)
            result.append((kind, p))
    return result


def random_moves(ctx: PlanContext, ev: Evaluation, rng: random.Random) -> list[tuple[str, Placement]]:
    """The truncated variant's edits: random moves, swaps and flips, no flow information."""
    out = []
    for _ in range(RANDOM_CANDIDATES):
        p = random_edit(ctx, ev.groups, rng)
        if p is not None and p != ev.groups:
            out.append(("random edit", p))
    return out


# ----------------------------------------------------------------------------- phase 3


def refine(ctx: PlanContext, evaluator: Evaluator, start: Placement, budget: Budget, mover: Mover,
           rng: random.Random, restarts: int, patience: int | None = None) -> Placement:
    """Best-improvement local search from ``start`` with ``mover``'s candidates.

    Guided (``patience`` None): at a local optimum, alternately escape along the best unvisited
    flow-guided edit (downhill allowed) or restart from a kicked copy of the best, up to
    ``restarts`` times in a row without a new best. Random (``patience`` set): stop
    after ``patience`` iterations in a row without improvement.
    """
    best = cur = canonical(start)
    best_v = cur_v = evaluator.score(cur)
    cur_ev = evaluator.evaluate(cur)
    budget.best = max(budget.best, best_v)
    if budget.start_value is None:
        budget.start_value = best_v
    stall = 0
    left = restarts
    phase = "descent"
    visited: set[Placement] = set()
    while not budget.exhausted():
        pick, pick_v, pick_kind = None, cur_v, ""
        cands = mover(ctx, cur_ev, rng)
        i, v = evaluator.best_of([c for _, c in cands], cur_v, stop=budget.exhausted)
        if i is not None:
            pick_kind, pick = cands[i]
            pick_v = v
        if pick is not None:
            # credit only what lifts the best so far: a climb back up to it after a kick is no gain
            budget.credit(phase, pick_kind, max(0.0, pick_v - max(cur_v, best_v, budget.best)))
            cur, cur_v, stall = pick, pick_v, 0
            cur_ev = evaluator.evaluate(cur)
            if cur_v > best_v * (1 + 1e-9):
                best, best_v, left = cur, cur_v, restarts
        elif patience is not None:
            stall += 1
            if stall >= patience:
                budget.record(best_v)
                break
        else:
            if left <= 0:
                budget.record(best_v)
                break
            left -= 1
            # at a local optimum: every other time, step to the best unvisited edit the flow suggests
            # even though it scores lower (a guided escape, tabu on where earlier escapes went);
            # otherwise kick the best placement with random edits (a restart)
            escape = _escape(evaluator, mover(ctx, cur_ev, rng), visited) if left % 2 else None
            if escape is not None:
                phase, cur = "escape", escape
                visited.add(cur)
            else:
                phase = "restart"
                cur = best
                for _ in range(rng.randint(*KICK_EDITS)):
                    kicked = random_edit(ctx, cur, rng)
                    cur = kicked if kicked is not None else cur
            cur_v = evaluator.score(cur)
            cur_ev = evaluator.evaluate(cur)
        budget.record(best_v)
    return best


def _escape(evaluator: Evaluator, candidates, visited: set) -> Placement | None:
    """The best-scoring candidate not visited before, the first of those within a rounding error
    of it (None when all were)."""
    fresh = [cand for _, cand in candidates if cand not in visited]
    i, _ = evaluator.best_of(fresh, -1.0)
    return None if i is None else fresh[i]


# ----------------------------------------------------------------------------- algorithms


def _run(name: str, cluster: Cluster, model: ModelSpec, workload: Workload, options: PlanOptions,
         mover: Mover, patience: int | None) -> Plan:
    ctx, budget, evaluator = start_search(name, cluster, model, workload, options)
    rng = random.Random(options.seed)
    restarts = options.restarts if options.restarts is not None else default_restarts(len(cluster))
    if patience is None and len(cluster) <= POPULATION_MAX_DEVICES:
        # a small population: one chain from each phase-1 start (they share the evaluator's cache),
        # each with half the restarts — the starts' diversity is what makes seeds agree
        best, best_v = None, -1.0
        for start in phase1_starts(ctx, evaluator, options.seed):
            found = refine(ctx, evaluator, start, budget, mover, rng, max(2, restarts // 2), patience)
            v = evaluator.score(found)
            if v > best_v * (1 + 1e-9):
                best, best_v = found, v
            if budget.exhausted():
                break
    else:
        best = refine(ctx, evaluator, phase1(ctx, evaluator, options.seed), budget, mover, rng, restarts, patience)
    seeded = None
    if patience is None and len(cluster) <= POPULATION_MAX_DEVICES and not budget.exhausted():
        start = bound_start(ctx)
        if start is not None and evaluator.score(start) > 0:
            seeded = refine(ctx, evaluator, start, budget, mover, rng, max(2, restarts // 2), patience)
    plan = _choose(ctx, evaluator, best, name, options, budget)
    if seeded is not None and (v := evaluator.score(seeded)) > plan.estimate["throughput_tokens_per_s"] * (1 + 1e-6):
        budget.credit("final", "bound's plan, refined", v - plan.estimate["throughput_tokens_per_s"])
        budget.record(v)
        return to_plan(ctx, evaluator.evaluate(seeded), name, budget,
                       notes=f"chose the upper bound's own plan, refined: {v:.0f} tokens/s against "
                             f"{plan.estimate['throughput_tokens_per_s']:.0f} from the partition's search")
    return plan


def _choose(ctx: PlanContext, evaluator: Evaluator, best: Placement, name: str, options: PlanOptions,
            budget: Budget) -> Plan:
    """The plan from the refined ``best``: disaggregated, all colocated or mixed, whichever serves most."""
    cluster = ctx.cluster
    result = evaluator.evaluate(best)
    if result.flow.value <= 0:
        return colocated_fallback(ctx, name, budget)
    value = result.tokens_per_s
    if not options.allow_colocated:
        return to_plan(ctx, result, name, budget, notes="disaggregated (colocated plans not allowed)")
    colocated, col_v = colocated_alternative(ctx, evaluator, best)
    if len(cluster) <= POPULATION_MAX_DEVICES:
        # HexGen's genetic search over colocated groups may cut across machines where the knapsack
        # units do not; on small pools it is cheap, so the colocated side is at least HexGen's
        from hetserve.planner.hexgen import search_colocated

        hx = search_colocated(ctx, evaluator, Budget(name, options), options)
        hx_v = evaluator.score(hx)
        if hx_v > col_v * (1 + 1e-9):
            colocated, col_v = hx, hx_v
    # the mixed climb is not budget-aware: on large pools whose search already used its time, skip it
    if len(cluster) <= POPULATION_MAX_DEVICES or not budget.exhausted():
        mixed, mix_v = mixed_alternative(ctx, evaluator, best, colocated)
    else:
        mixed, mix_v = (), -1.0
    if mix_v > max(value, col_v) * (1 + 1e-9):
        budget.credit("final", "mixed alternative", mix_v - max(value, col_v))
        budget.record(mix_v)
        return to_plan(ctx, evaluator.evaluate(mixed), name, budget,
                       notes=f"chose a mixed plan (colocated replicas beside prefill/decode ones): {mix_v:.0f} "
                             f"tokens/s against {value:.0f} disaggregated and {col_v:.0f} all colocated")
    if col_v > value * (1 + 1e-9):
        budget.credit("final", "colocated alternative", col_v - value)
        budget.record(col_v)
        return to_plan(ctx, evaluator.evaluate(colocated), name, budget,
                       notes=f"chose colocated replicas: {col_v:.0f} tokens/s against "
                             f"{value:.0f} disaggregated (KV links too slow or prefill/decode too unbalanced "
                             f"to pay for disaggregation)")
    return to_plan(ctx, result, name, budget,
                   notes=f"chose disaggregation: {value:.0f} tokens/s against {col_v:.0f} with colocated "
                         f"replicas")


def colocated_fallback(ctx: PlanContext, name: str, budget: Budget) -> Plan:
    """A pool that cannot hold a prefill and a decode replica gets HexGen's colocated plan."""
    from hetserve.planner.hexgen import search_colocated

    best = search_colocated(ctx, Evaluator(ctx), budget, ctx.options)
    ev = Evaluator(ctx).evaluate(best)
    return to_plan(ctx, ev, name, budget,
                   notes="fewer than two replicas fit: colocated (HexGen) plan instead of disaggregated")


def hexgen2(cluster: Cluster, model: ModelSpec, workload: Workload, options: PlanOptions | None = None) -> Plan:
    """HexGen-2: graph partition + max flow + max-flow-guided refinement (disaggregated)."""
    return _run("hexgen2", cluster, model, workload, options or PlanOptions(), guided_moves, None)


def random_swap(cluster: Cluster, model: ModelSpec, workload: Workload, options: PlanOptions | None = None) -> Plan:
    """HexGen-2 with random edits instead of max-flow-guided ones (§5.3's truncated variant)."""
    options = options or PlanOptions()
    return _run("random-swap", cluster, model, workload, options, random_moves,
                options.patience or DEFAULT_RANDOM_PATIENCE)
