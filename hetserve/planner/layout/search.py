"""Per-replica layout search (HexGen §4.2): the stages of one replica on a given set of devices.

Given a device group and a role, find the pipeline — which devices form each TP group, how many
layers each stage holds, in which order — that maximises the role's capacity under the cost model:

* prefill: latency-optimal (``CostModel.prefill_capacity`` = T / TTFT at the mean prompt);
* decode: throughput-optimal (``CostModel.decode_capacity``: the largest batch memory allows);
* colocated: ``CostModel.colocated_capacity`` (HexGen / vLLM-style replicas).

Search space (HexGen's heuristic): a TP group is devices of one class (same machine, same GPU
type); TP degrees divide the heads, KV heads and FFN width (``ModelSpec.tp_problem``). A layout may leave some of the group's devices
idle (an odd GPU, or a whole class that only slows the pipeline down); the searches read those
idle devices as spare capacity to move elsewhere. The DP of Eq. 3 over GPU-type count vectors picks,
for each class, how its devices split into TP groups; here that choice is enumerated exactly
(every multiset of allowed TP degrees summing to the class count) while the product stays small,
and by coordinate descent over classes beyond that. Stages of one class sit next to each other;
classes are ordered along the cheapest hand-off path (exhaustive up to 6 classes). Layers are
split by HexGen's memory-proportional rule, by speed, by a blend and (prefill) by filling the
fastest stages first, each repaired to fit memory; the best shape is then polished by
moving layers between stages while the capacity improves.

Every candidate is priced by ``CostModel`` — the probes that size the layer split are cost-model
calls on one- and two-layer stages — so the search and the final estimate share one formula.

Results are cached by (class-count vector, role): the searches above ask for the same
composition thousands of times. One search costs O(combos × candidates) cost-model calls,
a few milliseconds; a cache hit costs a dict lookup and the device mapping.

The module is split by concept: the layer split and its polish of one stage sequence
(``layer_split.LayerSplits``), the KV-friendlier alternatives (``layout_alternatives``) and
the shapes both return (``layout_choice``); ``LayoutSearch`` here enumerates TP splits and
class orders and owns the caches.
"""

from __future__ import annotations

import itertools
from typing import Sequence

import numpy as np

from hetserve.cost.analytic import PrefillBatch
from hetserve.cost.layout import ReplicaLayout, StageLayout
from hetserve.planner.layout.layer_split import LayerSplits
from hetserve.planner.layout.alternatives import KVAlternatives
from hetserve.planner.layout.choice import LayoutChoice
from hetserve.planner.layout.choice import remap as _remap
from hetserve.planner.layout.engines import shape_allowed
from hetserve.cost.memo import MemoCost

ROLES = ("prefill", "decode", "colocated")
# A prefill replica keeps the KV of a few prompts while they wait to be sent to a decode replica.
PREFILL_KV_REQUESTS = 4
# Enumerate TP splits exactly up to this many per class and this many combinations per group.
MAX_SPLITS_PER_CLASS = 12
MAX_COMBOS = 48
_MISSING = object()  # a cache miss (None is a cached answer: no layout fits)


