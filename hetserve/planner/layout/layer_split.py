"""Layer split of one stage sequence (HexGen §4.2): how many layers each stage holds.

Candidates: HexGen's memory-proportional rule, speed-proportional, a blend and (prefill) fill the
fastest stages first, each repaired to fit memory (``integerize``); the best is then polished by
moving layers between stages while the capacity improves. Stage limits and speeds come from
probes: cost-model calls on one- and two-layer stages, cached per (class, TP, position, role).
Mixed into ``layout.LayoutSearch`` (it shares the search's context and caches).
"""

from __future__ import annotations

import heapq
from typing import Sequence

from hetserve.cost.layout import ReplicaLayout, StageLayout
from hetserve.planner.slo import slo_capacity

MAX_POLISH_ROUNDS = 40
MAX_POLISH_EVALUATIONS = 200
_DECODE_PROBE_BATCH = 16


class LayerSplits:
    """Layer splits and their capacity; expects ``ctx``, ``cost`` (the context's cost model with
    memoised stage prices, ``cost.memo``), ``num_layers``, ``min_kv``, ``_prompt`` and
    ``_probe_cache`` and ``_split_memo`` on the instance (``LayoutSearch`` sets them)."""

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
        cost, L, need = self.cost, self.num_layers, self.min_kv[role]
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
        """Capacity of ``stages`` holding ``layers``, memoised by what the cost model reads of
        them (``_sequence_key``): searches of different compositions price the same stage
        sequences over and over (a class left idle, the same GPUs on another machine)."""
        key = (self._sequence_key(stages), tuple(layers), role)
        hit = self._evaluated.get(key)
        if hit is None:
            hit = self._evaluated[key] = self._evaluate_fresh(stages, layers, role)
        return hit

    def _sequence_key(self, stages) -> int:
        """Per stage: GPU type, memory, TP degree and the link inside its class; between
        consecutive stages: the link between them. A layout's capacity depends on nothing else
        (devices of a class are interchangeable, ``PlanContext``), whatever the machines. As a
        small integer (equal keys, equal numbers): the memos keyed by it are looked up ~170,000
        times at 320 GPUs, and a nested tuple's hash is recomputed at every lookup."""
        stages = tuple(stages)
        key = self._sequence_keys.get(stages)
        if key is None:
            ctx = self.ctx
            bw, lat = ctx.cluster.bandwidth, ctx.cluster.latency
            parts = []
            for i, (k, tp, _) in enumerate(stages):
                members = ctx.classes[k]
                d = ctx.cluster.devices[members[0]]
                inner = (float(bw[members[0], members[1]]), float(lat[members[0], members[1]])) if tp > 1 or (
                    i + 1 < len(stages) and stages[i + 1][0] == k) else ()
                hop = ()
                if i + 1 < len(stages) and stages[i + 1][0] != k:
                    a, b = members[0], ctx.classes[stages[i + 1][0]][0]
                    hop = (float(bw[a, b]), float(lat[a, b]))
                parts.append((d.gpu.name, float(d.memory_bytes), tp, inner, hop))
            key = self._sequence_keys[stages] = self._sequence_ids.setdefault(tuple(parts), len(self._sequence_ids))
        return key

    def _evaluate_fresh(self, stages, layers, role: str) -> float:
        ctx = self.ctx
        parts, start = [], 0
        for (k, tp, off), n in zip(stages, layers):
            parts.append(StageLayout(ctx.classes[k][off:off + tp], (start, start + n)))
            start += n
        return self.layout_capacity(ReplicaLayout(tuple(parts)), role)

    def layout_capacity(self, layout: ReplicaLayout, role: str) -> float:
        """Requests per T that ``layout`` serves in ``role``; 0 if it lacks the role's minimum KV."""
        ctx, cost = self.ctx, self.cost
        if cost.kv_capacity_tokens(layout) < self.min_kv[role]:
            return 0.0
        T, i, o = ctx.period_s, ctx.input_tokens, ctx.output_tokens
        if ctx.slo is not None:
            return slo_capacity(cost, layout, role, i, o, T, ctx.slo)
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
        # the probes and the splits' capacities read only what ``_sequence_key`` names: stage
        # sequences alike in that are split alike (most of a large pool's searches repeat them)
        key = (self._sequence_key(stages), role)
        hit = self._split_memo.get(key)
        if hit is None:
            hit = self._split_memo[key] = self._best_split_fresh(stages, role)
        return hit

    def _best_split_fresh(self, stages, role: str) -> tuple[float, tuple[int, ...]]:
        S, L = len(stages), self.num_layers
        probes = [self._probe(k, tp, i == 0, i == S - 1, role) for i, (k, tp, _) in enumerate(stages)]
        caps = [p[0] for p in probes]
        if min(caps) < 1 or sum(caps) < L:
            return 0.0, ()
        speed = [1.0 / p[1] for p in probes]
        mem = [float(c) for c in caps]
        ms, ss = sum(mem), sum(speed)
        blend = [m / ms + s / ss for m, s in zip(mem, speed)]
        candidates = {integerize(w, caps, L) for w in (mem, speed, blend)}
        if role == "prefill":
            candidates.add(fill_fastest([p[1] for p in probes], caps, L))
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


def integerize(weights: Sequence[float], caps: Sequence[int], total: int) -> tuple[int, ...]:
    """Integer layer counts ∝ weights, each in [1, cap], summing to ``total`` (largest remainder).

    One layer at a time goes to the stage with the largest remainder ``x - n`` (the lowest index
    on ties) or, when over, comes from the one with the smallest; a heap holds the remainders, as
    each move changes only the moved stage's (a linear scan per layer dominated large plans)."""
    s = sum(weights)
    x = [total * w / s for w in weights]
    n = [min(c, max(1, int(v))) for v, c in zip(x, caps)]
    short = total - sum(n)
    step = 1 if short > 0 else -1  # add layers, or take them away (keys negated: x - n == -(n - x) exactly)

    def room(j: int) -> bool:
        return n[j] < caps[j] if step > 0 else n[j] > 1

    heap = [(step * (n[j] - x[j]), j) for j in range(len(n)) if short and room(j)]
    heapq.heapify(heap)
    while short and heap:
        _, j = heapq.heappop(heap)
        n[j] += step
        short -= step
        if room(j):
            heapq.heappush(heap, (step * (n[j] - x[j]), j))
    return tuple(n)


def fill_fastest(slopes: Sequence[float], caps: Sequence[int], total: int) -> tuple[int, ...]:
    """One layer per stage, the rest to the fastest stages up to their memory (prefill latency)."""
    n = [1] * len(slopes)
    left = total - len(n)
    for j in sorted(range(len(n)), key=lambda j: (slopes[j], j)):
        add = min(left, caps[j] - 1)
        n[j] += add
        left -= add
    return tuple(n)
