"""HexGen-2 (§3): disaggregated pool layout by graph partition, max flow and max-flow-guided refinement.

1. Phase 1 (``partition``): spectral partition + Kernighan–Lin into K memory-balanced groups,
   then coarsen and partition again to type each group prefill or decode.
2. Phase 2 (``pool.Evaluator``): best layout per group (latency-optimal for prefill,
   throughput-optimal for decode), the flow network of §3.2, preflow-push.
3. Phase 3 (``refine``): read bottleneck and under-used nodes from the flow, generate local
   edits that move capacity from where it idles to where the flow is stuck (device moves and
   swaps between groups, role flips, splits and merges; proposed by ``refine_moves``), score each,
   keep the best improving one, repeat until none improves. Then, while ``options.restarts``
   allows, kick the best pool layout with a few random edits and refine again (a restart that does
   not beat the best uses one up). The best value after every iteration is recorded (``Budget.history``).

Finally an all-colocated alternative is priced (the refined groups, the machines and, on
small pools, the whole pool, each re-cut into the colocated replicas that serve most;
``colocated_alternative``) and the better of the two plans is returned,
its note saying which was chosen: on pools whose links are too slow for KV caches (home GPUs)
or workloads where one phase dominates, colocation wins.

On pools of up to ``POPULATION_MAX_DEVICES`` devices one more chain starts from the upper bound's
own plan (``bound_start``: the group programme of ``planner/bound/throughput.py`` sees every group composition
at once, where the partition may not reach), and its refined result is returned when it serves more.

``random_swap`` is the truncated variant of §5.3: the same loop with random edits in place of
the guided ones. Neither ever returns a worse pool layout than its phase-1 start.

Running time per iteration: O(#candidates × (layout-cache lookups + K KV edges + one Dinic max
flow)); a layout search is only paid once per new group composition.
"""

from __future__ import annotations

import random

from hetserve.planner.context import PlanContext
from hetserve.planner.search.collector import with_fewer_collections
from hetserve.planner.pool.estimate import to_plan
from hetserve.planner.search.mixing import colocated_alternative, mixed_alternative
from hetserve.planner.search.moves import PoolLayout, random_edit
from hetserve.planner.options import STALL_TOLERANCE, Budget, PlanOptions, default_restarts, default_stall_iterations
from hetserve.planner.search.partition import assign_roles, initial_partition
from hetserve.planner.pool.evaluator import Evaluator, start_search
from hetserve.planner.pool.groups import Group, canonical
from hetserve.planner.plan import Plan
from hetserve.planner.search.refine_moves import Mover, guided_moves, random_moves
from hetserve.specs.cluster import Cluster
from hetserve.specs.model import ModelSpec
from hetserve.specs.workload import Workload

DEFAULT_RANDOM_PATIENCE = 25  # random-swap: iterations without improvement before stopping
KICK_EDITS = (2, 4)  # random edits applied to the best pool layout at a restart
POPULATION_MAX_DEVICES = 64  # pools up to this size refine every phase-1 start, not only the best


# ----------------------------------------------------------------------------- phase 1


def phase1_starts(ctx: PlanContext, ev: Evaluator, seed: int) -> list[PoolLayout]:
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


def bound_start(ctx: PlanContext, time_limit_s: float | None = None) -> PoolLayout | None:
    """The upper bound's own best integer point as a pool layout (``planner/bound/throughput.py``: its column
    groups, devices of each machine's GPU type taken in index order), or None where the bound's
    columns are not machines. A start the partition may not reach: the bound sees every group
    composition at once (on het3 its plan scores above the guided climb's). ``time_limit_s``: the
    bound's (``bound.group_bound``)."""
    from hetserve.planner.bound.throughput import group_bound

    g = group_bound(ctx, time_limit_s=time_limit_s)
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
    left = [d for ds in free.values() for d in ds]
    if left:
        # the devices of the programme's groups past K (priced per device, composition unknown):
        # one group in the role the others lack, so the start serves (het2: three prefill groups
        # and a decode group of the other 10 GPUs)
        roles = {g.role for g in groups}
        role = "decode" if "decode" not in roles else "prefill" if "prefill" not in roles else "colocated"
        groups.append(Group.of(left, role))
    return canonical(groups)


def phase1(ctx: PlanContext, ev: Evaluator, seed: int) -> PoolLayout:
    """The best-scoring initial partition (``phase1_starts``)."""
    return phase1_starts(ctx, ev, seed)[0]


# ----------------------------------------------------------------------------- phase 3


