"""A decode iteration priced from the terms its batch fixes (``cost.decode``) is the cost model's
formula, bit for bit: every layer's work at the batch and its context
(``prefill_costs.layer_time``), the TP all-reduces, the fixed costs and the LM head, summed in one
order; the memoised twin, which keeps those terms per batch and prices each new context from them,
gives the same numbers."""

from __future__ import annotations

import itertools

import pytest

from hetserve.cost import prefill_costs
from hetserve.cost.analytic import CostModel
from hetserve.cost.efficiency import Efficiency
from hetserve.cost.layout import ReplicaLayout, StageLayout
from hetserve.cost.memo import MemoCost
from hetserve.specs.cluster import cluster_from_dict
from hetserve.specs.model import MODEL_PRESETS

LLAMA7 = MODEL_PRESETS["llama-2-7b"]
L = LLAMA7.num_layers
NETWORK = {"intra_site": {"bandwidth_gbps": 100, "latency_ms": 0.2}}


def _reference_stage(cm: CostModel, stage: StageLayout, batch: float, context: float, is_last: bool) -> float:
    """One stage's decode iteration written out as one formula, term by term."""
    m = cm.model
    flops = 2.0 * m.params_per_layer * batch
    nbytes = m.bytes_per_layer + context * m.kv_bytes_per_token_per_layer
    per_layer = prefill_costs.layer_time(cm, stage, batch, flops, nbytes, 4.0 * m.q_dim * context,
                                         cm.eff.decode_attention)
    comm = 2 * cm.allreduce_time(stage.devices, batch * m.hidden * m.dtype_bytes)
    head = cm._head_time(stage, batch) if is_last else 0.0
    return (stage.num_layers * (per_layer + comm) + cm.collectives_time(stage) + head + cm.eff.step_overhead_s
            + cm.multi_row_time(stage, batch, batch, is_last) + cm.collective_bytes_time(stage, batch))


def _models():
    two_types = cluster_from_dict({"name": "mixed", "machines": [
        {"name": "a", "gpu": "A100-SXM-80G", "count": 2}, {"name": "b", "gpu": "RTX-4090", "count": 2}],
        "network": NETWORK})
    slots = cluster_from_dict({"name": "slots", "machines": [{"name": "c", "gpu": "RTX-4090", "count": 4,
                                                              "cpu_cores": 2}]})
    calibrated = Efficiency(compute=0.3, memory=0.6, attention=0.2, decode_attention=0.001, iteration_overhead_s=0.002,
                            seq_overhead_s=1e-4, step_overhead_s=3e-4, collective_overhead_s=2e-4,
                            multi_row_s_per_byte=1e-13, collective_s_per_byte=1e-12, turn_hold=0.4)
    return {"kernels": CostModel(two_types, LLAMA7), "roofline": CostModel(two_types, LLAMA7, kernels=False),
            "calibrated": CostModel(two_types, LLAMA7, calibrated),
            "attention-at-compute": CostModel(two_types, LLAMA7, Efficiency(attention=0.0, decode_attention=0.0)),
            "cpu-slots": CostModel(slots, LLAMA7)}


LAYOUTS = {
    "tp1": ReplicaLayout((StageLayout((0,), (0, L)),)),
    "tp2": ReplicaLayout((StageLayout((0, 1), (0, L)),)),
    "pp2-mixed": ReplicaLayout((StageLayout((0,), (0, 12)), StageLayout((2,), (12, L)))),
    "pp2-tp2": ReplicaLayout((StageLayout((0, 1), (0, 20)), StageLayout((2, 3), (20, L)))),
}


@pytest.mark.parametrize("name", ["kernels", "roofline", "calibrated", "attention-at-compute", "cpu-slots"])
def test_decode_terms_price_every_context_as_the_formula(name):
    cm = _models()[name]
    memo = MemoCost(cm)
    checked = 0
    for layout, batch, micro in itertools.product(LAYOUTS.values(), (1, 3, 8, 256), (None, 1)):
        round_ = cm.decode_round(layout, batch, micro)
        m = round_.micro_batches
        for context in (batch * 7.0, batch * 300.0, batch * 2500.5):
            stages = [_reference_stage(cm, s, batch / m, context / m, i == len(layout.stages) - 1)
                      for i, s in enumerate(layout.stages)]
            assert round_.stage_times(context) == stages
            assert cm.micro_batch_stage_times(layout, batch, context, micro) == (m, stages)
            for dispatch in (0.0, 0.003):
                want = cm.decode_step_time(layout, batch, context, micro, dispatch)
                assert memo.decode_step_time(layout, batch, context, micro, dispatch) == want
                checked += 1
    assert checked == len(LAYOUTS) * 4 * 2 * 3 * 2
    assert memo._decode and memo._rounds  # the memos were used: later contexts at a batch hit them