class LayoutSearch(KVAlternatives, LayerSplits):
    """Best layout of a device group for a role, cached by the group's class composition.

    ``ctx``: the planning problem it serves (``planner.context.PlanContext``, which builds one as
    its ``layouts``): its cost model, model, mean lengths, device classes and options."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.cost = MemoCost(ctx.cost)  # the same prices, stage terms memoised
        m = ctx.model
        self.num_layers = m.num_layers
        self.tp_ok = [t for t in range(1, 65) if m.tp_problem(t) is None]
        self._cache: dict[tuple, LayoutChoice | None] = {}
        self._best_cache: dict[tuple, tuple[ReplicaLayout, float] | None] = {}
        self._probe_cache: dict[tuple, tuple[int, float]] = {}
        self._evaluated: dict[tuple, float] = {}  # (stage-sequence key, layers, role) → capacity
        self._split_memo: dict[tuple, tuple[float, tuple[int, ...]]] = {}  # (sequence key, role) → best split
        self._sequence_keys: dict[tuple, int] = {}  # stages -> ``_sequence_key``
        self._sequence_ids: dict[tuple, int] = {}  # what a layout's capacity reads -> its number
        self._order_cache: dict[tuple[int, ...], tuple[int, ...]] = {}
        self._splits_cache: dict[int, list[tuple[int, ...]]] = {}
        self._scored: dict[tuple, tuple[tuple[int, ...], dict]] = {}  # (comp, role) → (order, combo scores)
        self._alt_cache: dict[tuple, tuple[LayoutChoice, ...]] = {}
        self._options_cache: dict[tuple, tuple[tuple[ReplicaLayout, float], ...]] = {}
        # isomorphic compositions (same GPU types, counts and links, other machines) share one search
        self._canon_cache: dict[tuple, tuple[tuple, tuple[int, ...]]] = {}
        self._reps: dict[tuple, tuple[tuple, tuple[int, ...]]] = {}  # (canonical key, role) → (comp, classes)
        self.searches = 0  # cache misses, for benchmarks
        io = (ctx.input_tokens, ctx.output_tokens)
        self.min_kv = {"prefill": PREFILL_KV_REQUESTS * io[0], "decode": io[0] + io[1], "colocated": io[0] + io[1]}
        self._prompt = PrefillBatch.single(max(1, round(io[0])))

    # ------------------------------------------------------------------ public
    def best(self, devices: Sequence[int], role: str) -> tuple[ReplicaLayout, float] | None:
        """(layout on these devices, capacity in requests per T), or None if none fits.

        The layout may leave some of ``devices`` idle (see the module docstring)."""
        return self.best_of_key((tuple(devices), role))

    def best_of_key(self, key: tuple[tuple[int, ...], str]) -> tuple[ReplicaLayout, float] | None:
        """``best(*key)`` for a ``(devices tuple, role)`` key (a pool layout's ``Group`` is one),
        without building the key again: the search prices thousands of groups per step."""
        hit = self._best_cache.get(key, _MISSING)
        return self._find_best(key) if hit is _MISSING else hit

    def _find_best(self, key: tuple[tuple[int, ...], str]) -> tuple[ReplicaLayout, float] | None:
        devices, role = key
        choice = self.choice(self.ctx.composition(devices), role)
        result = None if choice is None else (self.materialize(devices, choice), choice.capacity)
        self._best_cache[key] = result
        return result

    def capacity(self, devices: Sequence[int], role: str) -> float:
        """Capacity (requests per T) of the best layout; 0 when nothing fits."""
        choice = self.choice(self.ctx.composition(devices), role)
        return 0.0 if choice is None else choice.capacity

    def choice(self, comp: tuple[tuple[int, int], ...], role: str) -> LayoutChoice | None:
        key = (comp, role)
        if key in self._cache:
            return self._cache[key]
        rep = self._representative(comp, role)
        if rep is None:
            result = self._search(comp, role)
        else:  # an isomorphic composition was searched: the same shapes on this one's classes
            result = _remap(self.choice(rep[0], role), rep[1])
        self._cache[key] = result
        return result

    def _representative(self, comp: tuple[tuple[int, int], ...], role: str):
        """(searched composition, its class → this composition's class) when a composition
        isomorphic to ``comp`` was searched before; None (and ``comp`` becomes the
        representative) otherwise.

        Two compositions are isomorphic when, with their classes in canonical order, the GPU
        types, memories, counts, links inside each class and links between the classes agree:
        every cost-model call of a layout search then prices the same (a layout's capacity reads
        only those), so the searched shapes moved onto the other classes have the same capacity.
        On pools of many machines of a few types this is what keeps the cache hitting."""
        hit = self._canon_cache.get(comp)
        if hit is None:
            hit = self._canon_cache[comp] = self._canonical(comp)
        canon, classes = hit
        rep = self._reps.setdefault((canon, role), (comp, classes))
        if rep[0] == comp:
            return None
        return rep[0], dict(zip(rep[1], classes))

    def _canonical(self, comp: tuple[tuple[int, int], ...]) -> tuple[tuple, tuple[int, ...]]:
        """(canonical key, the composition's classes in canonical order); see ``_representative``."""
        ctx = self.ctx
        bw, lat = ctx.cluster.bandwidth, ctx.cluster.latency
        feats = {}
        for k, n in comp:
            members = ctx.classes[k]
            d = ctx.cluster.devices[members[0]]
            inner = (float(bw[members[0], members[1]]), float(lat[members[0], members[1]])) if n > 1 else ()
            feats[k] = (d.gpu.name, float(d.memory_bytes), n, inner)
        classes = tuple(sorted(feats, key=lambda k: (feats[k], k)))
        reps = [ctx.classes[k][0] for k in classes]
        links = tuple((float(bw[a, b]), float(lat[a, b])) for a in reps for b in reps if a != b)
        return (tuple(feats[k] for k in classes), links), classes

    def materialize(self, devices: Sequence[int], choice: LayoutChoice) -> ReplicaLayout:
        """Map a class-level choice onto concrete devices (lowest indices of each class first)."""
        pools: dict[int, list[int]] = {}
        for d in sorted(devices):
            pools.setdefault(self.ctx.class_of[d], []).append(d)
        taken: dict[int, int] = {}
        stages = []
        for s in choice.shapes:
            i = taken.get(s.cls, 0)
            stages.append(StageLayout(tuple(pools[s.cls][i:i + s.tp]), s.layers))
            taken[s.cls] = i + s.tp
        return ReplicaLayout(tuple(stages))

    # ------------------------------------------------------------------ search
    def _search(self, comp: tuple[tuple[int, int], ...], role: str) -> LayoutChoice | None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        ctx = self.ctx
        self.searches += 1
        devices = [d for k, n in comp for d in ctx.classes[k][:n]]
        if not devices or not ctx.can_hold_weights(devices):
            return None
        order = self._class_order(tuple(k for k, _ in comp))
        counts = dict(comp)
        per_class = [self._class_options(counts[k], len(comp) > 1) for k in order]
        n_combos = 1
        for s in per_class:
            n_combos *= len(s)
        scored: dict[tuple, tuple[float, tuple[int, ...]]] = {}
        engine = ctx.options.engine

        def score(combo):
            if combo not in scored:
                # a shape the target engine cannot run scores nothing: it is never chosen, and
                # never offered as a KV alternative (those are read from ``scored`` where v > 0)
                scored[combo] = (self._best_split(order, combo, role) if shape_allowed(engine, role, combo)
                                 else (0.0, ()))
            return scored[combo][0]

        if n_combos <= MAX_COMBOS:
            for combo in itertools.product(*per_class):
                score(combo)
        else:  # coordinate descent over classes, from the largest-TP split of each
            current = [s[0] for s in per_class]
            best = score(tuple(current))
            for _ in range(3):
                improved = False
                for i, options in enumerate(per_class):
                    for opt in options:
                        trial = current.copy()
                        trial[i] = opt
                        v = score(tuple(trial))
                        if v > best * (1 + 1e-12):
                            best, current, improved = v, trial, True
                if not improved:
                    break
        # ties: fewer stages, then fewer devices in use (the idle ones are capacity to move elsewhere)
        ranked = sorted(((v, c, layers) for c, (v, layers) in scored.items() if v > 0),
                        key=lambda x: (-x[0], sum(len(t) for t in x[1]), sum(sum(t) for t in x[1]), x[1]))
        if not ranked:
            return None
        best_v, best_combo, best_layers = ranked[0]
        best_v, best_layers = self._polish(order, best_combo, best_layers, role, best_v)
        self._scored[(comp, role)] = (order, scored)
        best = self._choice_of(order, best_combo, best_layers, best_v)
        if len(order) > 1:  # the same stages in reversed class order (first / last stage costs differ)
            rev = self._reversed(order, best_combo, role)
            if rev is not None and rev.capacity > best_v * (1 + 1e-9):
                best = rev
        return best

    def _reversed(self, order, combo, role: str) -> LayoutChoice | None:
        """``combo``'s stages with the class order reversed, layers split and polished anew."""
        rev, rcombo = order[::-1], combo[::-1]
        v, layers = self._best_split(rev, rcombo, role)
        if v <= 0 or not layers:
            return None
        v, layers = self._polish(rev, rcombo, layers, role, v)
        return self._choice_of(rev, rcombo, layers, v)

    def _class_options(self, n: int, others: bool) -> list[tuple[int, ...]]:
        """TP splits of a class's ``n`` devices in a group: every split of all ``n``; one TP group
        of the largest allowed degree below ``n`` (an odd device left idle: a 3-GPU prefill
        replica is faster as TP 2 than as TP 2 + a 1-layer stage); and, when the group has other
        classes, none at all (the class sits idle)."""
        out = list(self._splits(n))
        below = [t for t in self.tp_ok if t < n]
        if below and (below[-1],) not in out:
            out.append((below[-1],))
        if others:
            out.append(())
        return out

    def _splits(self, n: int) -> list[tuple[int, ...]]:
        """Ways to cut ``n`` devices of one class into TP groups (non-increasing degrees)."""
        if n in self._splits_cache:
            return self._splits_cache[n]
        sizes = [t for t in self.tp_ok if t <= n][::-1]
        out: list[tuple[int, ...]] = []

        def rec(rest: int, cap: int, acc: tuple[int, ...]):
            if len(out) > MAX_SPLITS_PER_CLASS:
                return
            if rest == 0:
                out.append(acc)
                return
            for t in sizes:
                if t <= min(rest, cap):
                    rec(rest - t, t, acc + (t,))

        rec(n, n, ())
        if len(out) > MAX_SPLITS_PER_CLASS:  # uniform degree, remainder in the largest that fit
            out = []
            for t in sizes:
                acc, rest = [t] * (n // t), n % t
                for u in sizes:
                    while u <= rest:
                        acc.append(u)
                        rest -= u
                out.append(tuple(acc))
        out = sorted(set(out), key=lambda s: (len(s), s))
        self._splits_cache[n] = out
        return out

    def _class_order(self, classes: tuple[int, ...]) -> tuple[int, ...]:
        """Order of classes along the pipeline minimising the activation hand-off cost."""
        if len(classes) <= 1:
            return classes
        if classes in self._order_cache:
            return self._order_cache[classes]
        ctx = self.ctx
        nbytes = ctx.input_tokens * ctx.model.hidden * ctx.model.dtype_bytes
        rep = {k: ctx.classes[k][0] for k in classes}
        hop = {(a, b): ctx.cost.p2p_time(rep[a], rep[b], nbytes) for a in classes for b in classes if a != b}
        if len(classes) <= 6:
            candidates = itertools.permutations(classes)
        else:  # nearest neighbour from every start
            candidates = _nearest_neighbour_paths(sorted(classes), hop)
        best = min(candidates, key=lambda p: (sum(hop[(a, b)] for a, b in zip(p, p[1:])), p))
        self._order_cache[classes] = best
        return best


def _nearest_neighbour_paths(classes: list[int], hop: dict) -> list[tuple[int, ...]]:
    """From every start, the path that always steps to the nearest class not yet visited (the
    smallest class among equally near ones). One matrix row per step instead of a Python ``min``
    over the classes left: the same paths, about 20× faster on groups of 20–30 classes, which
    large pools' merges produce by the thousand."""
    n = len(classes)
    cost = np.array([[hop[(a, b)] if a != b else np.inf for b in classes] for a in classes])
    paths = []
    for start in range(n):
        free = np.ones(n, dtype=bool)
        free[start] = False
        path = [start]
        for _ in range(n - 1):
            row = np.where(free, cost[path[-1]], np.inf)
            nxt = int(np.argmin(row))  # first of the smallest: ``classes`` is sorted
            if not free[nxt]:  # every free class infinitely far: the smallest free one
                nxt = int(np.flatnonzero(free)[0])
            free[nxt] = False
            path.append(nxt)
        paths.append(tuple(classes[i] for i in path))
    return paths
