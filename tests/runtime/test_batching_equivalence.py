"""The simulator and the engine form the same batches, step by step, for the same arrivals.

One colocated replica of the tiny Llama (one stage, so the engine runs one step at a time), a small
KV pool, token budget and sequence limit, so admission is decided by all three limits in turn.
The engine runs first with real worker processes; its coordinator records each submission and each
step. The simulator then replays the same requests, each arriving just before the step that
preceded it in the engine (the simulator's own clock, found step by step), and its colocated replica
records each iteration. Both must list the same (decode ids, prompt ids) for every step.

The same again with chunked prefill (``prefill_mode="chunked"``, 20 tokens per step with the decodes
counted): the prompt ids of a step are then the prompts feeding a chunk in it.
"""

from __future__ import annotations

import dataclasses
import time

import pytest

# (prompt length, max_tokens) and the phase each is submitted in: phase p starts once the first
# request of phase p - 1 has streamed 3 tokens. Each limit decides somewhere: phase 1's prompts fill
# the token budget exactly (30 + 18 = 48), so beside a running decode only one fits; phase 2's r3
# needs 6 KV blocks of the 5 left (KV) and, once in, is longer than the budget (it runs as the
# step's only prompt); phase 3 meets four running sequences (the sequence cap) with KV to spare.
REQUESTS = [(10, 40), (30, 8), (18, 8), (70, 12), (9, 20), (25, 6), (12, 16), (33, 10)]
PHASES = [0, 1, 1, 2, 2, 2, 3, 3]
KV_TOKENS = 224  # 14 blocks of 16
TOKEN_BUDGET = 48
MAX_SEQS = 4
CHUNK = 20


def _engine_trace(model_dir, cluster_file, plan, mode):
    from hetserve.runtime.engine import Engine, EngineConfig
    from hetserve.runtime.sampling import SamplingParams

    cfg = EngineConfig(kv_capacity_tokens=KV_TOKENS, max_batched_tokens=TOKEN_BUDGET, max_num_seqs=MAX_SEQS,
                       prefill_mode=mode, chunk_tokens=CHUNK)
    eng = Engine.from_plan(plan, cluster_file, model_dir, cfg)
    try:
        eng.coordinator.trace = []
        handles = []
        for i, (n, out) in enumerate(REQUESTS):
            if i and PHASES[i] != PHASES[i - 1]:
                lead = handles[PHASES.index(PHASES[i - 1])]
                deadline = time.monotonic() + 60
                while len(lead.tokens) < 3 and not lead.finished:
                    assert time.monotonic() < deadline, "the engine stopped producing tokens"
                    time.sleep(0.001)
            prompt = [(7 * i + k) % 200 + 3 for k in range(n)]
            handles.append(eng.submit(prompt, SamplingParams(max_tokens=out, ignore_eos=True)))
        for h in handles:
            h.result(timeout=60)
        return eng.coordinator.trace, [h.request_id for h in handles]
    finally:
        eng.shutdown()


def _sim_steps(plan, cluster_file, model_dir, arrivals_before_step, mode):
    """Simulate, placing request i just before the simulator's step ``arrivals_before_step[i]``."""
    import numpy as np

    from hetserve.sim import SimOptions
    from hetserve.sim.simulator import Simulator
    from hetserve.specs.cluster import load_cluster
    from hetserve.specs.model import load_model
    from hetserve.specs.workload import Workload

    cluster = load_cluster(str(cluster_file))
    model = dataclasses.replace(load_model(model_dir), name=plan.model)
    opts = SimOptions(token_budget=TOKEN_BUDGET, max_batch=MAX_SEQS, kv_capacity_tokens=KV_TOKENS,
                      kv_block_tokens=16, chunked_prefill=mode == "chunked", chunk_tokens=CHUNK)

    def run(times):
        k = len(times)
        wl = Workload.from_lists("replay", times, [n for n, _ in REQUESTS[:k]], [o for _, o in REQUESTS[:k]])
        sim = Simulator(plan, cluster, model, wl, opts)
        sim.replicas[0].trace = []
        sim.run()
        return sim.replicas[0].trace

    times: list[float] = [0.0]  # the first request opens the run (workloads start at 0)
    for k in arrivals_before_step[1:]:
        steps = run(times)
        if k < len(steps):  # just before step k starts (a thousandth of a step: the clock is the cost model's)
            start, end = steps[k][:2]
            t = max(start - 1e-3 * (end - start), times[-1])
        else:  # the replica was idle when it arrived: after everything so far
            t = max(steps[-1][1] * (1 + 1e-3), times[-1])
        times.append(t)
    steps = run(times)
    assert np.all(np.diff(times) >= 0)
    return [(tuple(d), tuple(p)) for _, _, d, p in steps]


def compare(trace, ids, plan, cluster_file, model_dir, mode):
    """Engine steps and simulator steps, as (sorted decode indices, prompt indices) per step."""
    index = {rid: i for i, rid in enumerate(ids)}
    arrivals, engine_steps = {}, []
    for ev in trace:
        if ev[0] == "arrive":
            arrivals[index[ev[1]]] = len(engine_steps)
        else:
            engine_steps.append((tuple(sorted(index[x] for x in ev[2])), tuple(index[x] for x in ev[3])))
    before = [arrivals[i] for i in range(len(REQUESTS))]
    sim_steps = [(tuple(sorted(d)), p) for d, p in _sim_steps(plan, cluster_file, model_dir, before, mode)]
    return engine_steps, sim_steps


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["mixed", "chunked"])
def test_simulator_and_engine_form_the_same_batches(model_dirs, cluster_file, plans, mode):
    plan = plans.single()
    trace, ids = _engine_trace(model_dirs["llama"], cluster_file, plan, mode)
    engine_steps, sim_steps = compare(trace, ids, plan, cluster_file, model_dirs["llama"], mode)
    for i, (n, out) in enumerate(REQUESTS):  # each request: its prefill steps, then max_tokens - 1 decodes
        chunks = sum(i in p for _, p in engine_steps)
        assert chunks == 1 if mode == "mixed" else chunks >= -(-n // CHUNK)
        assert sum(i in d for d, _ in engine_steps) == out - 1
    if mode == "chunked":
        assert any(sum(i in p for _, p in engine_steps) > -(-n // CHUNK) for i, (n, _) in enumerate(REQUESTS))
        assert any(len(p) > 1 for _, p in engine_steps)  # one step fed chunks of two prompts
    assert max(len(d) + len(p) for d, p in engine_steps) == MAX_SEQS  # the sequence cap was reached
    assert any(p and d for d, p in engine_steps)  # prompts rode in decode steps
    for k, (e, s) in enumerate(zip(engine_steps, sim_steps)):
        assert e == s, f"step {k}: engine {e} vs simulator {s}"
    assert len(sim_steps) == len(engine_steps)
