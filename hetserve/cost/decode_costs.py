"""The decode methods of ``cost.analytic.CostModel`` (kept apart from ``cost.decode``'s value
classes, which may be compiled: the interpreted ``CostModel`` inherits these)."""

# mypy: disable-error-code="attr-defined"
from __future__ import annotations

import math
from hetserve.cost.decode import DecodeLayer, DecodeRound, KernelDecodeLayer, RooflineDecodeLayer, StageDecode
from hetserve.cost.layout import ReplicaLayout, StageLayout, micro_batches_of


class DecodeCosts:
    """The decode methods of ``CostModel``: it reads the model, the efficiencies, the kernel
    pricing and the per-stage terms (``_rates``, ``allreduce_time`` …) from it."""

    def stage_decode(self, stage: StageLayout, batch: float, is_last: bool = False) -> StageDecode:
        """The stage's decode iteration for ``batch`` sequences, before their context."""
        m = self.model
        comm = 2 * self.allreduce_time(stage.devices, batch * m.hidden * m.dtype_bytes)
        head = self._head_time(stage, batch) if is_last else 0.0
        return StageDecode(stage.num_layers, self._decode_layer(stage, batch), comm, self.collectives_time(stage),
                           head, self.eff.step_overhead_s, self.multi_row_time(stage, batch, batch, is_last),
                           self.collective_bytes_time(stage, batch))

    def _decode_layer(self, stage: StageLayout, batch: float) -> DecodeLayer:
        """One decode layer of ``batch`` sequences as a function of their context: the kernel model's
        operators where it covers the stage, else the roofline (``prefill_costs.layer_time``), with attention's
        ``4 · q_dim`` FLOPs and its KV bytes per context token; the same arithmetic, term by term."""
        m, k, devices = self.model, self.kernels, stage.devices
        per_kv, q_flops, weights = m.kv_bytes_per_token_per_layer, 4.0 * m.q_dim, m.bytes_per_layer
        if k is not None and k.covers(devices):
            return KernelDecodeLayer(k.layer(devices, batch), q_flops, weights, per_kv, k.attention_rates(devices))
        flops = 2.0 * m.params_per_layer * batch
        compute, attention, memory = self._roofline_rates(stage, self.eff.decode_attention)
        return RooflineDecodeLayer(flops, q_flops, weights, per_kv, compute, attention, memory)

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
        split into): the pieces of ``decode_step_time``'s round (``DecodeRound.stage_times``)."""
        r = self.decode_round(layout, batch, micro_batches)
        return r.micro_batches, r.stage_times(context_tokens)

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
