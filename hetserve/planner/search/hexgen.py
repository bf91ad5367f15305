"""HexGen (§4.3): genetic search over partitions of the pool into replicas.

* Initialisation: K-means on the communication matrix (each device's row of log bandwidths),
  the number of clusters M chosen by the elbow method (the point of the inertia curve farthest
  from the chord between its ends). The population holds that grouping, the same grouping with
  every cluster split down to about one replica's memory, and mutations of both.
* Mutations (on class-count vectors, §4.3): merge two groups; split one evenly (⌊τ_k/2⌋,
  ⌈τ_k/2⌉ per class); swap — move one device of a sampled class from one group to another.
  Offspring with a new group whose memory cannot hold the weights are rejected before any
  layout search (the paper's early check).
* Each group's layout is the per-replica search of §4.2 (``LayoutSearch``); fitness is the
  pool layout's estimated throughput (``Evaluator``), the same number every algorithm reports.
* Steady-state evolution with an elitist population; stops at ``patience`` generations without
  improvement, ``max_iterations`` generations or the time limit.

``hexgen`` types every group colocated. ``genetic_search`` takes a typing function, so the
disaggregated GA baseline of HexGen-2 §5.3 (``baselines.genetic``) reuses this search with
HexGen-2's secondary partition assigning prefill and decode.
"""

from __future__ import annotations

import random
from typing import Callable, Sequence

import numpy as np

from hetserve.planner.context import PlanContext
from hetserve.planner.pool.estimate import to_plan
from hetserve.planner.search.moves import split_devices
from hetserve.planner.options import Budget, PlanOptions
from hetserve.planner.pool.evaluator import Evaluator, start_search
from hetserve.planner.pool.groups import Group, canonical
from hetserve.planner.plan import Plan
from hetserve.specs.cluster import Cluster
from hetserve.specs.model import ModelSpec
from hetserve.specs.workload import Workload

POPULATION = 16
OFFSPRING = 8
TOURNAMENT = 3
DEFAULT_PATIENCE = 30
MAX_ELBOW_K = 16
KMEANS_ITERATIONS = 50

Partition = tuple[tuple[int, ...], ...]
Typer = Callable[[Partition], tuple[Group, ...]]


# ----------------------------------------------------------------------------- K-means + elbow


def kmeans(x: np.ndarray, k: int, rng: np.random.Generator) -> tuple[np.ndarray, float]:
    """Lloyd's algorithm with k-means++ seeding: (labels, inertia)."""
    n = len(x)
    centers = [x[rng.integers(n)]]
    for _ in range(1, k):
        d2 = np.min(((x[:, None, :] - np.asarray(centers)[None]) ** 2).sum(-1), axis=1)
        total = d2.sum()
        centers.append(x[rng.choice(n, p=d2 / total)] if total > 0 else x[rng.integers(n)])
    c = np.asarray(centers)
    labels = np.zeros(n, dtype=int)
    for _ in range(KMEANS_ITERATIONS):
        dist = ((x[:, None, :] - c[None]) ** 2).sum(-1)
        new = dist.argmin(axis=1)
        if np.array_equal(new, labels) and _ > 0:
            break
        labels = new
        for j in range(k):
            if np.any(labels == j):
                c[j] = x[labels == j].mean(axis=0)
    inertia = float(((x - c[labels]) ** 2).sum())
    return labels, inertia


def elbow(inertias: Sequence[float]) -> int:
    """Index of the elbow: the point farthest from the chord between the first and last."""
    y = np.asarray(inertias, dtype=float)
    if len(y) <= 2:
        return 0
    x = np.arange(len(y), dtype=float)
    x1, y1, x2, y2 = x[0], y[0], x[-1], y[-1]
    dist = np.abs((y2 - y1) * x - (x2 - x1) * y + x2 * y1 - y2 * x1) / max(np.hypot(y2 - y1, x2 - x1), 1e-12)
    return int(np.argmax(dist))


def kmeans_groups(ctx: PlanContext, seed: int) -> list[list[int]]:
    """Communication clusters of the pool, their number M by the elbow method."""
    x = np.log1p(ctx.bandwidth_gbps + ctx.bandwidth_gbps.T)
    np.fill_diagonal(x, x.max())
    n = ctx.num_devices
    ks = list(range(1, min(n, MAX_ELBOW_K) + 1))
    runs = [kmeans(x, k, np.random.default_rng(seed)) for k in ks]
    labels, _ = runs[elbow([r[1] for r in runs])]
    groups = [sorted(int(d) for d in np.flatnonzero(labels == j)) for j in range(labels.max() + 1)]
    return [g for g in groups if g]


