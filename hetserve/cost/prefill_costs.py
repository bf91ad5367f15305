"""The per-stage formulas of ``cost.analytic.CostModel`` for a step's prompt tokens and fixed costs, as
free functions of the model (``cost``): its methods of the same names call these.

They live apart so the compiled build (``make fast-sim``) can compile them (``CostModel`` itself
stays interpreted: it is built and subclassed in ways native classes refuse); the simulator prices
a mixed step at nearly every arrival. Within this module the formulas call each other directly;
what a subclass may remember (``allreduce_time``, ``stage_prefill_time``, ``pp_handoff_time``,
``decode_step_time``) is asked of the model. Arguments that are counts or means (a micro-batch's
rows) stay unannotated: either kind of number keeps Python's arithmetic."""

from __future__ import annotations

from typing import Any, Protocol

from hetserve.cost.efficiency import Efficiency
from hetserve.cost.kernel_pricing import KernelPricing
from hetserve.cost.layout import ReplicaLayout, StageLayout
from hetserve.cost.prefill_batch import PrefillBatch
from hetserve.specs.model import ModelSpec


class CostModel(Protocol):
    """What these formulas read of ``cost.analytic.CostModel`` (which calls them), and what they
    ask of it that a subclass may remember."""

    model: ModelSpec
    eff: Efficiency
    kernels: KernelPricing | None
    _membw: Any  # per device: a list, or what the kernel pricing made of it

    def _roofline_rates(self, stage: StageLayout, attn_eff: float = 0.0) -> tuple[float, float | None, float]: ...

    def allreduce_time(self, devices: Any, nbytes: float) -> float: ...

    def stage_prefill_time(self, stage: StageLayout, batch: PrefillBatch, is_last: bool = False) -> float: ...

    def pp_handoff_time(self, a: StageLayout, b: StageLayout, tokens: float) -> float: ...

    def decode_step_time(self, layout: ReplicaLayout, batch: float, context_tokens: float,
                         micro_batches: int | None = None, dispatch_s: float = 0.0) -> float: ...


# Collectives a TP group runs per iteration besides its layers' two all-reduces each: the leader
# broadcasts the step (``broadcast_object_list``: its size, then its bytes) and the stage's input
# activations to the group (runtime/worker.py ``_next`` / ``_compute``; vLLM broadcasts its step
# metadata the same way).
TP_STEP_COLLECTIVES = 3
# Bytes of one logit in the log-softmax of prompt logprobs: the runtime computes it in float32
# whatever the served dtype (``runtime/sampling``'s ``token_logprobs``).
LOGPROB_BYTES = 4


def roofline(cost: CostModel, stage: StageLayout, flops: Any, nbytes: Any, attn_flops: Any = 0.0,
             attn_eff: float = 0.0) -> Any:
    """The stage's time for ``flops`` and ``attn_flops`` (``_roofline_rates``) and ``nbytes``."""
    compute, attention, memory = cost._roofline_rates(stage, attn_eff)
    if attention is not None:
        return max(flops / compute + attn_flops / attention, nbytes / memory)
    return max((flops + attn_flops) / compute, nbytes / memory)


def layer_time(cost: CostModel, stage: StageLayout, rows: Any, flops: Any, nbytes: Any, attn_flops: Any,
               attn_eff: float = 0.0) -> Any:
    """One layer of the stage at ``rows`` tokens: the kernel model's operators plus attention's
    products and KV traffic (``nbytes`` beyond the layer's weights) where it covers the stage,
    else the roofline of ``flops`` and ``nbytes``."""
    k = cost.kernels
    if k is not None and k.covers(stage.devices):
        return k.layer(stage.devices, rows) + k.attention(stage.devices, attn_flops,
                                                          nbytes - cost.model.bytes_per_layer)
    return roofline(cost, stage, flops, nbytes, attn_flops, attn_eff)


def collectives_time(cost: CostModel, stage: StageLayout) -> float:
    """The fixed cost of a TP group's collectives in one iteration: two all-reduces per layer plus
    the step's broadcasts, each paying ``collective_overhead_s`` beyond its α-β time (the
    launch, and every member reaching it: on CPU worker slots sharing cores, a process switch).
    Waiting, not computing: the simulator's host contention does not stretch it (``sim.hosts``)."""
    if stage.tp <= 1:
        return 0.0
    return (2 * stage.num_layers + TP_STEP_COLLECTIVES) * cost.eff.collective_overhead_s


def collective_bytes_time(cost: CostModel, stage: StageLayout, rows: Any) -> Any:
    """What a TP group's collectives spend per byte beyond the link's α-β time
    (``Efficiency.collective_s_per_byte``): each layer's two all-reduces and the broadcast of the
    stage's input, ``rows`` tokens of activations each."""
    if stage.tp <= 1 or cost.eff.collective_s_per_byte <= 0:
        return 0.0
    m = cost.model
    return (2 * stage.num_layers + 1) * rows * m.hidden * m.dtype_bytes * cost.eff.collective_s_per_byte


def multi_row_time(cost: CostModel, stage: StageLayout, rows: Any, head_rows: Any, is_last: bool) -> Any:
    """What the stage's matrix products spend beyond the roofline once they multiply more than
    one row (``Efficiency.multi_row_s_per_byte`` per byte of a device's weight shard): its layers
    at ``rows`` tokens, the LM head on the last stage at ``head_rows`` (one per sequence). Ramped
    by ``min(1, rows - 1)``: fractional rows are a mean over micro-batches."""
    per_byte = cost.eff.multi_row_s_per_byte
    if per_byte <= 0:
        return 0.0
    m = cost.model
    t = per_byte * stage.num_layers * m.bytes_per_layer / stage.tp * beyond_one_row(rows)
    return t + (per_byte * m.vocab * m.hidden * m.dtype_bytes * beyond_one_row(head_rows) if is_last else 0.0)


