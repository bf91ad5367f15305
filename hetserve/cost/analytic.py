"""The analytic cost model: one formula in one place, for the planner, simulator and runtime.

Starts from HexGen Table 1 / Appendix B and refines it:

* real parameter counts per layer (``ModelSpec.params_per_layer``: gated FFN, GQA) instead of 12H²;
* an attention term that grows with context (causal prefill: 2·q_dim·s² FLOPs per layer;
  decode: 4·q_dim·context);
* compute and memory time combined as a roofline, ``max(FLOPs / achieved FLOP/s, bytes /
  achieved bytes/s)``, with the achieved fractions in ``Efficiency`` (``cost/efficiency.py``) so calibration can set them;
* TP all-reduce as HexGen's bulk-synchronous α-β model: two all-reduces per layer, each a
  reduce-scatter and an all-gather superstep costing ``max_d Σ_{d'≠d} (α + bytes/(t·β))``;
* PP hand-off over the fastest link between the two groups (HexGen Eq. 6);
* KV transfer between a prefill and a decode replica layer-matched and TP-shard-matched,
  all device pairs in parallel, sharing the NICs and site pipes they cross
  (``hetserve.cost.network``, max-min fair); time = the last part delivered (HexGen-2 §3.2,
  Appendix A, with docs/design.md's shared links). ``*_resource_bytes`` say which shared resources a
  request's KV and PP hand-offs load, for the planner's capacity nodes. These live in
  ``cost/transfers.py`` (``TransferCosts``, a part of ``CostModel``).

In a TP group the slowest device sets the pace (bulk-synchronous), so a stage uses the minimum
FLOP/s and memory bandwidth over its devices. Units: seconds, bytes, FLOP/s, bytes/s.
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

from hetserve.cost.decode import DecodeRound, StageDecode  # noqa: F401 (re-exported)
from hetserve.cost.decode_costs import DecodeCosts
from hetserve.cost.device_memory import device_activation_bytes, device_kv_bytes_per_token, device_weight_bytes
from hetserve.cost.efficiency import Efficiency, load_efficiency  # noqa: F401 (re-exported: the knobs' old home)
from hetserve.cost.kernel_pricing import KernelPricing
from hetserve.cost.layout import ReplicaLayout, StageLayout
from hetserve.cost.network import concurrent_time
from hetserve.cost.prefill_batch import PrefillBatch  # noqa: F401 (re-exported: its old home)
from hetserve.cost import prefill_costs
from hetserve.cost.prefill_costs import LOGPROB_BYTES, TP_STEP_COLLECTIVES  # noqa: F401 (re-exported)
from hetserve.cost.request_mix import RequestMix
from hetserve.cost.transfers import TransferCosts
from hetserve.specs.cluster import Cluster
from hetserve.specs.model import ModelSpec

# HexGen-2 Appendix A: one replica's memory need = parameters + the KV cache of 32 requests.
REPLICA_MEMORY_BATCH = 32
# HexGen-2 §3.2: node and edge capacities are requests per period T ("e.g. 10 minutes").
DEFAULT_PERIOD_S = 600.0
# stages whose prompt terms a model keeps before it starts afresh (a layout search prices ever new ones)
STAGES_KEPT = 100_000


# The efficiency a CostModel holds when its caller passed none. Identity, not equality, marks it:
# a model rebuilt from ``cost.eff`` (the simulator's memoised twin) keeps the kernel model, and any
# Efficiency a caller builds or loads (a calibration) keeps the roofline it was fitted through.
DEFAULT_EFFICIENCY = Efficiency()
_KERNELS_BY_DEFAULT = True


class CostModel(TransferCosts, DecodeCosts):
    """Prices stages and replicas of ``model`` on ``cluster``. Pure functions of their inputs.

    Stages on real GPUs: layers, LM head and in-box all-reduces from measured kernels
    (``cost/kernel_pricing.py``) unless an ``efficiency`` is passed (a calibration wins) or
    ``kernels=False``; CPU worker slots (``cpu_cores``): the roofline. ``pricing()`` says which."""

    def __init__(self, cluster: Cluster, model: ModelSpec, efficiency: Efficiency | None = None,
                 kernels: bool | None = None):
        self.cluster, self.model = cluster, model
        self.eff = efficiency or DEFAULT_EFFICIENCY
        use_kernels = (self.eff is DEFAULT_EFFICIENCY and _KERNELS_BY_DEFAULT) if kernels is None else kernels
        if not use_kernels and self.eff is DEFAULT_EFFICIENCY:
            self.eff = Efficiency()  # an equal copy: a model rebuilt from ``self.eff`` keeps the roofline too
        self.kernels = KernelPricing(cluster, model) if use_kernels else None
        devs = cluster.devices
        peaks = _roofline_peaks(devs, self.eff.reference_gpu)
        self._flops = [g.fp16_flops * self.eff.compute for g in peaks]
        self._membw = [g.mem_bandwidth * self.eff.memory for g in peaks]
        if self.kernels is not None:
            self._flops, self._membw = self.kernels.roofline_rates(self._flops, self._membw)
        self._memory = [d.memory_bytes * self.eff.usable_memory for d in devs]
        self._alpha = cluster.latency
        self._beta = cluster.bandwidth
        self._stage_prompts: dict[tuple, prefill_costs.StagePrompt] = {}

    # ================================================================== communication
    def pricing(self, devices: Iterable[int] | None = None) -> dict[str, str]:
        """{GPU type: ``fitted`` / ``transferred`` / ``roofline``}: how each type's stages are priced;
        ``devices`` (indices): only their types, e.g. a plan's, so a figure's source names no type
        that priced none of it (a pool's other GPU types)."""
        if self.kernels is None:
            devs = self.cluster.devices if devices is None else [self.cluster.devices[i] for i in devices]
            return {d.gpu.name: "roofline" for d in devs}
        return self.kernels.sources(devices)

    def allreduce_time(self, devices: Sequence[int], nbytes: float) -> float:
        """One all-reduce of ``nbytes`` over a TP group: inside one box from the kernel model's fitted
        curves where it applies, else HexGen Eq. 5 (two BSP supersteps)."""
        t = len(devices)
        if t <= 1:
            return 0.0
        if self.kernels is not None:
            fitted = self.kernels.allreduce(devices, nbytes)
            if fitted is not None:
                return fitted
        chunk = nbytes / t
        worst = max(sum(self._alpha[d, e] + chunk / self._beta[d, e] for e in devices if e != d) for d in devices)
        machines = {self.cluster.devices[d].machine for d in devices}
        if len(machines) > 1:  # a group across boxes: every device's chunks share the NICs at once
            path = self.cluster.path
            worst = max(worst, concurrent_time([(path(d, e), chunk) for d in devices for e in devices if e != d]))
        return 2.0 * float(worst)

    def p2p_time(self, src: int, dst: int, nbytes: float) -> float:
        """α + bytes/β for one point-to-point message."""
        if src == dst:
            return 0.0
        return float(self._alpha[src, dst] + nbytes / self._beta[src, dst])

    def pp_handoff_time(self, a: StageLayout, b: StageLayout, tokens: float) -> float:
        """Activations of ``tokens`` tokens from stage a to stage b over their fastest link (Eq. 6)."""
        nbytes = tokens * self.model.hidden * self.model.dtype_bytes
        return min(self.p2p_time(d, e, nbytes) for d in a.devices for e in b.devices)

    # ================================================================== per stage
    def _roofline_rates(self, stage: StageLayout, attn_eff: float = 0.0) -> tuple[float, float | None, float]:
        """(FLOP/s, attention's FLOP/s, bytes/s) of the stage's TP group, work split evenly over it
        and its slowest device pacing. Attention's score and value products run at ``compute`` like
        the rest (None), or at ``attn_eff`` of peak (default ``Efficiency.attention``) where a
        calibration set one (0: the same as ``compute``)."""
        t = stage.tp
        f = min(self._flops[d] for d in stage.devices)
        m = min(self._membw[d] for d in stage.devices)
        attn_eff = attn_eff or self.eff.attention
        return t * f, (t * (f / self.eff.compute * attn_eff) if attn_eff > 0 else None), t * m

    # the per-stage formulas for prompt tokens and fixed costs: ``cost.prefill_costs.StagePrompt``
    def stage_prompt(self, stage: StageLayout) -> prefill_costs.StagePrompt:
        """The stage's prompt-side terms, read once per stage (its devices and layers)."""
        key = (stage.devices, stage.layers)
        p = self._stage_prompts.get(key)
        if p is None:
            if len(self._stage_prompts) >= STAGES_KEPT:
                self._stage_prompts.clear()
            p = self._stage_prompts[key] = prefill_costs.StagePrompt(self, stage)
        return p

    def collectives_time(self, stage: StageLayout) -> float:
        return self.stage_prompt(stage).collectives_s

    def collective_bytes_time(self, stage: StageLayout, rows: float) -> float:
        return self.stage_prompt(stage).collective_bytes(rows)

    def multi_row_time(self, stage: StageLayout, rows: float, head_rows: float, is_last: bool) -> float:
        return self.stage_prompt(stage).multi_row(rows, head_rows, is_last)

    def _head_time(self, stage: StageLayout, rows: float) -> float:
        return self.stage_prompt(stage).head(rows)

    def prompt_logprob_time(self, stage: StageLayout, positions: float) -> float:
        return self.stage_prompt(stage).prompt_logprobs(positions)

    def stage_prefill_time(self, stage: StageLayout, batch: PrefillBatch, is_last: bool = False) -> float:
        return prefill_costs.stage_prefill_time(self, stage, batch, is_last)

    def stage_weight_bytes(self, stage: StageLayout, is_first: bool, is_last: bool) -> float:
        """Weight bytes on the stage's fullest device: its leader (see ``device_weight_bytes``)."""
        return device_weight_bytes(self.model, stage.num_layers, stage.tp, is_first, is_last, is_leader=True)

    def stage_memory(self, stage: StageLayout, kv_tokens: float, is_first: bool = False,
                     is_last: bool = False) -> float:
        """Bytes per device: weights / TP + KV of ``kv_tokens`` / TP + activation buffers."""
        m = self.model
        kv = kv_tokens * device_kv_bytes_per_token(m, stage.num_layers, stage.tp)
        act = device_activation_bytes(m, self.eff.activation_buffers, self.eff.activation_tokens)
        return self.stage_weight_bytes(stage, is_first, is_last) + kv + act

    def stage_kv_capacity(self, stage: StageLayout, is_first: bool = False, is_last: bool = False) -> float:
        """Tokens of KV cache the stage can hold (negative: the weights alone do not fit)."""
        m = self.model
        free = min(self._memory[d] for d in stage.devices) - self.stage_memory(stage, 0, is_first, is_last)
        return free * stage.tp / (stage.num_layers * m.kv_bytes_per_token_per_layer)

    # ================================================================== per replica
    def _ends(self, layout: ReplicaLayout):
        last = len(layout.stages) - 1
        return [(s, i == 0, i == last) for i, s in enumerate(layout.stages)]

    def kv_capacity_tokens(self, layout: ReplicaLayout) -> float:
        """Tokens of KV the whole replica can hold: its tightest stage decides."""
        return min(self.stage_kv_capacity(s, f, l) for s, f, l in self._ends(layout))

    def fits(self, layout: ReplicaLayout, min_kv_tokens: float = 0.0) -> bool:
        """Weights, activation buffers and ``min_kv_tokens`` of KV fit on every device."""
        return self.kv_capacity_tokens(layout) >= max(min_kv_tokens, 1.0)

    def prefill_time(self, layout: ReplicaLayout, batch: PrefillBatch) -> float:
        return prefill_costs.prefill_time(self, layout, batch)

    def ttft(self, layout: ReplicaLayout, prompt_tokens: int) -> float:
        """Time to first token for one prompt on an idle replica."""
        return self.prefill_time(layout, PrefillBatch.single(prompt_tokens))

    def max_decode_batch(self, layout: ReplicaLayout, tokens_per_request: float) -> int:
        """Largest number of requests that run at once: their full KV (prompt + output) must fit,
        and the engine runs at most ``Efficiency.max_batch`` (the simulator and runtime cap too)."""
        if tokens_per_request <= 0:
            raise ValueError("tokens_per_request must be positive")
        return max(0, min(self.eff.max_batch, int(self.kv_capacity_tokens(layout) // tokens_per_request)))

    # ------------------------------------------------------------------ capacities (HexGen-2 App. A)
    # ``choices`` (mean sequences a request decodes, OpenAI ``n``) and ``scoring`` (share of requests
    # scoring their prompt) shape the mean request as ``cost.request_mix.RequestMix`` says; the
    # defaults are plain completions.
    def prefill_capacity(self, layout: ReplicaLayout, input_tokens: float, period_s: float = DEFAULT_PERIOD_S,
                         choices: float = 1.0, scoring: float = 0.0) -> float:
        """Requests a prefill replica finishes in ``period_s``: T / latency (compute-bound)."""

        mix = RequestMix(max(1, round(input_tokens)), 0.0, choices, scoring)
        return period_s / self.prefill_time(layout, mix.prompts(1.0))

    def _requests_at_once(self, layout: ReplicaLayout, kv_tokens: float, choices: float) -> int:
        """Requests of ``kv_tokens`` each that run at once, their choices within the sequence cap."""
        return min(self.max_decode_batch(layout, kv_tokens), int(self.eff.max_batch // max(choices, 1.0)))

    def decode_throughput(self, layout: ReplicaLayout, input_tokens: float, output_tokens: float,
                          choices: float = 1.0) -> tuple[int, float]:
        """(largest batch in sequences, output tokens/s) of a decode replica at that batch."""
        b = self._requests_at_once(layout, choices * (input_tokens + output_tokens), choices)
        if b == 0:
            return 0, 0.0
        rows = b * choices
        step = self.decode_step_time(layout, rows, rows * (input_tokens + output_tokens / 2))
        return round(rows), rows / step

    def decode_capacity(self, layout: ReplicaLayout, input_tokens: float, output_tokens: float,
                        period_s: float = DEFAULT_PERIOD_S, choices: float = 1.0) -> float:
        """Requests a decode replica finishes in ``period_s``: max batch · T / per-request latency."""
        _, tokens_per_s = self.decode_throughput(layout, input_tokens, output_tokens, choices)
        return period_s * tokens_per_s / max(choices * output_tokens, 1.0)

    def colocated_capacity(self, layout: ReplicaLayout, input_tokens: float, output_tokens: float,
                           period_s: float = DEFAULT_PERIOD_S, choices: float = 1.0, scoring: float = 0.0) -> float:
        """Requests a colocated (HexGen / vLLM-style) replica finishes in ``period_s``.

        The steady state of the engine's *mixed* iterations (``mixed_step_time``; the runtime and
        the simulator's default): the batch stays at its largest size ``B`` and every step each
        running request gains a token, so ``p = B / s_out`` requests finish per step and as many
        prompts join. Prompts join in the steps where a request finished (a reservation frees
        room only then), and finishes per step are ~Poisson(p) once lengths are mixed: a share
        ``1 − e^(−p)`` of the steps carry prompts, ``p / (1 − e^(−p))`` each. A prompt riding in a
        decode step shares that step's weight reads, so it costs less than its stand-alone TTFT;
        prompts arriving together cost more than spread out (the roofline's max). Checked against
        the simulator in ``tests/sim/test_capacity_agreement.py`` (the older
        ``T / (TTFT + s_out / decode tokens per s)`` was 9–17 % low there, a fluid "one prompt
        every 1/p steps" 5–14 % high). Left out: the token budget per step (the first prompt
        always gets in) and the batch's bias to long requests (the batch holds the mean
        footprint ``s_in + s_out``; on the Azure trace the time-weighted one is 1.7 % larger).
        With ``choices`` a request runs that many rows and holds the prompt's shared blocks once.
        """

        mix = RequestMix(input_tokens, output_tokens, choices, scoring)
        b = self._requests_at_once(layout, mix.kv_tokens(shares=True), choices)
        if b == 0:
            return 0.0
        rows = b * choices
        context = rows * (input_tokens + output_tokens / 2)
        decode = self.decode_step_time(layout, rows, context)
        joins = b / max(output_tokens, 1.0)  # requests finishing (and prompts joining) per step
        share = -math.expm1(-joins)  # of the steps that carry prompts: those in which a request finished
        k = joins / share  # prompts per such step
        mixed = self.mixed_step_time(layout, rows, context, mix.prompts(k))
        step = share * mixed + (1.0 - share) * decode
        return period_s * joins / step

    def mixed_step_time(self, layout: ReplicaLayout, decode_batch: int, decode_context: float,
                        prompts: PrefillBatch, micro_batches: int | None = None, remember: bool = True,
                        decode_s: float | None = None) -> float:
        return prefill_costs.mixed_step_time(self, layout, decode_batch, decode_context, prompts, micro_batches,
                                             remember, decode_s)

    def replica_memory_required(self, input_tokens: float, output_tokens: float) -> float:
        """HexGen-2 App. A: parameters + 32 requests' KV cache, in bytes."""
        m = self.model
        return m.weight_bytes + REPLICA_MEMORY_BATCH * m.kv_bytes_per_token * (input_tokens + output_tokens)


def _roofline_peaks(devices, reference_gpu: str | None) -> list:
    """The GPU type whose datasheet peaks each device's roofline takes: its own, except on a CPU worker
    slot (``cpu_cores``) where a calibration names the type its fractions were fitted against
    (``Efficiency.reference_gpu``): the slots all run at that CPU's measured speed, whatever type
    their machine names for its price."""
    if reference_gpu is None or all(d.cpu_cores is None for d in devices):
        return [d.gpu for d in devices]
    ref = next((d.gpu for d in devices if d.gpu.name == reference_gpu), None)
    if ref is None:
        from hetserve.specs.gpus import gpu

        ref = gpu(reference_gpu, "efficiency", "reference_gpu")
    return [ref if d.cpu_cores is not None else d.gpu for d in devices]
