"""The per-stage formulas of ``cost.analytic.CostModel`` for a step's prompt tokens and fixed costs:
``StagePrompt``, one stage's terms with what they read of the model read once, and the pipeline's
prefill and mixed steps built from them.

They live apart so the compiled build (``make fast-sim``) can compile them (``CostModel`` itself
stays interpreted: it is built and subclassed in ways native classes refuse); the simulator prices
a mixed step at nearly every arrival. What a subclass may remember (``stage_prompt``,
``allreduce_time`` across boxes, ``stage_prefill_time``, ``pp_handoff_time``, ``decode_step_time``)
is asked of the model. Arguments that are counts or means (a micro-batch's rows) stay unannotated:
either kind of number keeps Python's arithmetic."""

from __future__ import annotations

from typing import Any, Protocol, Sequence

from hetserve.cost.efficiency import Efficiency
from hetserve.cost.kernel_pricing import GroupPrices, KernelPricing
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

    def stage_prompt(self, stage: StageLayout) -> "StagePrompt": ...

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


def roofline(rates: tuple[float, float | None, float], flops: Any, nbytes: Any, attn_flops: Any = 0.0) -> Any:
    """A TP group's time for ``flops`` and ``attn_flops`` and ``nbytes`` at its
    ``CostModel._roofline_rates`` (FLOP/s, attention's FLOP/s or None, bytes/s)."""
    compute, attention, memory = rates
    if attention is not None:
        return max(flops / compute + attn_flops / attention, nbytes / memory)
    return max((flops + attn_flops) / compute, nbytes / memory)