def head_time(cost: CostModel, stage: StageLayout, rows: Any) -> Any:
    """Final norm + LM head on the last stage for ``rows`` sequences (one logit row each), plus
    the once-per-iteration costs of the replica: the step's turn-around through the scheduler
    and its per-sequence work. They sit on the last stage because that is where an iteration
    closes (it samples and sends the tokens back; the next step of this micro-batch starts
    after), so a pipeline pays them once per iteration, not once per stage."""
    m, k = cost.model, cost.kernels
    head = (k.head(stage.devices, rows) if k is not None and k.covers(stage.devices) else
            roofline(cost, stage, 2.0 * m.hidden * m.vocab * rows, m.vocab * m.hidden * m.dtype_bytes))
    return head + cost.eff.iteration_overhead_s + cost.eff.seq_overhead_s * rows


def prompt_logprob_time(cost: CostModel, stage: StageLayout, positions: Any) -> Any:
    """What a step that returns the logprobs of ``positions`` prompt tokens adds on the last
    stage: the LM head once more, over those positions' rows (the runtime runs it apart from
    the sampling rows, so it reads the head's weights again), and the log-softmax over their
    logits (read, then written, in float32, as ``token_logprobs`` computes it).
    FLOPs ≈ 2·positions·hidden·vocab; bytes ≈ vocab·hidden·dtype + 2·positions·vocab·4."""
    if positions <= 0:
        return 0.0
    m, k = cost.model, cost.kernels
    head = (k.head(stage.devices, positions) if k is not None and k.covers(stage.devices) else
            roofline(cost, stage, 2.0 * m.hidden * m.vocab * positions, m.vocab * m.hidden * m.dtype_bytes))
    # every logit is read and its log-probability written, on one device (the leader samples)
    softmax_bytes = 2.0 * positions * m.vocab * LOGPROB_BYTES
    return head + softmax_bytes / min(cost._membw[d] for d in stage.devices)


def stage_prefill_time(cost: CostModel, stage: StageLayout, batch: Any, is_last: bool = False) -> Any:
    """Prefill of ``batch`` through this stage's layers, TP all-reduces included; the stage's fixed
    cost is a decode step's plus ``prompt_step_overhead_s`` (a mixed step, priced as a prefill
    batch, pays it once); on the last stage the scored prompt positions' logprobs."""
    m, eff = cost.model, cost.eff
    tokens = batch.tokens
    flops = 2.0 * m.params_per_layer * tokens
    nbytes = m.bytes_per_layer + tokens * m.kv_bytes_per_token_per_layer
    per_layer = layer_time(cost, stage, tokens, flops, nbytes, 2.0 * m.q_dim * batch.sum_sq)
    comm = 2 * cost.allreduce_time(stage.devices, tokens * m.hidden * m.dtype_bytes)
    head = (head_time(cost, stage, batch.num_seqs) + prompt_logprob_time(cost, stage, batch.scored)
            if is_last else 0.0)
    return (stage.num_layers * (per_layer + comm) + collectives_time(cost, stage) + head + eff.step_overhead_s
            + eff.prompt_step_overhead_s + multi_row_time(cost, stage, tokens, batch.num_seqs, is_last)
            + collective_bytes_time(cost, stage, tokens))


def prefill_time(cost: CostModel, layout: ReplicaLayout, batch: Any, remember: bool = True) -> float:
    """Prefill latency of a batch through the whole pipeline (no micro-batching). ``remember``
    False: each stage priced by the formula itself, past what the model may remember of it (a
    batch that will not come again)."""
    stages = layout.stages
    last = len(stages) - 1
    total = 0.0
    for i, s in enumerate(stages):
        total += (cost.stage_prefill_time(s, batch, i == last) if remember else
                  stage_prefill_time(cost, s, batch, i == last))
        if i != last:
            total += cost.pp_handoff_time(s, stages[i + 1], batch.tokens)
    return total


def mixed_step_time(cost: CostModel, layout: ReplicaLayout, decode_batch: Any, decode_context: Any,
                    prompts: Any, micro_batches: int | None = None, remember: bool = True,
                    decode_s: float | None = None) -> Any:
    """One iteration carrying ``decode_batch`` decoding sequences (``decode_context`` KV tokens
    in all) and the prompt tokens of ``prompts`` (vLLM v1-style mixed batch).

    Every token of the step goes through the weights once, so the step is priced as one prefill
    batch of decode + prompt tokens (a decode token attends to its context: Σ 2·context in the
    attention term), and never below the decode step alone (which reads the KV). ``remember``
    False: the batch is not remembered (``prefill_time``; a simulated step's attention term holds
    its decodes' whole context, which hardly ever comes again). ``decode_s``: the decode step alone
    (``decode_step_time`` of the decodes), where the caller has priced it.
    """
    if prompts.tokens <= 0:
        return cost.decode_step_time(layout, decode_batch, decode_context, micro_batches)
    batch = PrefillBatch(decode_batch + prompts.num_seqs, decode_batch + prompts.tokens,
                         2.0 * decode_context + prompts.sum_sq, prompts.scored)
    t = prefill_time(cost, layout, batch, remember)
    if decode_batch:
        if decode_s is None:
            decode_s = cost.decode_step_time(layout, decode_batch, decode_context, micro_batches)
        t = max(t, decode_s)
    return t


def beyond_one_row(rows: Any) -> Any:
    """0 for one row, 1 for two or more, linear between (a mean over micro-batches of 1 and 2 rows)."""
    return min(1.0, max(0.0, rows - 1.0))
