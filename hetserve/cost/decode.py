"""What the cost model prices for a decode iteration: one stage's, and a replica's round through
its pipeline.

At a fixed batch a stage's decode time is a function of one number, the context its sequences
read, and a simple one: each layer's compute and its memory traffic are each a line in the
context (attention's products and KV reads grow with it, the matrix products and weight reads do
not), the layer takes the larger, and everything else (all-reduces, collectives, the LM head, the
step's overheads) does not read the context at all. ``StageDecode`` holds those lines and
``DecodeRound`` a replica's stages with their hand-offs: what the batch fixes. A caller pricing
many contexts at one batch (the simulator's decode iterations; ``cost.memo`` keeps them) prices
each context with a few multiplications. ``DecodeCosts`` is a part of ``cost.analytic.CostModel``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hetserve.cost.layout import ReplicaLayout, StageLayout, micro_batches_of


@dataclass(frozen=True, slots=True)
class StageDecode:
    """One stage's decode iteration at a fixed batch, as a function of the context it reads.

    Per layer: ``max(compute_s + compute_per_token · c, memory_s + memory_per_token · c) + comm_s``
    for ``c`` context tokens; ``layers`` of those, plus ``fixed_s`` once."""

    layers: int
    compute_s: float
    compute_per_token: float
    memory_s: float
    memory_per_token: float
    comm_s: float  # one layer's TP all-reduces
    fixed_s: float  # collectives' fixed cost, the LM head and turn-around (last stage), overheads

    def at(self, context_tokens: float) -> float:
        c = context_tokens
        per_layer = max(self.compute_s + self.compute_per_token * c, self.memory_s + self.memory_per_token * c)
        return self.layers * (per_layer + self.comm_s) + self.fixed_s


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

    def at(self, context_tokens: float, dispatch_s: float = 0.0) -> float:
        times = self.stage_times(context_tokens)
        ring = sum(times) + self.hops_s + dispatch_s
        m = self.micro_batches
        if m == 1:
            return ring
        free = (1.0 - self.hold) * min(self.turn_s, times[-1])
        wait = dispatch_s if self.shared_cores else 0.0
        return max(ring, m * (max(times[:-1] + [times[-1] - free]) + wait), m * free)


class DecodeCosts:
    """The decode methods of ``CostModel``: it reads the model, the efficiencies, the kernel
    pricing and the per-stage terms (``_rates``, ``allreduce_time`` …) from it."""

    def stage_decode(self, stage: StageLayout, batch: float, is_last: bool = False) -> StageDecode:
        """The stage's decode iteration for ``batch`` sequences, before their context."""
        m, k = self.model, self.kernels
        q_flops, kv_bytes = 4.0 * m.q_dim, m.kv_bytes_per_token_per_layer
        if k is not None and k.covers(stage.devices):
            # the kernel model's operators, then attention's products and KV reads on its roofline
            layer, per_token = k.layer(stage.devices, batch), k.attention(stage.devices, q_flops, kv_bytes)
            lines = (layer, per_token, layer, per_token)
        else:
            compute, attention, memory = self._rates(stage, self.eff.decode_attention)
            lines = (2.0 * m.params_per_layer * batch / compute, q_flops / attention,
                     m.bytes_per_layer / memory, kv_bytes / memory)
        comm = 2 * self.allreduce_time(stage.devices, batch * m.hidden * m.dtype_bytes)
        fixed = (self.collectives_time(stage) + (self._head_time(stage, batch) if is_last else 0.0)
                 + self.eff.step_overhead_s + self.multi_row_time(stage, batch, batch, is_last)
                 + self.collective_bytes_time(stage, batch))
        return StageDecode(stage.num_layers, *lines, comm, fixed)

    def stage_decode_time(self, stage: StageLayout, batch: float, context_tokens: float,
                          is_last: bool = False) -> float:
        """One decode iteration for ``batch`` sequences holding ``context_tokens`` in total."""
        return self.stage_decode(stage, batch, is_last).at(context_tokens)

    def decode_round(self, layout: ReplicaLayout, batch: float, micro_batches: int | None = None) -> DecodeRound:
        """The replica's decode iteration for ``batch`` sequences (> 0), before their context."""
        stages = layout.stages
        m = max(1, min(micro_batches_of(micro_batches, len(stages)), math.ceil(batch)))
        b, last = batch / m, len(stages) - 1
        hops = sum(self.pp_handoff_time(s, stages[i + 1], b) for i, s in enumerate(stages[:-1]))
        shared = self._on_shared_cores(layout)
        return DecodeRound(m, tuple(self.stage_decode(s, b, i == last) for i, s in enumerate(stages)), hops,
                           self.eff.iteration_overhead_s, self._turn_hold(shared), shared)

    def decode_step_time(self, layout: ReplicaLayout, batch: float, context_tokens: float,
                         micro_batches: int | None = None, dispatch_s: float = 0.0) -> float:
        """Time for every sequence of the batch to gain one token (= TPOT at this batch).

        A pipeline of S stages runs ``m`` micro-batches (default ``min(S, batch)``) so all stages
        stay busy: one round takes ``max(Σ stage + hand-offs + dispatch, m · slowest stage)`` at
        batch/m each. ``dispatch_s``: what a micro-batch waits between its last stage and its next
        step on the first (the serving front end streaming its tokens and its GIL, ``sim.hosts``):
        on the ring's latency; where the devices are CPU worker slots sharing a host's cores it
        also holds the slowest stage once per micro-batch (the front end takes a core the stages
        need): on the CPU demo's two-stage pipeline two micro-batches pay the front end's wait
        twice a round through HTTP, one micro-batch once.

        The turn-around (``iteration_overhead_s``, priced on the last stage) holds that stage for
        the share ``Efficiency.turn_hold`` of it while other micro-batches are in flight; the rest
        overlaps their stages, and one front end turning every micro-batch is the bound instead
        (``m ·`` that rest). ``hetserve calibrate`` measures the share from a two-stage pipeline
        decoding two sequences beside one; uncalibrated it is all of it on CPU worker slots and
        none on GPU hosts (``_turn_hold``).
        """
        if batch <= 0:
            return 0.0
        return self.decode_round(layout, batch, micro_batches).at(context_tokens, dispatch_s)

    def micro_batch_stage_times(self, layout: ReplicaLayout, batch: float, context_tokens: float,
                                micro_batches: int | None = None) -> tuple[int, list[float]]:
        """(``m``, each stage's decode time for one of the ``m`` micro-batches ``batch`` sequences
        split into): the pieces of ``decode_step_time``'s round (calibration solves the turn-around's
        hold from them)."""
        r = self.decode_round(layout, batch, micro_batches)
        return r.micro_batches, r.stage_times(context_tokens)

    def turn_around(self, stage_times: list[float]) -> float:
        """The turn-around a micro-batch's last stage carries (``iteration_overhead_s``, at most that
        stage's time in ``micro_batch_stage_times``): the part ``turn_hold`` shares out."""
        return min(self.eff.iteration_overhead_s, stage_times[-1])

    def _turn_hold(self, shared_cores: bool) -> float:
        """The share of the turn-around that holds a pipeline's last stage (``decode_step_time``):
        calibrated, or by the host: all of it where worker slots share cores, none on GPU hosts."""
        if self.eff.turn_hold is not None:
            return self.eff.turn_hold
        return 1.0 if shared_cores else 0.0

    def _on_shared_cores(self, layout: ReplicaLayout) -> bool:
        """Whether the replica's devices are CPU worker slots sharing a host's cores (``cpu_cores``),
        where the front end computes beside the stages. Uncalibrated, the turn-around holds the last
        stage there and overlaps on GPU hosts: on a GPU host the served two-stage pipeline's round
        matches the overlap (the hold prices it about 1.5x), and on CPU slots sharing two cores the
        hold predicts the served runs better than the overlap (docs/cost-model.md)."""
        devices = self.cluster.devices
        return any(devices[d].cpu_cores is not None for d in layout.devices)