class StagePrompt:
    """One stage's formulas for prompt tokens and the costs a step pays once, with what they read
    of the model, the efficiencies, the kernel pricing and the stage's devices read once
    (``CostModel.stage_prompt`` keeps one per stage). ``at`` prices a prefill batch through the
    stage; a decode iteration's terms (``cost.decode_costs``) take its fixed costs, LM head and
    per-row costs from it too."""

    def __init__(self, cost: CostModel, stage: StageLayout):
        m, eff, k = cost.model, cost.eff, cost.kernels
        self._cost, self.stage = cost, stage
        self.layers, self.tp = stage.num_layers, stage.tp
        group = k.group(stage.devices) if k is not None else None
        self.kernels: GroupPrices | None = group if group is not None and group.covered else None
        self._fitted = group if group is not None and group.fit is not None else None  # in-box all-reduce
        self.rates = cost._roofline_rates(stage)  # prompts' attention at ``Efficiency.attention``
        self.membw = min(cost._membw[d] for d in stage.devices)  # the leader's log-softmax
        self.hidden, self.vocab, self.dtype_bytes = m.hidden, m.vocab, m.dtype_bytes
        self.weights, self.kv_per_token = m.bytes_per_layer, m.kv_bytes_per_token_per_layer
        self.flops_per_token = 2.0 * m.params_per_layer
        self.attention_per_sq = 2.0 * m.q_dim  # causal attention: 2·q_dim FLOPs per (position, position)
        self.head_flops_per_row = 2.0 * m.hidden * m.vocab
        self.head_bytes = m.vocab * m.hidden * m.dtype_bytes
        self.iteration_s, self.seq_s = eff.iteration_overhead_s, eff.seq_overhead_s
        self.step_s, self.prompt_step_s = eff.step_overhead_s, eff.prompt_step_overhead_s
        per_byte = self.multi_row_per_byte = eff.multi_row_s_per_byte
        self.multi_row_layers = per_byte * stage.num_layers * m.bytes_per_layer / stage.tp
        self.multi_row_head = per_byte * m.vocab * m.hidden * m.dtype_bytes
        self.collective_per_byte = eff.collective_s_per_byte
        self.collectives_s = self._collectives(eff.collective_overhead_s)

    def _collectives(self, overhead_s: float) -> float:
        """The fixed cost of a TP group's collectives in one iteration: two all-reduces per layer plus
        the step's broadcasts, each paying ``collective_overhead_s`` beyond its α-β time (the
        launch, and every member reaching it: on CPU worker slots sharing cores, a process switch).
        Waiting, not computing: the simulator's host contention does not stretch it (``sim.hosts``)."""
        if self.tp <= 1:
            return 0.0
        return (2 * self.layers + TP_STEP_COLLECTIVES) * overhead_s

    def allreduce(self, nbytes: Any) -> Any:
        """One all-reduce of ``nbytes`` over the group: the kernel model's fitted curve inside a box,
        else the cost model's (α-β over the links it crosses)."""
        if self.tp <= 1:
            return 0.0
        fitted = self._fitted
        if fitted is not None:
            return fitted.allreduce(nbytes)
        return self._cost.allreduce_time(self.stage.devices, nbytes)

    def layer(self, rows: Any, flops: Any, nbytes: Any, attn_flops: Any, attn_eff: float = 0.0) -> Any:
        """One layer of the stage at ``rows`` tokens: the kernel model's operators plus attention's
        products and KV traffic (``nbytes`` beyond the layer's weights) where it covers the stage,
        else the roofline of ``flops`` and ``nbytes`` (attention at ``attn_eff`` of peak where set)."""
        k = self.kernels
        if k is not None:
            return k.layer(rows) + k.attention(attn_flops, nbytes - self.weights)
        rates = self._cost._roofline_rates(self.stage, attn_eff) if attn_eff else self.rates
        return roofline(rates, flops, nbytes, attn_flops)

    def collective_bytes(self, rows: Any) -> Any:
        """What a TP group's collectives spend per byte beyond the link's α-β time
        (``Efficiency.collective_s_per_byte``): each layer's two all-reduces and the broadcast of the
        stage's input, ``rows`` tokens of activations each."""
        if self.tp <= 1 or self.collective_per_byte <= 0:
            return 0.0
        return (2 * self.layers + 1) * rows * self.hidden * self.dtype_bytes * self.collective_per_byte

    def multi_row(self, rows: Any, head_rows: Any, is_last: bool) -> Any:
        """What the stage's matrix products spend beyond the roofline once they multiply more than
        one row (``Efficiency.multi_row_s_per_byte`` per byte of a device's weight shard): its layers
        at ``rows`` tokens, the LM head on the last stage at ``head_rows`` (one per sequence). Ramped
        by ``min(1, rows - 1)``: fractional rows are a mean over micro-batches."""
        if self.multi_row_per_byte <= 0:
            return 0.0
        t = self.multi_row_layers * beyond_one_row(rows)
        return t + (self.multi_row_head * beyond_one_row(head_rows) if is_last else 0.0)

    def head(self, rows: Any) -> Any:
        """Final norm + LM head on the last stage for ``rows`` sequences (one logit row each), plus
        the once-per-iteration costs of the replica: the step's turn-around through the scheduler
        and its per-sequence work. They sit on the last stage because that is where an iteration
        closes (it samples and sends the tokens back; the next step of this micro-batch starts
        after), so a pipeline pays them once per iteration, not once per stage."""
        return self._head_product(rows) + self.iteration_s + self.seq_s * rows

    def _head_product(self, rows: Any) -> Any:
        k = self.kernels
        return (k.head(rows) if k is not None else
                roofline(self.rates, self.head_flops_per_row * rows, self.head_bytes))

    def prompt_logprobs(self, positions: Any) -> Any:
        """What a step that returns the logprobs of ``positions`` prompt tokens adds on the last
        stage: the LM head once more, over those positions' rows (the runtime runs it apart from
        the sampling rows, so it reads the head's weights again), and the log-softmax over their
        logits (read, then written, in float32, as ``token_logprobs`` computes it).
        FLOPs ≈ 2·positions·hidden·vocab; bytes ≈ vocab·hidden·dtype + 2·positions·vocab·4."""
        if positions <= 0:
            return 0.0
        # every logit is read and its log-probability written, on one device (the leader samples)
        softmax_bytes = 2.0 * positions * self.vocab * LOGPROB_BYTES
        return self._head_product(positions) + softmax_bytes / self.membw

    def at(self, num_seqs: Any, tokens: Any, sum_sq: Any, scored: Any, is_last: bool) -> Any:
        """Prefill of a batch (``PrefillBatch``'s fields) through this stage's layers, TP all-reduces
        included; the stage's fixed cost is a decode step's plus ``prompt_step_overhead_s`` (a mixed
        step, priced as a prefill batch, pays it once); on the last stage the scored prompt
        positions' logprobs."""
        flops = self.flops_per_token * tokens
        nbytes = self.weights + tokens * self.kv_per_token
        per_layer = self.layer(tokens, flops, nbytes, self.attention_per_sq * sum_sq)
        comm = 2 * self.allreduce(tokens * self.hidden * self.dtype_bytes)
        head = self.head(num_seqs) + self.prompt_logprobs(scored) if is_last else 0.0
        return (self.layers * (per_layer + comm) + self.collectives_s + head + self.step_s + self.prompt_step_s
                + self.multi_row(tokens, num_seqs, is_last) + self.collective_bytes(tokens))


