"""The cost model checked against numbers worked out by hand from HexGen Table 1 / Appendix B
and HexGen-2 Appendix A, plus properties that must hold for any inputs."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetserve.cost.analytic import TP_STEP_COLLECTIVES, CostModel, PrefillBatch
from hetserve.cost.efficiency import Efficiency
from hetserve.cost.layout import ReplicaLayout, StageLayout
from hetserve.specs.cluster import Cluster, cluster_from_dict
from hetserve.specs.model import MODEL_PRESETS

CLUSTER = cluster_from_dict({
    "name": "hand", "machines": [{"name": "a", "gpu": "H100-SXM-80G", "count": 8},
                                 {"name": "b", "gpu": "A6000", "count": 2}],
    "network": {"intra_site": {"bandwidth_gbps": 10, "latency_ms": 1}}})
LLAMA7 = MODEL_PRESETS["llama-2-7b"]
H100_MEMBW = 3350e9 * 0.8
H100_FLOPS = 989.4e12 * 0.5


def one_stage(*devices, layers=32):
    return ReplicaLayout((StageLayout(tuple(devices), (0, layers)),))


def test_decode_step_batch1_is_weight_streaming():
    cm = CostModel(CLUSTER, LLAMA7, kernels=False)
    # 32 layers · 202,383,360 params · 2 B + LM head 32000·4096·2 B, over 80 % of 3.35 TB/s.
    expected = (32 * 202_383_360 * 2 + 32000 * 4096 * 2) / H100_MEMBW
    assert cm.decode_step_time(one_stage(0), 1, 0) == pytest.approx(expected, rel=1e-9)
    assert expected == pytest.approx(4.9308e-3, rel=1e-4)


def test_prefill_1000_tokens_is_compute_bound():
    cm = CostModel(CLUSTER, LLAMA7, kernels=False)
    per_layer = (2 * 202_383_360 * 1000 + 2 * 4096 * 1000**2) / H100_FLOPS
    head = 32000 * 4096 * 2 / H100_MEMBW  # one logit row: streaming the head dominates
    assert cm.ttft(one_stage(0), 1000) == pytest.approx(32 * per_layer + head, rel=1e-9)


def test_tp_allreduce_is_hexgen_bsp():
    cm = CostModel(CLUSTER, LLAMA7, kernels=False)
    nbytes = 1000 * 4096 * 2
    alpha, beta = 0.005e-3, 3600e9 / 8
    # each of 2 supersteps: every device sends (t-1) chunks of nbytes/t; t = 4
    expected = 2 * 3 * (alpha + nbytes / 4 / beta)
    assert cm.allreduce_time((0, 1, 2, 3), nbytes) == pytest.approx(expected)
    assert cm.allreduce_time((0,), nbytes) == 0.0


def test_pp_handoff_uses_fastest_link():
    cm = CostModel(CLUSTER, LLAMA7)
    a, b = StageLayout((0, 8), (0, 16)), StageLayout((1,), (16, 32))
    nbytes = 10 * 4096 * 2
    assert cm.pp_handoff_time(a, b, 10) == pytest.approx(0.005e-3 + nbytes / (3600e9 / 8))


def test_kv_transfer_tp2_to_tp1_across_boxes():
    cm = CostModel(CLUSTER, LLAMA7)
    prefill, decode = one_stage(0, 1), one_stage(8)
    # 100 tokens · 32 layers · 16,384 B; each H100 shard sends half at once, but both halves leave
    # through box a's one 10 Gbps NIC (and enter b's): the whole cache at 10 Gbps, + 1 ms.
    half = 100 * 32 * 16384 / 2
    assert cm.kv_transfer_time(prefill, decode, 100) == pytest.approx(1e-3 + 2 * half / 1.25e9)
    # the per-pair view (each half alone on a private 10 Gbps link) stays the lower bound
    assert cm.kv_transfer_time_uncontended(prefill, decode, 100) == pytest.approx(1e-3 + half / 1.25e9)
    assert half / 1.25e9 + 1e-3 == pytest.approx(0.0219715, rel=1e-5)


def test_kv_transfer_resharded_over_two_stages():
    cm = CostModel(CLUSTER, LLAMA7)
    prefill = one_stage(0, 1)
    decode = ReplicaLayout((StageLayout((2,), (0, 16)), StageLayout((3,), (16, 32))))
    pairs = list(cm.kv_transfer_pairs(prefill, decode, 10))
    assert {(d, e) for d, e, _ in pairs} == {(0, 2), (1, 2), (0, 3), (1, 3)}
    assert sum(b for *_, b in pairs) == pytest.approx(10 * LLAMA7.kv_bytes_per_token)


def test_replica_memory_required_is_params_plus_32_requests():
    cm = CostModel(CLUSTER, MODEL_PRESETS["llama-2-70b"])
    assert cm.replica_memory_required(1000, 200) == pytest.approx(68_976_648_192 * 2 + 32 * 327_680 * 1200)


def test_70b_does_not_fit_one_h100_but_fits_four():
    cm = CostModel(CLUSTER, MODEL_PRESETS["llama-2-70b"])
    assert not cm.fits(one_stage(0, layers=80))
    assert cm.fits(one_stage(0, 1, 2, 3, layers=80), min_kv_tokens=4096)
    assert cm.max_decode_batch(one_stage(0, layers=80), 1000) == 0


def test_capacities_follow_hexgen2_appendix_a():
    cm = CostModel(CLUSTER, LLAMA7)
    lay = one_stage(0)
    assert cm.prefill_capacity(lay, 512, 600) == pytest.approx(600 / cm.ttft(lay, 512))
    b, tps = cm.decode_throughput(lay, 512, 128)
    assert b == cm.max_decode_batch(lay, 640) and b > 32
    assert cm.decode_capacity(lay, 512, 128, 600) == pytest.approx(600 * tps / 128)
    # a colocated replica does both jobs: never more than either alone; prompts that ride in a
    # memory-bound decode step can be free (the roofline's max), so "at most", not "less"
    assert cm.colocated_capacity(lay, 512, 128) <= min(cm.prefill_capacity(lay, 512), cm.decode_capacity(lay, 512, 128))
    assert cm.colocated_capacity(lay, 4000, 128) < cm.decode_capacity(lay, 4000, 128)  # compute-bound prompts


def test_mixed_step_prices_decode_and_prompt_tokens_as_one_pass():
    cm = CostModel(CLUSTER, LLAMA7)
    lay = one_stage(0)
    prompts = PrefillBatch.of([3000, 1000])
    t = cm.mixed_step_time(lay, 8, 8 * 600, prompts)
    whole = PrefillBatch(10, 8 + 4000, 2 * 8 * 600 + prompts.sum_sq)
    assert t == pytest.approx(max(cm.prefill_time(lay, whole), cm.decode_step_time(lay, 8, 8 * 600)))
    assert t < cm.prefill_time(lay, prompts) + cm.decode_step_time(lay, 8, 8 * 600)  # weights read once
    assert cm.mixed_step_time(lay, 8, 8 * 600, PrefillBatch(0, 0, 0.0)) == cm.decode_step_time(lay, 8, 8 * 600)


def test_pipeline_micro_batches_overlap_stages():
    cm = CostModel(CLUSTER, LLAMA7)
    pp = ReplicaLayout((StageLayout((0,), (0, 16)), StageLayout((1,), (16, 32))))
    # two micro-batches keep both stages busy: a period is about one stage's work at full batch
    assert cm.decode_step_time(pp, 64, 64 * 600) < 1.2 * cm.decode_step_time(pp, 64, 64 * 600, micro_batches=1)
    assert cm.decode_step_time(pp, 64, 64 * 600, micro_batches=1) > cm.decode_step_time(one_stage(0), 64, 64 * 600)


def test_fixed_costs_are_charged_where_the_runtime_pays_them():
    """A second pipeline stage adds one stage's fixed cost, not another iteration's: the
    scheduler turn-around and each sequence's own work are paid once per iteration (last stage)."""
    eff = Efficiency(step_overhead_s=0.001, iteration_overhead_s=0.004, seq_overhead_s=0.0002)
    base, cm = CostModel(CLUSTER, LLAMA7, kernels=False), CostModel(CLUSTER, LLAMA7, eff)
    pp = ReplicaLayout((StageLayout((0,), (0, 16)), StageLayout((1,), (16, 32))))
    extra = lambda lay, b: cm.decode_step_time(lay, b, 0, 1) - base.decode_step_time(lay, b, 0, 1)  # noqa: E731
    assert extra(one_stage(0), 1) == pytest.approx(0.001 + 0.004 + 0.0002, rel=1e-6)
    assert extra(pp, 1) == pytest.approx(2 * 0.001 + 0.004 + 0.0002, rel=1e-6)
    assert extra(one_stage(0), 16) == pytest.approx(0.001 + 0.004 + 16 * 0.0002, rel=1e-6)
    pre = cm.ttft(pp, 100) - base.ttft(pp, 100)
    assert pre == pytest.approx(2 * 0.001 + 0.004 + 0.0002, rel=1e-6)
    # a TP group pays its collectives' fixed cost: two all-reduces per layer plus the step's broadcasts
    coll = CostModel(CLUSTER, LLAMA7, Efficiency(collective_overhead_s=0.0001))
    tp2 = ReplicaLayout((StageLayout((0, 1), (0, 32)),))
    assert coll.decode_step_time(tp2, 1, 0) - base.decode_step_time(tp2, 1, 0) == pytest.approx(
        (2 * 32 + TP_STEP_COLLECTIVES) * 0.0001, rel=1e-6)
    assert coll.decode_step_time(one_stage(0), 1, 0) == base.decode_step_time(one_stage(0), 1, 0)
    # a step carrying a prompt pays its own fixed cost on every stage, once a step (a mixed step too);
    # a decode step never
    prompt = CostModel(CLUSTER, LLAMA7, Efficiency(prompt_step_overhead_s=0.003))
    assert prompt.ttft(pp, 100) - base.ttft(pp, 100) == pytest.approx(2 * 0.003, rel=1e-6)
    assert prompt.ttft(one_stage(0), 100) - base.ttft(one_stage(0), 100) == pytest.approx(0.003, rel=1e-6)
    two = PrefillBatch.of([100, 50])
    assert prompt.prefill_time(pp, two) - base.prefill_time(pp, two) == pytest.approx(2 * 0.003, rel=1e-6)
    assert prompt.decode_step_time(pp, 4, 400) == base.decode_step_time(pp, 4, 400)
    mixed = lambda c: c.mixed_step_time(one_stage(0), 4, 400, PrefillBatch.single(1000))  # noqa: E731
    assert mixed(prompt) - mixed(base) == pytest.approx(0.003, rel=1e-6)


