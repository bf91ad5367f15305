"""A colocated pipeline keeps up to ``m`` steps in flight, as the runtime's scheduler does: a prompt
that finds a micro-batch slot free runs at once in a step of its own, beside the decoding micro-batch,
instead of waiting for its iteration boundary and pausing it for a mixed step (the aggregate model
before; the served prompt steps of bench_predict's two pipelines carried 0.10-0.35 decodes on
average, the simulated ones 0.42-0.90, and the light cells' TTFT p90 was over-predicted 1.25-1.32x)."""

from collections import deque

import pytest

from hetserve.cost.analytic import CostModel, PrefillBatch
from hetserve.planner.plan import Plan
from hetserve.sim import SimOptions, simulate
from hetserve.specs.cluster import cluster_from_dict
from hetserve.specs.workload import Workload

CLUSTER = cluster_from_dict({"name": "test", "machines": [
    {"name": "m0", "gpu": "A100-SXM-80G", "count": 2, "site": "s0"}]})
PROMPT = 300
ARRIVAL = 0.5  # the second prompt arrives while the first request decodes


def _plan(stages):
    split = [[0, 32]] if stages == 1 else [[0, 16], [16, 32]]
    return Plan.from_dict({"model": "llama-2-7b", "cluster": "test", "replicas": [
        {"id": "c0", "role": "colocated",
         "stages": [{"devices": [f"m0:{i}"], "layers": lay} for i, lay in enumerate(split)]}]})


def _run(model, stages):
    wl = Workload.from_lists("two", [0.0, ARRIVAL], [PROMPT, PROMPT], [400, 20])
    plan = _plan(stages)
    return simulate(plan, CLUSTER, model, wl, SimOptions()), plan.replicas[0].layout(CLUSTER)


def test_a_prompt_on_a_pipeline_with_a_free_slot_starts_at_once(model):
    res, layout = _run(model, 2)
    cm = CostModel(CLUSTER, model)
    assert res.t_first[0] < ARRIVAL < res.t_finish[0]  # request 0 decodes: one micro-batch of two in flight
    assert res.t_start[1] == pytest.approx(ARRIVAL, abs=1e-12)  # no wait for request 0's iteration boundary
    assert res.t_first[1] - ARRIVAL == pytest.approx(cm.prefill_time(layout, PrefillBatch.single(PROMPT)), rel=1e-9)
    # and it then decodes with request 0 (two micro-batches) until it is done
    assert res.t_finish[1] < res.t_finish[0]


def test_the_decoding_micro_batch_waits_behind_the_prompt(model):
    """The prompt's step goes first through every stage (each stage's worker runs steps first come,
    first served): request 0 gains no token from its next iteration boundary until the prompt is
    through, so it finishes a prefill later, less at most one iteration. Request 1 only prefills."""
    plan = _plan(2)
    layout = plan.replicas[0].layout(CLUSTER)
    cm = CostModel(CLUSTER, model)
    alone = simulate(plan, CLUSTER, model, Workload.from_lists("one", [0.0], [PROMPT], [400]), SimOptions())
    both = simulate(plan, CLUSTER, model, Workload.from_lists("two", [0.0, ARRIVAL], [PROMPT, PROMPT], [400, 1]),
                    SimOptions())
    prefill = cm.prefill_time(layout, PrefillBatch.single(PROMPT))
    step = cm.decode_step_time(layout, 1, PROMPT + 200)
    assert both.t_first[1] - ARRIVAL == pytest.approx(prefill, rel=1e-9)
    assert prefill - step <= both.t_finish[0] - alone.t_finish[0] <= prefill + 1e-9


def test_one_stage_still_mixes_the_prompt_into_the_next_iteration(model):
    """One stage runs one step at a time (the runtime too): the prompt waits for the boundary and
    rides in a mixed iteration with the decode, which costs more than the prompt alone."""
    res, layout = _run(model, 1)
    cm = CostModel(CLUSTER, model)
    assert res.t_start[1] >= ARRIVAL
    assert res.t_first[1] - ARRIVAL > cm.prefill_time(layout, PrefillBatch.single(PROMPT)) * (1 + 1e-6)


def test_the_runtime_scheduler_gives_the_prompt_its_own_step_when_a_slot_is_free():
    """The rule the simulator follows is the runtime's: two stages, one decode step in flight, a
    prompt waiting -> the next step is the prompt alone; with both slots busy, nothing starts."""
    from hetserve.runtime.handle import RequestHandle
    from hetserve.runtime.kv_cache import BlockManager
    from hetserve.runtime.params import SamplingParams
    from hetserve.runtime.scheduler import ReplicaScheduler
    from hetserve.runtime.sequence import Sequence

    def _seq(i, prompt_len, max_tokens):
        return Sequence(i, [1] * prompt_len, SamplingParams(max_tokens=max_tokens), 0, frozenset(),
                        RequestHandle(i, prompt_len))

    sched = ReplicaScheduler("c0", "colocated", BlockManager(64, 16), num_stages=2)
    first = sched.next_step(deque([_seq(1, 20, 10)]))
    sched.start(1, first)
    for s in sched.complete(1):
        s.num_cached, s.output = 20, [5]
        sched.ready.append(s)
    decode = sched.next_step(deque())
    assert [s.id for s in decode] == [1]
    sched.start(2, decode)  # request 1 decoding: one step of two in flight
    prompt = sched.next_step(deque([_seq(2, 30, 4)]))
    assert [s.id for s in prompt] == [2]  # its own step, at once
    sched.start(3, prompt)
    assert not sched.can_start_step()