def layer_time(cost: CostModel, stage: StageLayout, rows: Any, flops: Any, nbytes: Any, attn_flops: Any,
               attn_eff: float = 0.0) -> Any:
    """One layer of the stage at ``rows`` tokens (``StagePrompt.layer``)."""
    return cost.stage_prompt(stage).layer(rows, flops, nbytes, attn_flops, attn_eff)


def stage_prefill_time(cost: CostModel, stage: StageLayout, batch: Any, is_last: bool = False) -> Any:
    """Prefill of ``batch`` through this stage (``StagePrompt.at``)."""
    return cost.stage_prompt(stage).at(batch.num_seqs, batch.tokens, batch.sum_sq, batch.scored, is_last)


def prefill_time(cost: CostModel, layout: ReplicaLayout, batch: Any, remember: bool = True) -> float:
    """Prefill latency of a batch through the whole pipeline (no micro-batching). ``remember``
    False: each stage priced from its terms afresh, past what the model may remember of the batch
    (a batch that will not come again)."""
    return _through(cost, layout, batch.num_seqs, batch.tokens, batch.sum_sq, batch.scored,
                    batch if remember else None)


def _through(cost: CostModel, layout: ReplicaLayout, num_seqs: Any, tokens: Any, sum_sq: Any, scored: Any,
             remembered: Any, stage_prompts: Sequence[StagePrompt] | None = None) -> float:
    """A prefill batch's fields through the pipeline's stages and hand-offs; ``remembered``: the
    batch itself, priced per stage as the model may remember it (None: from each stage's terms,
    ``stage_prompts`` where the caller keeps them, else the model's ``stage_prompt``)."""
    stages = layout.stages
    last = len(stages) - 1
    total = 0.0
    for i, s in enumerate(stages):
        is_last = i == last
        if remembered is not None:
            total += cost.stage_prefill_time(s, remembered, is_last)
        else:
            terms = stage_prompts[i] if stage_prompts is not None else cost.stage_prompt(s)
            total += terms.at(num_seqs, tokens, sum_sq, scored, is_last)
        if not is_last:
            total += cost.pp_handoff_time(s, stages[i + 1], tokens)
    return total


def mixed_step_time(cost: CostModel, layout: ReplicaLayout, decode_batch: Any, decode_context: Any,
                    prompts: Any, micro_batches: int | None = None, remember: bool = True,
                    decode_s: float | None = None, stage_prompts: Sequence[StagePrompt] | None = None) -> Any:
    """One iteration carrying ``decode_batch`` decoding sequences (``decode_context`` KV tokens
    in all) and the prompt tokens of ``prompts`` (vLLM v1-style mixed batch).

    Every token of the step goes through the weights once, so the step is priced as one prefill
    batch of decode + prompt tokens (a decode token attends to its context: Σ 2·context in the
    attention term), and never below the decode step alone (which reads the KV). ``remember``
    False: the batch is not remembered (``prefill_time``; a simulated step's attention term holds
    its decodes' whole context, which hardly ever comes again). ``decode_s``: the decode step alone
    (``decode_step_time`` of the decodes), where the caller has priced it; ``stage_prompts``: each
    stage's ``CostModel.stage_prompt``, where the caller keeps them (a simulated replica).
    """
    if prompts.tokens <= 0:
        return cost.decode_step_time(layout, decode_batch, decode_context, micro_batches)
    num_seqs, tokens = decode_batch + prompts.num_seqs, decode_batch + prompts.tokens
    sum_sq, scored = 2.0 * decode_context + prompts.sum_sq, prompts.scored
    batch = PrefillBatch(num_seqs, tokens, sum_sq, scored) if remember else None
    t = _through(cost, layout, num_seqs, tokens, sum_sq, scored, batch, stage_prompts)
    if decode_batch:
        if decode_s is None:
            decode_s = cost.decode_step_time(layout, decode_batch, decode_context, micro_batches)
        t = max(t, decode_s)
    return t


def beyond_one_row(rows: Any) -> Any:
    """0 for one row, 1 for two or more, linear between (a mean over micro-batches of 1 and 2 rows)."""
    return min(1.0, max(0.0, rows - 1.0))
