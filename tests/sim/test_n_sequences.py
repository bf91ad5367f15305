"""A request's n choices and prompt scoring, priced and held as the runtime's engine serves them.

The engine (``EngineLoop._fork``) prefills the prompt once, lets the other choices share its full KV
blocks, and decodes one row per choice; a scoring request runs the LM head over every prompt
position. The figures the engine's own test holds (tests/runtime/test_sampler_logprobs.py: 34 blocks
for n = 1 and 43 for n = 4 on a 512-token prompt with 32 new tokens, 16-token blocks) are the ones
the simulator must hold here."""

import numpy as np
import pytest

from hetserve.cost.analytic import PrefillBatch
from hetserve.sim import SimOptions, simulate
from hetserve.specs.workload import Workload, load_workload

from .plans import single

PROMPT, OUT, BS = 512, 32, 16


def one(n: int = 1, scored: bool = False, out: int = OUT) -> Workload:
    return Workload.from_lists("one", [0.0], [PROMPT], [out], [n], [scored])


def replica(res, rid):
    return next(r for r in res.replicas if r.id == rid)


@pytest.mark.parametrize("kv", ["reserve", "paged"])
def test_n4_decodes_four_rows_a_step_and_generates_four_times_the_tokens(cluster, model, cost, kv):
    plan = single({"c0": ["m0:0"]})
    layout = plan.replica("c0").layout(cluster)
    opts = SimOptions(kv_admission=kv)
    r1, r4 = simulate(plan, cluster, model, one(1), opts), simulate(plan, cluster, model, one(4), opts)
    # the decode iterations after the prefill: one row per choice, each choice's context its own
    for res, n in ((r1, 1), (r4, 4)):
        first = cost.decode_step_time(layout, n, n * (PROMPT + 1))
        last = cost.decode_step_time(layout, n, n * (PROMPT + OUT - 1))
        assert res.tpot[0] == pytest.approx((first + last) / 2, rel=1e-9)
        assert res.summary()["output_tokens"] == n * OUT
    assert r4.tpot[0] > r1.tpot[0]  # four rows cost more per step than one ...
    s1, s4 = r1.summary(), r4.summary()
    assert s4["throughput_tokens_per_s"] > 2.5 * s1["throughput_tokens_per_s"]  # ... but far less than 4x


def test_n4_holds_the_prompts_full_blocks_once_as_the_engine_does(cluster, model):
    plan = single({"c0": ["m0:0"]})
    peak = [replica(simulate(plan, cluster, model, one(n)), "c0").kv_peak_tokens / BS for n in (1, 4)]
    assert peak == [34, 43]  # the engine's blocks: 31 shared + 4 x (1 prompt block + 2 for 32 tokens)
    assert peak[1] <= 1.3 * peak[0]
    # paged KV and scoring requests share nothing (the engine queues those choices alone)
    paged = replica(simulate(plan, cluster, model, one(4), SimOptions(kv_admission="paged")), "c0")
    assert paged.kv_peak_tokens / BS == 4 * 34
    assert replica(simulate(plan, cluster, model, one(4, scored=True)), "c0").kv_peak_tokens / BS == 4 * 34


def test_n4_on_a_disaggregated_plan_sends_each_choices_kv(cluster, model):
    plan = single({"p0": ["m0:0"], "d0": ["m1:0"]}, routes=[("p0", "d0", 1.0)])
    r1, r4 = simulate(plan, cluster, model, one(1)), simulate(plan, cluster, model, one(4))
    assert replica(r4, "p0").kv_peak_tokens == 31 * BS + 4 * BS  # prompt blocks shared where prefilled
    assert replica(r4, "d0").kv_peak_tokens == 4 * replica(r1, "d0").kv_peak_tokens  # each hand-off its own
    sent = [sum(v["bytes"] for v in res.info["links"].values()) for res in (r1, r4)]
    assert sent[0] > 0 and sent[1] == pytest.approx(4 * sent[0])
    assert r4.summary()["completed"] == 1