def refine(ctx: PlanContext, evaluator: Evaluator, start: PoolLayout, budget: Budget, mover: Mover,
           rng: random.Random, restarts: int, patience: int | None = None, stall: int | None = None,
           reference: float = 0.0) -> PoolLayout:
    """Best-improvement local search from ``start`` with ``mover``'s candidates.

    Guided (``patience`` None): at a local optimum, alternately escape along the best unvisited
    flow-guided edit (downhill allowed) or restart from a kicked copy of the best, up to
    ``restarts`` times in a row without a new best. Random (``patience`` set): stop
    after ``patience`` iterations in a row without improvement. Either way, with ``stall`` set,
    stop after ``stall`` iterations in a row that do not raise the best plan found — the best
    here, or ``reference`` (tokens/s of a plan the caller already holds) — by more than
    ``STALL_TOLERANCE`` of it.
    """
    best = cur = canonical(start)
    best_v = cur_v = evaluator.score(cur)
    cur_ev = evaluator.evaluate(cur)
    budget.best = max(budget.best, best_v)
    if budget.start_value is None:
        budget.start_value = best_v
    misses = 0  # random: iterations in a row without improvement
    left = restarts
    phase = "descent"
    visited: set[PoolLayout] = set()
    top, since = max(best_v, reference), 0  # the best plan found, iterations since it last rose
    while not budget.exhausted():
        if stall is not None:
            if max(best_v, reference) > top * (1 + STALL_TOLERANCE):
                top, since = max(best_v, reference), 0
            elif since >= stall:
                budget.stopped_by = "stalled"
                break
            since += 1
        pick, pick_v, pick_kind = None, cur_v, ""
        cands = mover(ctx, cur_ev, rng)
        i, v = evaluator.best_of([c for _, c in cands], cur_v, stop=budget.exhausted)
        if i is not None:
            pick_kind, pick = cands[i]
            pick_v = v
        if pick is not None:
            # credit only what lifts the best so far: a climb back up to it after a kick is no gain
            budget.credit(phase, pick_kind, max(0.0, pick_v - max(cur_v, best_v, budget.best)))
            cur, cur_v, misses = pick, pick_v, 0
            cur_ev = evaluator.evaluate(cur)
            if cur_v > best_v * (1 + 1e-9):
                best, best_v, left = cur, cur_v, restarts
        elif patience is not None:
            misses += 1
            if misses >= patience:
                budget.record(best_v)
                break
        else:
            if left <= 0:
                budget.record(best_v)
                break
            left -= 1
            # at a local optimum: every other time, step to the best unvisited edit the flow suggests
            # even though it scores lower (a guided escape, tabu on where earlier escapes went);
            # otherwise kick the best pool layout with random edits (a restart)
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


def _escape(evaluator: Evaluator, candidates, visited: set) -> PoolLayout | None:
    """The best-scoring candidate not visited before, the first of those within a rounding error
    of it (None when all were)."""
    fresh = [cand for _, cand in candidates if cand not in visited]
    i, _ = evaluator.best_of(fresh, -1.0)
    return None if i is None else fresh[i]


# ----------------------------------------------------------------------------- algorithms