@pytest.mark.parametrize("cpu_cores", [None, 2])
def test_a_pipelines_turn_around_overlaps_its_other_micro_batch_on_gpus_only(cpu_cores):
    """Two micro-batches on two stages of a host-bound engine (a turn-around of 7 ms, stages of
    about 3 and 4 ms of their own): on GPUs the front end turns one micro-batch round while the
    other computes, so the round is the ring, bounded by one front end turning both; on CPU worker
    slots sharing cores the turn-around holds the last stage, twice a round."""
    machines = [{"name": "g", "gpu": "H200", "count": 2, **({"cpu_cores": cpu_cores} if cpu_cores else {})}]
    cluster = cluster_from_dict({"name": "host", "machines": machines})
    model = MODEL_PRESETS["llama-2-7b"]
    eff = Efficiency(compute=0.5, memory=0.8, step_overhead_s=0.003, iteration_overhead_s=0.007)
    cm = CostModel(cluster, model, eff)
    pp = ReplicaLayout((StageLayout((0,), (0, 2)), StageLayout((1,), (2, 4))))
    first, last = (cm.stage_decode_time(s, 1, 100, i == 1) for i, s in enumerate(pp.stages))
    ring = first + last + cm.pp_handoff_time(pp.stages[0], pp.stages[1], 1)
    assert last - 0.007 > first and 2 * (last - 0.007) < ring < 2 * last  # the case the rule decides
    two = cm.decode_step_time(pp, 2, 200)
    if cpu_cores is None:
        assert two == pytest.approx(max(ring, 2 * 0.007), rel=1e-9)
    else:
        assert two == pytest.approx(2 * last, rel=1e-9)
    assert cm.decode_step_time(pp, 1, 100) == pytest.approx(ring, rel=1e-9)  # one micro-batch: the ring either way


