"""KV-friendlier layout alternatives of one (composition, role), for ``pool.Evaluator``.

**Alternatives for the KV links** (``alternatives`` / ``options``). The capacity-best layout is
not always best for the pool layout: a decode replica of 4 × TP1 stages receives its KV cache
over four times as many device pairs as one TP4 stage, which wins when the links between the
prefill and decode groups are slow (HexGen-2 App. E). So besides the best layout each
(composition, role) keeps up to ``MAX_ALTERNATIVES - 1`` others, found lazily (only when an
evaluator asks, i.e. when a pool layout's flow is limited by KV edges): the Pareto frontier of
the TP splits already scored over (capacity ↑, largest layers-per-device of a stage ↓ — the
bytes the busiest KV pair carries), keeping the one that spreads the KV widest, plus the
same shapes in reversed class order (HexGen-2 App. A adjusts the stage order of both phases
to minimise KV cost: which machine holds which layers decides which links carry them). No
alternative has more capacity than the best, so min(Σ prefill, Σ decode) of best capacities
stays an upper bound on any choice of alternatives. ``pool.Evaluator`` picks one per group.
"""

from __future__ import annotations

from typing import Sequence

from hetserve.cost.layout import ReplicaLayout
from hetserve.planner.layout.choice import LayoutChoice, StageShape, remap as _remap

# Layouts kept per (composition, role) for the evaluator to choose from (the best included), and
# the least capacity an alternative may have, relative to the best.
MAX_ALTERNATIVES = 4
MIN_ALTERNATIVE_FRACTION = 0.25
KV_MARGIN = 0.8  # an alternative must cut a KV load by at least 20% to be kept


class KVAlternatives:
    """``alternatives`` / ``options``; mixed into ``layout.LayoutSearch`` (reads its scored TP
    splits ``_scored`` and calls its ``choice``, ``_reversed``, ``_polish`` and ``materialize``)."""

    def alternatives(self, comp: tuple[tuple[int, int], ...], role: str) -> tuple[LayoutChoice, ...]:
        """The best layout first, then up to ``MAX_ALTERNATIVES - 1`` KV-friendlier ones (see the
        module docstring); () when nothing fits. Cached by (composition, role)."""
        key = (comp, role)
        hit = self._alt_cache.get(key)
        if hit is not None:
            return hit
        best = self.choice(comp, role)
        out: tuple[LayoutChoice, ...] = ()
        rep = self._representative(comp, role)
        if rep is not None:  # an isomorphic composition's alternatives, on this one's classes
            out = tuple(_remap(c, rep[1]) for c in self.alternatives(rep[0], role))
        elif best is not None:
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
        kept = [kv_loads(best)]
        for combo, c in sorted(cands, key=lambda x: (-x[1].capacity, kv_loads(x[1]), x[0])):
            loads = kv_loads(c)
            if any(all(loads[t] < KV_MARGIN * k[t] for k in kept) for t in range(len(loads))):
                frontier.append((combo, c))
                kept.append(loads)
        # the widest spread for each load measure first, then the highest capacities
        picked = []
        for t in range(len(kept[0])):
            if frontier:
                pick = min(frontier, key=lambda x: (kv_loads(x[1])[t], -x[1].capacity, x[0]))
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

def kv_loads(c: LayoutChoice) -> tuple[float, float]:
    """What the busiest device pair of a KV hand-off carries, in layers (× bytes per layer and
    head share), against a TP1 counterpart (largest layers / TP of a stage) and a wide-TP one
    (largest layer count of a stage): a layer range on a TP-t stage exchanged with a TP-u stage
    puts 1 / max(t, u) of its bytes on each pair."""
    return (max((s.layers[1] - s.layers[0]) / s.tp for s in c.shapes),
            float(max(s.layers[1] - s.layers[0] for s in c.shapes)))