@with_fewer_collections
def _run(name: str, cluster: Cluster, model: ModelSpec, workload: Workload, options: PlanOptions,
         mover: Mover, patience: int | None) -> Plan:
    ctx, budget, evaluator = start_search(name, cluster, model, workload, options)
    reference: tuple[PoolLayout, float] = ((), 0.0)  # a colocated plan priced before the search
    rng = random.Random(options.seed)
    restarts = options.restarts if options.restarts is not None else default_restarts(len(cluster))
    stall = options.stall_iterations or default_stall_iterations(len(cluster))
    if patience is None and len(cluster) <= POPULATION_MAX_DEVICES:
        # a small population: one chain from each phase-1 start (they share the evaluator's cache),
        # each with half the restarts — the starts' diversity is what makes seeds agree
        best, best_v = None, -1.0
        for start in phase1_starts(ctx, evaluator, options.seed):
            found = refine(ctx, evaluator, start, budget, mover, rng, max(2, restarts // 2), patience, stall)
            v = evaluator.score(found)
            if v > best_v * (1 + 1e-9):
                best, best_v = found, v
            if budget.exhausted():
                break
    else:
        start = phase1(ctx, evaluator, options.seed)
        if patience is None and options.allow_colocated:
            # the colocated plan the final step would at least return, priced first: a climb that
            # stays below it is not progress (on large synthetic pools it is the plan returned)
            reference = colocated_alternative(ctx, evaluator, start, budget.exhausted)
        best = refine(ctx, evaluator, start, budget, mover, rng, restarts, patience, stall, reference[1])
    seeded = None
    if patience is None and len(cluster) <= POPULATION_MAX_DEVICES and not budget.exhausted():
        start = bound_start(ctx, budget.bound_time_s())
        if start is not None and evaluator.score(start) > 0:
            seeded = refine(ctx, evaluator, start, budget, mover, rng, max(2, restarts // 2), patience, stall)
        if seeded is not None and not options.allow_colocated and any(g.role == "colocated" for g in seeded):
            seeded = None  # the bound's plan keeps colocated groups: not a plan of prefill and decode replicas
    plan = _choose(ctx, evaluator, best, name, options, budget, () if seeded is None else (seeded,), reference)
    if seeded is not None and (v := evaluator.score(seeded)) > plan.estimate["throughput_tokens_per_s"] * (1 + 1e-6):
        budget.credit("final", "bound's plan, refined", v - plan.estimate["throughput_tokens_per_s"])
        budget.chose(v)
        return to_plan(ctx, evaluator.evaluate(seeded), name, budget,
                       notes=f"chose the upper bound's own plan, refined: {v:.0f} tokens/s against "
                             f"{plan.estimate['throughput_tokens_per_s']:.0f} from the partition's search")
    return plan


def _choose(ctx: PlanContext, evaluator: Evaluator, best: PoolLayout, name: str, options: PlanOptions,
            budget: Budget, others: tuple[PoolLayout, ...] = (),
            reference: tuple[PoolLayout, float] = ((), 0.0)) -> Plan:
    """The plan from the refined ``best``: disaggregated, all colocated or mixed, whichever serves most.
    The mixed climb also starts from ``others`` (the climbs from the bound's plan): a mixed plan
    can lie near a disaggregated one that is not the best (het2: 1,623 -> 1,822 mixed, where the
    best 1,684's climb stops at 1,684). ``reference``: a colocated pool layout priced before the
    search (and its tokens/s), kept where it beats the colocated cut of ``best``."""
    cluster = ctx.cluster
    result = evaluator.evaluate(best)
    if result.flow.value <= 0:
        return colocated_fallback(ctx, name, budget)
    value = result.tokens_per_s
    if not options.allow_colocated:
        return to_plan(ctx, result, name, budget, notes="disaggregated (colocated plans not allowed)")
    # what follows the search has the rest of the time limit (``options.FINAL_SHARE``); each step
    # below stops where it runs out, with the best it has
    colocated, col_v = colocated_alternative(ctx, evaluator, best, budget.out_of_time)
    if reference[1] > col_v * (1 + 1e-9):
        colocated, col_v = reference
    if len(cluster) <= POPULATION_MAX_DEVICES:
        # HexGen's genetic search over colocated groups may cut across machines where the knapsack
        # units do not; on small pools it is cheap, so the colocated side is at least HexGen's
        from hetserve.planner.search.hexgen import search_colocated

        hx = search_colocated(ctx, evaluator, budget.rest(name), options)
        hx_v = evaluator.score(hx)
        if hx_v > col_v * (1 + 1e-9):
            colocated, col_v = hx, hx_v
    # on large pools whose search already used its time, skip the mixed climb (it re-cuts many groups)
    mixed, mix_v = (), -1.0
    if len(cluster) <= POPULATION_MAX_DEVICES or not budget.exhausted():
        for start in (best,) + tuple(o for o in others if o != best):
            m, v = mixed_alternative(ctx, evaluator, start, colocated, budget.out_of_time,
                                     max(value, col_v, mix_v))
            if v > mix_v * (1 + 1e-9):
                mixed, mix_v = m, v
    if mix_v > max(value, col_v) * (1 + 1e-9):
        budget.credit("final", "mixed alternative", mix_v - max(value, col_v))
        budget.chose(mix_v)
        return to_plan(ctx, evaluator.evaluate(mixed), name, budget,
                       notes=f"chose a mixed plan (colocated replicas beside prefill/decode ones): {mix_v:.0f} "
                             f"tokens/s against {value:.0f} disaggregated and {col_v:.0f} all colocated")
    if col_v > value * (1 + 1e-9):
        budget.credit("final", "colocated alternative", col_v - value)
        budget.chose(col_v)
        return to_plan(ctx, evaluator.evaluate(colocated), name, budget,
                       notes=f"chose colocated replicas: {col_v:.0f} tokens/s against "
                             f"{value:.0f} disaggregated (KV links too slow or prefill/decode too unbalanced "
                             f"to pay for disaggregation)")
    return to_plan(ctx, result, name, budget,
                   notes=f"chose disaggregation: {value:.0f} tokens/s against {col_v:.0f} with colocated "
                         f"replicas")


def colocated_fallback(ctx: PlanContext, name: str, budget: Budget) -> Plan:
    """A pool that cannot hold a prefill and a decode replica gets HexGen's colocated plan."""
    from hetserve.planner.search.hexgen import search_colocated

    best = search_colocated(ctx, Evaluator(ctx), budget.rest(name), ctx.options)  # the time the search left
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