@pytest.mark.parametrize("cpu_cores", [None, 2])
def test_a_calibrated_turn_hold_sets_the_share_of_the_turn_around_that_holds_the_last_stage(cpu_cores):
    """``Efficiency.turn_hold`` h: two micro-batches' round is ``max(ring, 2·(last − (1 − h)·turn), 2·(1 − h)·turn)``
    on any host (h = 0 is the GPU overlap, h = 1 the CPU hold); a share between prices between. On
    CPU worker slots the front end's wait (``dispatch_s``) also holds the slowest stage once per
    micro-batch (two micro-batches of one took 14.9 ms on the engine and 17.9 through HTTP, one
    12.5 and 13.9); on a GPU host it stays on the ring alone."""
    machines = [{"name": "g", "gpu": "H200", "count": 2, **({"cpu_cores": cpu_cores} if cpu_cores else {})}]
    cluster = cluster_from_dict({"name": "host", "machines": machines})
    model = MODEL_PRESETS["llama-2-7b"]
    pp = ReplicaLayout((StageLayout((0,), (0, 2)), StageLayout((1,), (2, 4))))
    turn, wait = 0.007, 0.002
    rounds = []
    for hold in (0.0, 0.5, 1.0):
        eff = Efficiency(compute=0.5, memory=0.8, step_overhead_s=0.003, iteration_overhead_s=turn, turn_hold=hold)
        cm = CostModel(cluster, model, eff)
        first, last = (cm.stage_decode_time(s, 1, 100, i == 1) for i, s in enumerate(pp.stages))
        ring = first + last + cm.pp_handoff_time(pp.stages[0], pp.stages[1], 1)
        free = (1 - hold) * turn
        held = 2 * (max(first, last - free) + (wait if cpu_cores else 0.0))
        expected = max(ring + wait, held, 2 * free)
        rounds.append(cm.decode_step_time(pp, 2, 200, dispatch_s=wait))
        assert rounds[-1] == pytest.approx(expected, rel=1e-9)
        assert cm.decode_step_time(pp, 1, 100, dispatch_s=wait) == pytest.approx(ring + wait, rel=1e-9)
    assert rounds[0] <= rounds[1] < rounds[2]  # the ring binds below some share
    with pytest.raises(ValueError, match="turn_hold"):
        Efficiency(turn_hold=1.5)


