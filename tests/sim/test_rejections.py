"""A request no replica can hold is rejected at arrival by the checks a served engine makes
(``policies.request_checks``), counted as rejected, and left out of latencies and throughput."""

import numpy as np
import pytest

from hetserve.errors import InfeasibleError
from hetserve.policies.request_checks import (ContextExceeded, EmptyPrompt, KVNeverFits, OutOfVocabulary,
                                              RequestRefused, check_context, check_kv_fits, check_prompt_ids,
                                              check_request)
from hetserve.sim import SimOptions, simulate
from hetserve.specs.workload import SLO, Workload

from .plans import single


def pd_plan():
    return single({"p0": ["m0:0"], "d0": ["m1:0"]}, routes=[("p0", "d0", 1.0)])


def trace(rows):
    """``rows``: (arrival s, prompt tokens, output tokens)."""
    a, i, o = zip(*rows)
    return Workload.from_lists("t", list(a), list(i), list(o))


GOOD = [(0.1 * k, 200 + 13 * k, 30 + 7 * k) for k in range(10)]


def test_a_request_needing_10e12_tokens_is_rejected_not_completed(cluster, model):
    rows = GOOD[:5] + [(0.45, 10**12, 50)] + GOOD[5:]
    res = simulate(pd_plan(), cluster, model, trace(rows))
    s = res.summary()
    assert s["requests"] == 11 and s["completed"] == 10 and s["rejected"] == 1
    assert s["rejected_by"] == {"context": 1}
    assert res.rejected[5] == "context" and not np.isfinite(res.t_finish[5])
    # rejected for its KV too when the context is not checked: no pool holds 10^12 tokens
    s = simulate(pd_plan(), cluster, model, trace(rows), SimOptions(beyond_context="run")).summary()
    assert s["completed"] == 10 and s["rejected_by"] == {"kv": 1}


def test_a_rejected_request_leaves_every_other_figure_as_without_it(cluster, model):
    """It is never placed and takes no KV: the other requests run exactly as without it, and the
    latency figures, throughput and token counts are theirs alone."""
    without = simulate(pd_plan(), cluster, model, trace(GOOD)).summary()
    with_bad = simulate(pd_plan(), cluster, model, trace(GOOD[:3] + [(0.25, 3000, 2000)] + GOOD[3:])).summary()
    assert with_bad["rejected"] == 1 and with_bad["requests"] == without["requests"] + 1
    for key in ("completed", "duration_s", "throughput_tokens_per_s", "output_tokens", "input_tokens",
                "ttft_s", "tpot_s", "e2e_s", "atgt_s", "queue_s", "kv_transfer_s", "requests_per_s"):
        assert with_bad[key] == without[key], key
    # a rejected request never attains the SLO: attainment counts it, goodput does not
    slo = SLO(ttft_s=100.0)
    s = simulate(pd_plan(), cluster, model, trace(GOOD[:3] + [(0.25, 3000, 2000)] + GOOD[3:]),
                 SimOptions(slo=slo)).summary()
    assert s["slo_attainment"] == pytest.approx(10 / 11)


def test_over_context_requests_run_as_given_on_request(cluster, model):
    rows = GOOD[:4] + [(0.35, 3000, 2000)] + GOOD[4:]
    s = simulate(pd_plan(), cluster, model, trace(rows), SimOptions(beyond_context="run")).summary()
    assert s["completed"] == 11 and s["rejected"] == 0
    with pytest.raises(ValueError, match="beyond_context"):
        SimOptions(beyond_context="drop")


def test_kv_that_fits_no_pool_is_rejected_by_the_pools_the_simulation_has(cluster, model):
    """The KV pools the run gives its replicas decide (``kv_capacity_tokens``), in whole blocks."""
    rows = [(0.0, 100, 28), (0.1, 100, 29), (0.2, 60, 4)]  # 128, 129 and 64 tokens of KV
    res = simulate(pd_plan(), cluster, model, trace(rows), SimOptions(kv_capacity_tokens=128, kv_block_tokens=16))
    assert list(res.rejected) == ["", "kv", ""]
    assert res.summary()["completed"] == 2


