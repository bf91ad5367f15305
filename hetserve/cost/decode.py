"""What the cost model prices for a decode iteration: one stage's, and a replica's round through
its pipeline.

At a fixed batch a stage's decode time is a function of one number, the context its sequences
read, and a simple one: attention's products and KV reads grow with it, and nothing else (the
matrix products and weight reads, all-reduces, collectives, the LM head, the step's overheads)
reads it at all. ``StageDecode`` holds those terms and ``DecodeRound`` a replica's stages with their
hand-offs: what the batch fixes. A caller pricing many contexts at one batch (the simulator's
decode iterations; ``cost.memo`` keeps the terms) prices each context with a few multiplications.
``DecodeCosts`` (``cost.decode_costs``) is a part of ``cost.analytic.CostModel``.
"""

from __future__ import annotations

from dataclasses import dataclass


class DecodeLayer:
    """One decode layer of a fixed batch as a function of the context ``c`` its sequences read
    (``at``): attention's ``q_flops · c`` FLOPs, and the ``weights`` and ``per_kv`` bytes per
    context token read, beside what the batch fixes (``RooflineDecodeLayer``, ``KernelDecodeLayer``)."""

    __slots__ = ("q_flops", "weights", "per_kv")

    def __init__(self, q_flops: float, weights: float, per_kv: float):
        self.q_flops, self.weights, self.per_kv = float(q_flops), float(weights), float(per_kv)

    def at(self, c: float) -> float:
        raise NotImplementedError


class RooflineDecodeLayer(DecodeLayer):
    """``DecodeLayer`` by the roofline: the layer's ``flops`` and attention's at ``compute`` FLOP/s,
    or attention at ``attention`` FLOP/s beside them where that is set (not None); the bytes at
    ``memory`` bytes/s; the slower of the two."""

    __slots__ = ("flops", "compute", "attention", "memory")

    def __init__(self, flops: float, q_flops: float, weights: float, per_kv: float, compute: float,
                 attention: float | None, memory: float):
        super().__init__(q_flops, weights, per_kv)
        self.flops, self.compute, self.memory = float(flops), float(compute), float(memory)
        self.attention = attention

    def at(self, c: float) -> float:
        # ``max`` of the two written out: the first of equals, as ``max`` picks
        attention = self.attention
        if attention is not None:
            t = self.flops / self.compute + self.q_flops * c / attention
        else:
            t = (self.flops + self.q_flops * c) / self.compute
        u = (self.weights + c * self.per_kv) / self.memory
        return u if u > t else t


class KernelDecodeLayer(DecodeLayer):
    """``DecodeLayer`` by the kernel model: the ``layer``'s operators, and attention's products and
    KV reads at each GPU type's (FLOP/s, bytes/s) of ``rates``; the slowest type sets the pace, each
    type its slower term."""

    __slots__ = ("layer", "f0", "b0", "more")

    def __init__(self, layer: float, q_flops: float, weights: float, per_kv: float,
                 rates: tuple[tuple[float, float], ...]):
        super().__init__(q_flops, weights, per_kv)
        self.layer = float(layer)
        self.f0, self.b0 = float(rates[0][0]), float(rates[0][1])
        self.more: tuple[tuple[float, float], ...] = tuple((float(f), float(b)) for f, b in rates[1:])

    def at(self, c: float) -> float:
        # comparisons picking what ``max`` picks, the first of equals; the KV bytes as the layer's
        # bytes less its weights, the very float the roofline's sum gives
        weights = self.weights
        qc, kv = self.q_flops * c, (weights + c * self.per_kv) - weights
        slowest, t = qc / self.f0, kv / self.b0
        if t > slowest:
            slowest = t
        for f, b in self.more:
            t, u = qc / f, kv / b
            if u > t:
                t = u
            if t > slowest:
                slowest = t
        return self.layer + slowest


@dataclass(frozen=True, slots=True)
class StageDecode:
    """One stage's decode iteration at a fixed batch, as a function of the context it reads:
    ``layers · (per_layer.at(c) + comm_s)`` plus the terms paid once, for ``c`` context tokens."""

    layers: int
    per_layer: DecodeLayer  # one layer's compute and memory at context c
    comm_s: float  # one layer's TP all-reduces
    collectives_s: float  # the TP group's fixed cost per iteration
    head_s: float  # the LM head and the turn-around (last stage; else 0)
    step_s: float  # ``step_overhead_s``
    multi_row_s: float
    collective_bytes_s: float

    def at(self, context_tokens: float) -> float:
        # one fixed order of the sum: the same float wherever a decode step is priced
        return (self.layers * (self.per_layer.at(context_tokens) + self.comm_s) + self.collectives_s + self.head_s
                + self.step_s + self.multi_row_s + self.collective_bytes_s)


@dataclass(frozen=True, slots=True)
class DecodeRound:
    """A replica's decode iteration at a fixed batch split into ``micro_batches``, as a function of
    the context the batch reads (``CostModel.decode_step_time`` says how a round is priced)."""

    micro_batches: int
    stages: tuple[StageDecode, ...]  # each at batch / micro_batches
    hops_s: float  # the pipeline's hand-offs of one micro-batch
    turn_s: float  # the turn-around the last stage carries at most (``iteration_overhead_s``)
    hold: float  # the share of the turn-around that holds the last stage
    shared_cores: bool  # CPU worker slots: the front end's wait holds the slowest stage too

    def stage_times(self, context_tokens: float) -> list[float]:
        """Each stage's time for one micro-batch when the whole batch reads ``context_tokens``."""
        c = context_tokens / self.micro_batches
        return [s.at(c) for s in self.stages]

    def turn_around(self, stage_times: list[float]) -> float:
        """The turn-around a micro-batch's last stage carries (``iteration_overhead_s``, at most that
        stage's time in ``stage_times``): the part ``hold`` shares out."""
        return min(self.turn_s, stage_times[-1])

    def at(self, context_tokens: float, dispatch_s: float = 0.0) -> float:
        m = self.micro_batches
        c = context_tokens / m  # ``stage_times``, written out: this runs at every decode segment
        times = [s.at(c) for s in self.stages]
        ring = sum(times) + self.hops_s + dispatch_s
        if m == 1:
            return ring
        free = (1.0 - self.hold) * self.turn_around(times)
        wait = dispatch_s if self.shared_cores else 0.0
        return max(ring, m * (max(times[:-1] + [times[-1] - free]) + wait), m * free)