def test_a_step_of_more_than_one_row_pays_one_more_pass_over_its_weights():
    """``multi_row_s_per_byte``: a one-sequence decode (matrix-vector products) pays nothing, two or
    more sequences pay it over each device's weight shard (a TP 2 device half the layers' bytes),
    the LM head on the last stage included; 1.5 rows, a mean over micro-batches, pay half; a prompt
    of many tokens pays it on its layers and on the head only beside another prompt."""
    per = 1e-12
    base, cm = CostModel(CLUSTER, LLAMA7, kernels=False), CostModel(CLUSTER, LLAMA7, Efficiency(multi_row_s_per_byte=per))
    extra = lambda lay, b: cm.decode_step_time(lay, b, 0, 1) - base.decode_step_time(lay, b, 0, 1)  # noqa: E731
    layers, head = 32 * 202_383_360 * 2, 32000 * 4096 * 2
    assert extra(one_stage(0), 1) == 0.0
    for b in (2, 4, 16):
        assert extra(one_stage(0), b) == pytest.approx(per * (layers + head), rel=1e-9)
    assert extra(one_stage(0), 1.5) == pytest.approx(0.5 * per * (layers + head), rel=1e-9)
    assert extra(one_stage(0, 1), 4) == pytest.approx(per * (layers / 2 + head), rel=1e-9)
    one_prompt = cm.ttft(one_stage(0), 100) - base.ttft(one_stage(0), 100)
    assert one_prompt == pytest.approx(per * layers, rel=1e-9)
    two = PrefillBatch.of([50, 50])
    assert cm.prefill_time(one_stage(0), two) - base.prefill_time(one_stage(0), two) == pytest.approx(
        per * (layers + head), rel=1e-9)