def test_the_simulated_pools_are_whole_blocks_as_the_runtimes(cluster, model):
    """Room for 1,000 tokens is a pool of 62 blocks of 16 (992 tokens) in the runtime's engine
    (``runtime.engine_config.kv_capacity``) and in the simulator: a request needing 993 is refused."""
    from hetserve.cost.analytic import CostModel
    from hetserve.runtime.deployment import build_layout
    from hetserve.runtime.engine_config import EngineConfig, kv_capacity
    from hetserve.runtime.model.config import llama_arch

    plan, rows = pd_plan(), [(0.0, 900, 92), (0.1, 900, 93)]  # 992 and 993 tokens of KV
    res = simulate(plan, cluster, model, trace(rows), SimOptions(kv_capacity_tokens=1000, kv_block_tokens=16))
    assert list(res.rejected) == ["", "kv"]
    assert {r.kv_capacity_tokens for r in res.replicas} == {992}
    arch = llama_arch(hidden=128, heads=4, ffn=256, layers=32, vocab=256)
    layout = build_layout(plan, cluster, arch, {d: "cpu" for d in plan.devices}, source="test")
    pools = kv_capacity(layout, cluster, arch, "float32", EngineConfig(kv_capacity_tokens=1000, block_size=16), True)
    assert {p.tokens for p in pools.values()} == {992}
    # the cost model's room (fractional tokens) is rounded the same way
    plain = simulate(plan, cluster, model, trace(rows[:1]), SimOptions(kv_block_tokens=16))
    room = CostModel(cluster, model).kv_capacity_tokens(plan.replica("d0").layout(cluster))
    assert room % 16 and plain.replicas[1].kv_capacity_tokens == room // 16 * 16


def test_the_checks_in_the_engines_order_and_words():
    check_request(100, 3996, 4096, [("colocated", 4096)], 16)  # exactly the context and the pool: served
    with pytest.raises(ContextExceeded, match="exceeds the model's context of 4096"):
        check_request(100, 3997, 4096, [("colocated", 1e9)], 16)
    with pytest.raises(EmptyPrompt):
        check_request(0, 10, 4096, [("colocated", 1e9)], 16)
    with pytest.raises(KVNeverFits, match="largest: 4000 tokens"):
        check_request(100, 3901, 8192, [("colocated", 4000)], 16)  # 4001 -> 4016 in whole blocks
    check_request(100, 3900, 8192, [("colocated", 4000)], 16)
    # the prefill side holds the prompt only; the decode side prompt + output; each side needs one
    check_kv_fits(1000, 3000, [("prefill", 1008), ("decode", 4000)], 16)
    with pytest.raises(KVNeverFits) as short:
        check_kv_fits(1000, 3000, [("prefill", 992), ("decode", 1e9)], 16)
    assert (short.value.side, short.value.largest_pool, short.value.prompt_alone) == ("prefill", 992, True)
    with pytest.raises(KVNeverFits, match="replica that decodes .largest: 3984 tokens") as short:
        check_kv_fits(1000, 3000, [("prefill", 1e9), ("decode", 3984)], 16)
    assert (short.value.side, short.value.largest_pool, short.value.prompt_alone) == ("decode", 3984, False)
    # the context is skipped on request; the KV still decides
    check_request(100, 5000, 4096, [("colocated", 1e9)], 16, context=False)
    check_context(4095, 1, 4096)
    with pytest.raises(EmptyPrompt):
        check_prompt_ids([], 32000)
    with pytest.raises(OutOfVocabulary, match=r"\[32000\] are outside the vocabulary \[0, 32000\)"):
        check_prompt_ids([1, 32000], 32000)


def test_the_refusals_are_the_types_a_server_maps_to_a_bad_request():
    """Prompt refusals are ValueErrors, the KV one an InfeasibleError: what the engine raised before."""
    assert issubclass(ContextExceeded, ValueError) and issubclass(EmptyPrompt, ValueError)
    assert issubclass(OutOfVocabulary, ValueError) and issubclass(KVNeverFits, InfeasibleError)
    assert not issubclass(KVNeverFits, ValueError)
    assert all(issubclass(c, RequestRefused) for c in (ContextExceeded, EmptyPrompt, OutOfVocabulary, KVNeverFits))