def split_to_replicas(ctx: PlanContext, groups: Sequence[Sequence[int]]) -> list[list[int]]:
    """Split every group (evenly per class) while it holds memory for two or more replicas."""
    out: list[list[int]] = []
    todo = [list(g) for g in groups]
    while todo:
        g = todo.pop()
        if ctx.group_memory(g) >= 2 * ctx.replica_memory_bytes and len(g) > 1:
            a, b = split_devices(ctx, g)
            if a and b:
                todo.extend([a, b])
                continue
        out.append(sorted(g))
    return sorted(out)


# ----------------------------------------------------------------------------- mutations


def mutate(ctx: PlanContext, part: Partition, rng: random.Random) -> Partition | None:
    """One merge, split or swap; None if the offspring fails the early memory check.

    The check (HexGen §4.3): a split whose halves cannot both hold the weights, or a swap that
    leaves its donor group unable to hold them, is dropped before any layout search.
    """
    groups = [list(g) for g in part]
    ops = ["swap", "merge"] * (len(groups) >= 2) + ["split"]
    op = rng.choice(ops)
    if op == "merge":
        i, j = sorted(rng.sample(range(len(groups)), 2))
        groups[i] = groups[i] + groups[j]
        del groups[j]
    elif op == "split":
        i = rng.randrange(len(groups))
        a, b = split_devices(ctx, groups[i])
        if not a or not b or not (ctx.can_hold_weights(a) and ctx.can_hold_weights(b)):
            return None
        groups[i:i + 1] = [a, b]
    else:  # swap: one device of a sampled class moves from group j to group i
        i, j = rng.sample(range(len(groups)), 2)
        k = rng.choice(sorted({ctx.class_of[d] for d in groups[j]}))
        d = max(x for x in groups[j] if ctx.class_of[x] == k)
        donor = [x for x in groups[j] if x != d]
        if donor and ctx.can_hold_weights(groups[j]) and not ctx.can_hold_weights(donor):
            return None
        groups[i] = groups[i] + [d]
        groups[j] = donor
    return tuple(sorted(tuple(sorted(g)) for g in groups if g))


# ----------------------------------------------------------------------------- the search


def genetic_search(ctx: PlanContext, evaluator: Evaluator, budget: Budget, options: PlanOptions,
                   typer: Typer, initial: Sequence[Sequence[Sequence[int]]]) -> tuple[Group, ...]:
    """Evolve partitions from ``initial``; return the best typed pool layout found."""
    rng = random.Random(options.seed)
    patience = options.patience or DEFAULT_PATIENCE
    fitness: dict[Partition, float] = {}
    typed: dict[Partition, tuple[Group, ...]] = {}

    def fit(p: Partition) -> float:
        if p not in fitness:
            typed[p] = typer(p)
            fitness[p] = evaluator.score(typed[p])
        return fitness[p]

    pop: list[Partition] = []
    for groups in initial:
        p = tuple(sorted(tuple(sorted(g)) for g in groups if g))
        if p not in pop:
            pop.append(p)
    seeds = list(pop)
    tries = 0
    while len(pop) < POPULATION and tries < 20 * POPULATION:
        tries += 1
        child = mutate(ctx, rng.choice(seeds), rng)
        if child is not None and child not in pop:
            pop.append(child)
    pop.sort(key=lambda p: (-fit(p), p))
    best = pop[0]
    stall = 0
    budget.best = max(budget.best, fit(best))
    while not budget.exhausted() and stall < patience:
        children = []
        for _ in range(OFFSPRING):
            parent = min(rng.sample(pop, min(TOURNAMENT, len(pop))), key=lambda p: (-fit(p), p))
            child = mutate(ctx, parent, rng)
            if child is not None:
                fit(child)
                children.append(child)
        pop = sorted(set(pop) | set(children), key=lambda p: (-fit(p), p))[:POPULATION]
        if fit(pop[0]) > fit(best) * (1 + 1e-9):
            best, stall = pop[0], 0
        else:
            stall += 1
        budget.record(fit(best))
    if stall >= patience:
        budget.stopped_by = "converged"
    return typed[best] if best in typed else typer(best)


def colocated_typer(part: Partition) -> tuple[Group, ...]:
    return canonical(Group(g, "colocated") for g in part)


def initial_population(ctx: PlanContext, seed: int) -> list[list[list[int]]]:
    km = kmeans_groups(ctx, seed)
    return [km, split_to_replicas(ctx, km)]


def search_colocated(ctx: PlanContext, evaluator: Evaluator, budget: Budget, options: PlanOptions) -> tuple[Group, ...]:
    return genetic_search(ctx, evaluator, budget, options, colocated_typer, initial_population(ctx, options.seed))


def hexgen(cluster: Cluster, model: ModelSpec, workload: Workload, options: PlanOptions | None = None) -> Plan:
    """HexGen: colocated replicas with asymmetric pipelines, found by the genetic search."""
    options = options or PlanOptions()
    ctx, budget, evaluator = start_search("hexgen", cluster, model, workload, options)
    best = search_colocated(ctx, evaluator, budget, options)
    return to_plan(ctx, evaluator.evaluate(best), "hexgen", budget)