def test_tp_collectives_pay_per_byte_they_carry():
    """``collective_s_per_byte``: each layer's two all-reduces and the stage input's broadcast carry
    the step's rows of activations; a prompt of 100 tokens pays 100 times a one-sequence decode, a
    stage without TP nothing."""
    per = 1e-10
    base, cm = CostModel(CLUSTER, LLAMA7, kernels=False), CostModel(CLUSTER, LLAMA7, Efficiency(collective_s_per_byte=per))
    tp2 = one_stage(0, 1)
    row = (2 * 32 + 1) * 4096 * 2 * per
    assert cm.decode_step_time(tp2, 1, 0) - base.decode_step_time(tp2, 1, 0) == pytest.approx(row, rel=1e-9)
    assert cm.ttft(tp2, 100) - base.ttft(tp2, 100) == pytest.approx(100 * row, rel=1e-9)
    assert cm.ttft(one_stage(0), 100) == base.ttft(one_stage(0), 100)


def test_efficiency_validation():
    with pytest.raises(ValueError):
        Efficiency(compute=0)
    for k in ("step_overhead_s", "iteration_overhead_s", "seq_overhead_s", "collective_overhead_s",
              "collective_s_per_byte", "multi_row_s_per_byte", "prompt_step_overhead_s"):
        with pytest.raises(ValueError, match=k):
            Efficiency(**{k: -1e-3})
    assert CostModel(CLUSTER, LLAMA7, Efficiency(step_overhead_s=0.01)).decode_step_time(one_stage(0), 1, 0) > 0.01


# --------------------------------------------------------------------------- properties


def _scaled(c: Cluster, factor: float) -> Cluster:
    return Cluster(c.name, c.devices, c.latency, c.bandwidth * factor)


@settings(max_examples=40, deadline=None)
@given(factor=st.floats(1.0, 100.0), tokens=st.integers(1, 4096), tp=st.sampled_from([2, 4, 8]))
def test_more_bandwidth_is_never_slower(factor, tokens, tp):
    slow, fast = CostModel(CLUSTER, LLAMA7), CostModel(_scaled(CLUSTER, factor), LLAMA7)
    lay = one_stage(*range(tp))
    pp = ReplicaLayout((StageLayout((0,), (0, 16)), StageLayout((8,), (16, 32))))
    assert fast.ttft(lay, tokens) <= slow.ttft(lay, tokens)
    assert fast.ttft(pp, tokens) <= slow.ttft(pp, tokens)
    assert fast.kv_transfer_time(lay, pp, tokens) <= slow.kv_transfer_time(lay, pp, tokens)
    assert fast.decode_step_time(pp, 8, 8 * tokens) <= slow.decode_step_time(pp, 8, 8 * tokens)


@settings(max_examples=40, deadline=None)
@given(kv_tokens=st.integers(0, 200_000), layers=st.integers(1, 80))
def test_more_tp_never_needs_more_memory_per_device(kv_tokens, layers):
    cm = CostModel(CLUSTER, MODEL_PRESETS["llama-2-70b"])
    mems = [cm.stage_memory(StageLayout(tuple(range(t)), (0, layers)), kv_tokens, True, True) for t in (1, 2, 4, 8)]
    assert all(a >= b for a, b in zip(mems, mems[1:]))


@settings(max_examples=40, deadline=None)
@given(s=st.integers(1, 4000), extra=st.integers(1, 4000), tp=st.sampled_from([1, 2, 4]))
def test_longer_prompt_never_has_shorter_ttft(s, extra, tp):
    cm = CostModel(CLUSTER, LLAMA7)
    lay = one_stage(*range(tp))
    assert cm.ttft(lay, s + extra) >= cm.ttft(lay, s)


@settings(max_examples=40, deadline=None)
@given(b=st.integers(1, 256), ctx=st.integers(0, 4096), db=st.integers(0, 64), dctx=st.integers(0, 4096))
def test_decode_step_grows_with_batch_and_context(b, ctx, db, dctx):
    cm = CostModel(CLUSTER, LLAMA7)
    lay = one_stage(0, 1)
    assert cm.decode_step_time(lay, b + db, (b + db) * (ctx + dctx)) >= cm.decode_step_time(lay, b, b * ctx)


