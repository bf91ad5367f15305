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

**Alternatives for the KV links** (``alternatives`` / ``options``). The capacity-best layout is
not always best for the placement: a decode replica of 4 × TP1 stages receives its KV cache
over four times as many device pairs as one TP4 stage, which wins when the links between the
prefill and decode groups are slow (HexGen-2 App. E). So besides the best layout each
(composition, role) keeps up to ``MAX_ALTERNATIVES - 1`` others, found lazily (only when an
evaluator asks, i.e. when a placement's flow is limited by KV edges): the Pareto frontier of
the TP splits already scored over (capacity ↑, largest layers-per-device of a stage ↓ — the
bytes the busiest KV pair carries), keeping the one that spreads the KV widest, plus the
same shapes in reversed class order (HexGen-2 App. A adjusts the stage order of both phases
to minimise KV cost: which machine holds which layers decides which links carry them). No
alternative has more capacity than the best, so min(Σ prefill, Σ decode) of best capacities
stays an upper bound on any choice of alternatives. ``placement.Evaluator`` picks one per group.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from hetserve.cost.analytic import PrefillBatch
from hetserve.cost.layout import ReplicaLayout, StageLayout

if TYPE_CHECKING:
    from hetserve.planner.context import PlanContext

ROLES = ("prefill", "decode", "colocated")
# A prefill replica keeps the KV of a few prompts while they wait to be sent to a decode replica.
PREFILL_KV_REQUESTS = 4
# Enumerate TP splits exactly up to this many per class and this many combinations per group.
MAX_SPLITS_PER_CLASS = 12
MAX_COMBOS = 48
MAX_POLISH_ROUNDS = 40
MAX_POLISH_EVALUATIONS = 200
_DECODE_PROBE_BATCH = 16
# Layouts kept per (composition, role) for the evaluator to choose from (the best included), and
# the least capacity an alternative may have, relative to the best.
MAX_ALTERNATIVES = 4
MIN_ALTERNATIVE_FRACTION = 0.25
KV_MARGIN = 0.8  # an alternative must cut a KV load by at least 20% to be kept


@dataclass(frozen=True)
class StageShape:
    """A stage before devices are chosen: ``tp`` devices of class ``cls`` holding ``layers``."""

    cls: int
    tp: int
    layers: tuple[int, int]


@dataclass(frozen=True)
class LayoutChoice:
    """The best layout of one composition in one role: capacity (requests per T) and shape."""

    capacity: float
    shapes: tuple[StageShape, ...]

    @property
    def num_stages(self) -> int:
        return len(self.shapes)


class LayoutSearch:
    """Best layout of a device group for a role, cached by the group's class composition."""

    def __init__(self, ctx: "PlanContext"):
        self.ctx = ctx
        m = ctx.model
        self.num_layers = m.num_layers
        self.tp_ok = [t for t in range(1, 65) if m.tp_problem(t) is None]
        self._cache: dict[tuple, LayoutChoice | None] = {}
        self._best_cache: dict[tuple, tuple[ReplicaLayout, float] | None] = {}
        self._probe_cache: dict[tuple, tuple[int, float]] = {}
        self._order_cache: dict[tuple[int, ...], tuple[int, ...]] = {}
        self._splits_cache: dict[int, list[tuple[int, ...]]] = {}
        self._scored: dict[tuple, tuple[tuple[int, ...], dict]] = {}  # (comp, role) → (order, combo scores)
        self._alt_cache: dict[tuple, tuple[LayoutChoice, ...]] = {}
        self._options_cache: dict[tuple, tuple[tuple[ReplicaLayout, float], ...]] = {}
        self.searches = 0  # cache misses, for benchmarks
        io = (ctx.input_tokens, ctx.output_tokens)
        self.min_kv = {"prefill": PREFILL_KV_REQUESTS * io[0], "decode": io[0] + io[1], "colocated": io[0] + io[1]}
        self._prompt = PrefillBatch.single(max(1, round(io[0])))

    # ------------------------------------------------------------------ public
    def best(self, devices: Sequence[int], role: str) -> tuple[ReplicaLayout, float] | None:
        """(layout on these devices, capacity in requests per T), or None if none fits.

        The layout may leave some of ``devices`` idle (see the module docstring)."""
        key = (tuple(devices), role)
        if key in self._best_cache:
            return self._best_cache[key]
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
        result = self._search(comp, role)
        self._cache[key] = result
        return result

    def alternatives(self, comp: tuple[tuple[int, int], ...], role: str) -> tuple[LayoutChoice, ...]:
        """The best layout first, then up to ``MAX_ALTERNATIVES - 1`` KV-friendlier ones (see the
        module docstring); () when nothing fits. Cached by (composition, role)."""
        key = (comp, role)
        hit = self._alt_cache.get(key)
        if hit is not None:
            return hit
        best = self.choice(comp, role)
        out: tuple[LayoutChoice, ...] = ()
        if best is not None:
            out = (best,) + self._alternatives(comp, role, best)
        self._alt_cache[key] = out
        return out

    def options(self, devices: Sequence[int], role: str) -> tuple[tuple[ReplicaLayout, float], ...]:
        """``alternatives`` mapped onto ``devices``: ((layout, capacity), …), best first."""
        key = (tuple(devices), role)
        hit = self._options_cache.get(key)
        if hit is None:
            hit = tuple((self.materialize(devices, c), c.capacity) for c in self.alternatives(
                self.ctx.composition(devices), role))
            self._options_cache[key] = hit
        return hit

    def _alternatives(self, comp, role: str, best: LayoutChoice) -> tuple[LayoutChoice, ...]:
        if role == "colocated" or (comp, role) not in self._scored:
            return ()
        order, scored = self._scored[(comp, role)]
        floor = MIN_ALTERNATIVE_FRACTION * best.capacity
        best_key = self._shape_key(best.shapes)
        # unpolished candidates of every scored TP split (the best's own split excluded)
        cands = []
        for combo, (v, layers) in scored.items():
            if v >= floor and layers:
                c = self._choice_of(order, combo, layers, v)
                if self._shape_key(c.shapes) != best_key:
                    cands.append((combo, c))
        # Pareto frontier over (capacity ↑, KV loads ↓), a load counting only when it improves on
        # every higher-capacity layout kept so far by a clear margin
        frontier: list[tuple] = []
        kept = [_kv_loads(best)]
        for combo, c in sorted(cands, key=lambda x: (-x[1].capacity, _kv_loads(x[1]), x[0])):
            loads = _kv_loads(c)
            if any(all(loads[t] < KV_MARGIN * k[t] for k in kept) for t in range(len(loads))):
                frontier.append((combo, c))
                kept.append(loads)
        # the widest spread for each load measure first, then the highest capacities
        picked = []
        for t in range(len(kept[0])):
            if frontier:
                pick = min(frontier, key=lambda x: (_kv_loads(x[1])[t], -x[1].capacity, x[0]))
                if pick not in picked:
                    picked.append(pick)
        picked += [f for f in frontier if f not in picked]
        picked = sorted(picked[:MAX_ALTERNATIVES - 1], key=lambda x: (-x[1].capacity, x[0]))
        out: list[LayoutChoice] = []
        for combo, c in picked:
            v, layers = self._polish(order, combo, tuple(s.layers[1] - s.layers[0] for s in c.shapes), role, c.capacity)
            out.append(self._choice_of(order, combo, layers, v))
        # the same TP splits in the other class order (multi-class groups: other layers on other
        # links), for the best layout and each alternative
        if len(order) > 1:
            best_order = tuple(dict.fromkeys(x.cls for x in best.shapes))
            for o, combo in [(order, self._combo_of(order, best.shapes))] + [(order, c) for c, _ in picked]:
                if combo is None:
                    continue
                if self._combo_of(o, best.shapes) == combo and best_order != tuple(k for k in o if k in best_order):
                    # the best is already the reversed order of this split: its other order is ``order``
                    v, layers = scored.get(combo, (0.0, ()))
                    c = self._choice_of(order, combo, layers, v) if layers else None
                else:
                    c = self._reversed(o, combo, role)
                if c is not None and c.capacity >= floor:
                    out.append(c)
        seen = {best_key}
        result = []
        for c in out:
            k = self._shape_key(c.shapes)
            if k not in seen and c.capacity <= best.capacity * (1 + 1e-9):
                seen.add(k)
                result.append(c)
        return tuple(result[:2 * (MAX_ALTERNATIVES - 1)])

    @staticmethod
    def _shape_key(shapes) -> tuple:
        return tuple((s.cls, s.tp, s.layers) for s in shapes)

    def _choice_of(self, order, combo, layers, value) -> LayoutChoice:
        shapes, start = [], 0
        for (k, tp, _), n in zip(self._stages(order, combo), layers):
            shapes.append(StageShape(k, tp, (start, start + n)))
            start += n
        return LayoutChoice(value, tuple(shapes))

    @staticmethod
    def _combo_of(order, shapes) -> tuple[tuple[int, ...], ...] | None:
        """The per-class TP split (in ``order``) a shape sequence was built from."""
        by_cls: dict[int, list[int]] = {}
        for s in shapes:
            by_cls.setdefault(s.cls, []).append(s.tp)
        if not set(by_cls) <= set(order):
            return None
        return tuple(tuple(by_cls.get(k, ())) for k in order)

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

        def score(combo):
            if combo not in scored:
                scored[combo] = self._best_split(order, combo, role)
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
            def greedy(start):
                path, left = [start], set(classes) - {start}
                while left:
                    nxt = min(left, key=lambda b: (hop[(path[-1], b)], b))
                    path.append(nxt)
                    left.remove(nxt)
                return tuple(path)
            candidates = (greedy(s) for s in classes)
        best = min(candidates, key=lambda p: (sum(hop[(a, b)] for a, b in zip(p, p[1:])), p))
        self._order_cache[classes] = best
        return best

    @staticmethod
    def _stages(order, combo) -> list[tuple[int, int, int]]:
        """(class, tp, representative offset) per stage, in pipeline order."""
        out = []
        for k, split in zip(order, combo):
            off = 0
            for tp in split:
                out.append((k, tp, off))
                off += tp
        return out

    def _stage(self, k: int, tp: int, off: int, layers: int) -> StageLayout:
        return StageLayout(self.ctx.classes[k][off:off + tp], (0, layers))

    def _probe(self, k: int, tp: int, first: bool, last: bool, role: str) -> tuple[int, float]:
        """(most layers that fit with the role's minimum KV, seconds per extra layer) of a stage."""
        key = (k, tp, first, last, role)
        hit = self._probe_cache.get(key)
        if hit is not None:
            return hit
        cost, L, need = self.ctx.cost, self.num_layers, self.min_kv[role]
        lo, hi = 0, L  # largest l with capacity >= need (capacity falls as l grows)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if cost.stage_kv_capacity(self._stage(k, tp, 0, mid), first, last) >= need:
                lo = mid
            else:
                hi = mid - 1
        s1, s2 = self._stage(k, tp, 0, 1), self._stage(k, tp, 0, 2)
        pf = cost.stage_prefill_time(s2, self._prompt) - cost.stage_prefill_time(s1, self._prompt)
        b = _DECODE_PROBE_BATCH
        ctxt = b * (self.ctx.input_tokens + self.ctx.output_tokens / 2)
        dc = cost.stage_decode_time(s2, b, ctxt) - cost.stage_decode_time(s1, b, ctxt)
        slope = {"prefill": pf, "decode": dc, "colocated": pf + self.ctx.output_tokens / b * dc}[role]
        self._probe_cache[key] = (lo, max(slope, 1e-12))
        return lo, max(slope, 1e-12)

    def _evaluate(self, stages, layers, role: str) -> float:
        ctx = self.ctx
        parts, start = [], 0
        for (k, tp, off), n in zip(stages, layers):
            parts.append(StageLayout(ctx.classes[k][off:off + tp], (start, start + n)))
            start += n
        return self.layout_capacity(ReplicaLayout(tuple(parts)), role)

    def layout_capacity(self, layout: ReplicaLayout, role: str) -> float:
        """Requests per T that ``layout`` serves in ``role``; 0 if it lacks the role's minimum KV."""
        ctx, cost = self.ctx, self.ctx.cost
        if cost.kv_capacity_tokens(layout) < self.min_kv[role]:
            return 0.0
        T, i, o = ctx.period_s, ctx.input_tokens, ctx.output_tokens
        if role == "prefill":
            return cost.prefill_capacity(layout, i, T)
        if role == "decode":
            return cost.decode_capacity(layout, i, o, T)
        return cost.colocated_capacity(layout, i, o, T)

    def _best_split(self, order, combo, role: str) -> tuple[float, tuple[int, ...]]:
        """Best of the candidate layer splits for one stage sequence: (capacity, layers)."""
        stages = self._stages(order, combo)
        S, L = len(stages), self.num_layers
        if S == 0 or S > L:
            return 0.0, ()
        probes = [self._probe(k, tp, i == 0, i == S - 1, role) for i, (k, tp, _) in enumerate(stages)]
        caps = [p[0] for p in probes]
        if min(caps) < 1 or sum(caps) < L:
            return 0.0, ()
        speed = [1.0 / p[1] for p in probes]
        mem = [float(c) for c in caps]
        ms, ss = sum(mem), sum(speed)
        blend = [m / ms + s / ss for m, s in zip(mem, speed)]
        candidates = {_integerize(w, caps, L) for w in (mem, speed, blend)}
        if role == "prefill":
            candidates.add(_fill_fastest([p[1] for p in probes], caps, L))
        best = (0.0, ())
        for layers in sorted(candidates):
            v = self._evaluate(stages, layers, role)
            if v > best[0]:
                best = (v, layers)
        return best

    def _polish(self, order, combo, layers, role, value) -> tuple[float, tuple[int, ...]]:
        """Steepest ascent over moves of one (or L/16) layers between two stages."""
        stages = self._stages(order, combo)
        S = len(stages)
        if S < 2:
            return value, layers
        caps = [self._probe(k, tp, i == 0, i == S - 1, role)[0] for i, (k, tp, _) in enumerate(stages)]
        steps = sorted({1, max(1, self.num_layers // 16)}, reverse=True) if S <= 4 else [1]
        cur, cur_v = list(layers), value
        evaluations = 0
        for _ in range(MAX_POLISH_ROUNDS):
            if evaluations > MAX_POLISH_EVALUATIONS:
                break
            best_v, best_l = cur_v, None
            for delta in steps:
                for i in range(S):
                    if cur[i] - delta < 1:
                        continue
                    for j in range(S):
                        if j == i or cur[j] + delta > caps[j]:
                            continue
                        trial = cur.copy()
                        trial[i] -= delta
                        trial[j] += delta
                        v = self._evaluate(stages, trial, role)
                        evaluations += 1
                        if v > best_v * (1 + 1e-9):
                            best_v, best_l = v, trial
            if best_l is None:
                break
            cur, cur_v = best_l, best_v
        return cur_v, tuple(cur)


def _kv_loads(c: LayoutChoice) -> tuple[float, float]:
    """What the busiest device pair of a KV hand-off carries, in layers (× bytes per layer and
    head share), against a TP1 counterpart (largest layers / TP of a stage) and a wide-TP one
    (largest layer count of a stage): a layer range on a TP-t stage exchanged with a TP-u stage
    puts 1 / max(t, u) of its bytes on each pair."""
    return (max((s.layers[1] - s.layers[0]) / s.tp for s in c.shapes),
            float(max(s.layers[1] - s.layers[0] for s in c.shapes)))


def _integerize(weights: Sequence[float], caps: Sequence[int], total: int) -> tuple[int, ...]:
    """Integer layer counts ∝ weights, each in [1, cap], summing to ``total`` (largest remainder)."""
    s = sum(weights)
    x = [total * w / s for w in weights]
    n = [min(c, max(1, int(v))) for v, c in zip(x, caps)]
    while sum(n) < total:
        i = max((j for j in range(len(n)) if n[j] < caps[j]), key=lambda j: (x[j] - n[j], -j))
        n[i] += 1
    while sum(n) > total:
        i = min((j for j in range(len(n)) if n[j] > 1), key=lambda j: (x[j] - n[j], j))
        n[i] -= 1
    return tuple(n)


def _fill_fastest(slopes: Sequence[float], caps: Sequence[int], total: int) -> tuple[int, ...]:
    """One layer per stage, the rest to the fastest stages up to their memory (prefill latency)."""
    n = [1] * len(slopes)
    left = total - len(n)
    for j in sorted(range(len(n)), key=lambda j: (slopes[j], j)):
        add = min(left, caps[j] - 1)
        n[j] += add
        left -= add
    return tuple(n)