def test_the_memo_shares_a_stages_terms_across_identical_machines_only():
    """Two boxes of the same GPUs share a stage's decode terms; another GPU type does not."""
    c = cluster_from_dict({"name": "three", "machines": [
        {"name": "a", "gpu": "A100-SXM-80G", "count": 2}, {"name": "b", "gpu": "A100-SXM-80G", "count": 2},
        {"name": "c", "gpu": "L40", "count": 2}], "network": NETWORK})
    memo = MemoCost(CostModel(c, LLAMA7))
    first = memo.stage_decode(StageLayout((0, 1), (0, L)), 4, True)
    assert memo.stage_decode(StageLayout((2, 3), (0, L)), 4, True) is first
    assert memo.stage_decode(StageLayout((4, 5), (0, L)), 4, True) is not first
    plain = CostModel(c, LLAMA7)
    assert plain.stage_decode_time(StageLayout((4, 5), (0, L)), 4, 900, True) == \
        memo.stage_decode_time(StageLayout((4, 5), (0, L)), 4, 900, True)


def test_the_memo_shares_a_replicas_rounds_across_identical_machines_only():
    """Copies of one replica on identical boxes share their decode rounds (``layout_signature``);
    another GPU type or another hand-off link does not, and every round prices as the cost model."""
    c = cluster_from_dict({"name": "three", "machines": [
        {"name": "a", "gpu": "A100-SXM-80G", "count": 2}, {"name": "b", "gpu": "A100-SXM-80G", "count": 2},
        {"name": "c", "gpu": "L40", "count": 2}], "network": NETWORK})
    plain, memo = CostModel(c, LLAMA7), MemoCost(CostModel(c, LLAMA7))

    def pp2(d0, d1):
        return ReplicaLayout((StageLayout((d0,), (0, 12)), StageLayout((d1,), (12, L))))

    on_a, on_b, on_c, across = pp2(0, 1), pp2(2, 3), pp2(4, 5), pp2(0, 2)
    assert memo.decode_round(on_b, 4) is memo.decode_round(on_a, 4)
    assert memo.decode_round(on_b, 4, 1) is not memo.decode_round(on_a, 4)
    assert memo.decode_round(on_c, 4) is not memo.decode_round(on_a, 4)
    assert memo.decode_round(across, 4) is not memo.decode_round(on_a, 4)  # the hop crosses boxes
    for layout in (on_a, on_b, on_c, across):
        for batch, context in ((1, 300.0), (4, 1800.0), (4, 2500.5)):
            assert memo.decode_step_time(layout, batch, context) == plain.decode_step_time(layout, batch, context)


@pytest.mark.parametrize("name", ["kernels", "roofline", "calibrated", "cpu-slots"])
def test_a_mixed_step_priced_without_remembering_is_the_remembered_price_and_leaves_the_memo_alone(name):
    from hetserve.cost.prefill_batch import PrefillBatch

    cm = _models()[name]
    checked = 0
    for layout, (decodes, context), prompts in itertools.product(
            LAYOUTS.values(), ((0, 0.0), (5, 3000.0), (64, 90_000.5)),
            (PrefillBatch.of([300]), PrefillBatch.of([17, 2000], scored=16), PrefillBatch(0, 0, 0.0))):
        if not decodes and not prompts.tokens:
            continue
        memo = MemoCost(cm)
        got = memo.mixed_step_time(layout, decodes, context, prompts, 1, remember=False)
        assert not memo._prefill  # nothing of that step kept
        assert got == cm.mixed_step_time(layout, decodes, context, prompts, 1)
        assert got == memo.mixed_step_time(layout, decodes, context, prompts, 1)
        assert bool(memo._prefill) == (prompts.tokens > 0)  # remembered by default
        checked += 1
    assert checked == len(LAYOUTS) * 8