@settings(max_examples=30, deadline=None)
@given(tp_p=st.sampled_from([1, 2, 4]), tp_d=st.sampled_from([1, 2, 4]), cut=st.integers(1, 31),
       tokens=st.integers(1, 3000))
def test_kv_transfer_moves_every_byte_once(tp_p, tp_d, cut, tokens):
    cm = CostModel(CLUSTER, LLAMA7)
    src = one_stage(*range(tp_p))
    dst = ReplicaLayout((StageLayout(tuple(range(4, 4 + tp_d)), (0, cut)), StageLayout((8,), (cut, 32))))
    total = sum(b for *_, b in cm.kv_transfer_pairs(src, dst, tokens))
    assert total == pytest.approx(tokens * LLAMA7.kv_bytes_per_token)


def test_prefill_batch_helpers():
    b = PrefillBatch.of([3, 4])
    assert (b.num_seqs, b.tokens, b.sum_sq) == (2, 7, 25.0)
    assert np.isclose(PrefillBatch.single(5).sum_sq, 25)


def test_load_efficiency_flat_and_calibration_shapes(tmp_path):
    import json

    from hetserve.cost.efficiency import load_efficiency
    from hetserve.errors import SpecError

    flat = tmp_path / "e.json"
    flat.write_text(json.dumps({"compute": 0.3, "step_overhead_s": 0.002}))
    assert load_efficiency(flat) == Efficiency(compute=0.3, step_overhead_s=0.002)
    nested = tmp_path / "c.json"
    nested.write_text(json.dumps({"gpu": "L4", "efficiency": {"memory": 0.5}}))
    assert load_efficiency(nested).memory == 0.5
    bad = tmp_path / "b.json"
    bad.write_text(json.dumps({"speed": 1}))
    with pytest.raises(SpecError, match="speed"):
        load_efficiency(bad)
    # a calibration file's wrong key or value names its dotted field and what was expected
    for content, field, expected in (
            ({"gpu": "L4", "efficiency": {"memory": 0.5}, "bogus_key": 1}, "bogus_key", "calibration file's keys"),
            ({"gpu": "L4", "efficiency": {"memory": 0.5}, "mean_abs_error": "fast"}, "mean_abs_error", "a number"),
            ({"gpu": "L4", "efficiency": {"compute": "fast"}}, "efficiency.compute", "a number"),
            ({"gpu": "L4", "efficiency": {"bogus": 1}}, "efficiency.bogus", "one of"),
            ({"gpu": "L4", "efficiency": {"compute": 2.0}}, "efficiency.compute", "in [1e-18, 1]"),
            # each field checked by name: a cost is finite, a count whole
            ({"gpu": "L4", "efficiency": {"step_overhead_s": float("inf")}}, "efficiency.step_overhead_s", "finite"),
            ({"step_overhead_s": float("nan")}, "step_overhead_s", "finite"),
            ({"gpu": "L4", "efficiency": {"seq_overhead_s": -1e-3}}, "efficiency.seq_overhead_s", ">= 0"),
            ({"max_batch": 2.5}, "max_batch", "a whole number >= 1"),
            ({"gpu": "L4", "efficiency": {"activation_buffers": 2.5}}, "efficiency.activation_buffers", "whole"),
            ({"max_batch": 0}, "max_batch", ">= 1"),
            ({"turn_hold": 1.5}, "turn_hold", "in [0, 1]"),
            ([1, 2], "(file)", "a mapping"),
            ({"model": "llama-2-70b", "cluster": "het1", "replicas": []}, "(file)", "calibration file")):
        bad.write_text(json.dumps(content))
        with pytest.raises(SpecError) as err:
            load_efficiency(bad)
        assert (err.value.field, str(bad)) == (field, err.value.source) and expected in err.value.expected
    nested.write_text(json.dumps({"gpu": "L4", "efficiency": {"memory": 0.5, "turn_hold": None}}))
    assert load_efficiency(nested).turn_hold is None  # null where the field allows it