def test_prompt_logprobs_price_the_prefill_higher_by_exactly_the_lm_head_term(cluster, cost):
    plan = single({"c0": ["m0:0", "m0:1"]})
    layout = plan.replica("c0").layout(cluster)
    last = layout.stages[-1]
    plain, scored = PrefillBatch.single(PROMPT), PrefillBatch.single(PROMPT, scored=True)
    extra = cost.prompt_logprob_time(last, PROMPT - 1)
    assert cost.prefill_time(layout, scored) - cost.prefill_time(layout, plain) == pytest.approx(extra, rel=1e-12)
    # the head over every position (2 * positions * hidden * vocab FLOPs) outweighs one row's
    m = cost.model
    assert extra > 2.0 * (PROMPT - 1) * m.hidden * m.vocab / (2 * max(cost._flops))
    # and the simulator charges it on the request's prefill
    base = simulate(plan, cluster, cost.model, one(1, out=1))
    sc = simulate(plan, cluster, cost.model, one(1, scored=True, out=1))
    assert sc.ttft[0] - base.ttft[0] == pytest.approx(extra, rel=1e-9)


def test_trace_columns_n_and_prompt_logprobs_are_optional(tmp_path):
    old = tmp_path / "old.csv"
    old.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n0,10,5\n1,20,6\n")
    wl = load_workload(old)
    assert wl.choices.tolist() == [1, 1] and not wl.prompt_logprobs.any()
    new = tmp_path / "new.csv"
    new.write_text("num_prefill_tokens,num_decode_tokens,n,prompt_logprobs\n10,5,4,0\n20,1,1,1\n")
    wl = load_workload(new, rate=2.0)
    assert wl.choices.tolist() == [4, 1] and wl.prompt_logprobs.tolist() == [False, True]
    assert wl.head(1).choices.tolist() == [4] and wl.repeat(2).prompt_logprobs.tolist() == [False, True] * 2
    bad = tmp_path / "bad.csv"
    bad.write_text("num_prefill_tokens,num_decode_tokens,n\n10,5,0\n")
    with pytest.raises(Exception, match="choices"):
        load_workload(bad)


def test_detailed_pipelines_refuse_what_they_do_not_model(cluster, model):
    plan = single({"c0": ["m0:0"]})
    two = {"model": "llama-2-7b", "cluster": "test", "replicas": [{"id": "c0", "role": "colocated", "stages": [
        {"devices": ["m0:0"], "layers": [0, 16]}, {"devices": ["m0:1"], "layers": [16, 32]}]}]}
    from hetserve.planner.plan import Plan
    with pytest.raises(ValueError, match="aggregate"):
        simulate(Plan.from_dict(two), cluster, model, one(4), SimOptions(pipeline="detailed"))
    assert simulate(plan, cluster, model, one(1), SimOptions(pipeline="detailed")).summary()["completed"] == 1
    assert np.isfinite(simulate(Plan.from_dict(two), cluster, model, one(4)).tpot[0])


@pytest.mark.parametrize("choices, scoring", [(4, 0.0), (2, 0.5)])
def test_the_planners_colocated_capacity_with_choices_is_what_the_simulator_delivers(choices, scoring):
    """A saturated colocated replica (tests/sim/test_capacity_agreement.py's setting) serving requests
    of n choices, some scoring their prompt: ``colocated_capacity(choices=, scoring=)``, in output
    tokens/s of every choice, within 5 % of the simulated steady state."""
    from hetserve.cost.analytic import CostModel

    from .test_capacity_agreement import CLUSTER, MODEL, PLAN, saturated_tokens_per_s

    rng = np.random.default_rng(0)
    n = 600
    ins, outs = rng.integers(256, 769, n), rng.integers(80, 121, n)
    scored = rng.random(n) < scoring
    wl = Workload.from_lists("backlog", np.zeros(n), ins, outs, [choices] * n, scored)
    res = simulate(PLAN, CLUSTER, MODEL, wl)
    res.output_tokens = res.output_tokens * choices  # every choice's tokens, as the capacity counts them
    layout = PLAN.replica("c0").layout(CLUSTER)
    cost = CostModel(CLUSTER, MODEL)
    planned = cost.colocated_capacity(layout, ins.mean(), outs.mean(), 1.0, choices, scored.mean())
    assert saturated_tokens_per_s(res) == pytest.approx(planned * choices * outs.mean(), rel=0.05)
    plain = cost.colocated_capacity(layout, ins.mean(), outs.mean(), 1.0)
    assert planned < plain  # n choices per request: fewer requests a period
