"""The simulator and the engine form the same batches, step by step, for the same arrivals.

One colocated replica of the tiny Llama (one stage, so the engine runs one step at a time), a small
KV pool, token budget and sequence limit, so admission is decided by all three limits in turn.
The engine runs first with real worker processes; its coordinator records each submission and each
step. The simulator then replays the same requests, each arriving just before the step that
preceded it in the engine (the simulator's own clock, found step by step), and its colocated replica
records each iteration. Both must list the same (decode ids, prompt ids) for every step.

The same again with chunked prefill (``prefill_mode="chunked"``, 20 tokens per step with the decodes
counted): the prompt ids of a step are then the prompts feeding a chunk in it.

And with paged KV admission (``kv_admission="paged"``, ``policies.kv_admission``) on a pool of 10
blocks that long outputs overflow: both must pre-empt the same requests before the same steps, and
recompute them in the same steps; the engine's greedy tokens must still be the model's.
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


@dataclasses.dataclass(frozen=True)
class Case:
    mode: str = "mixed"
    kv_admission: str = "reserve"
    requests: tuple = tuple(REQUESTS)
    phases: tuple = tuple(PHASES)
    kv_tokens: int = KV_TOKENS


# Paged: 10 blocks of 16. Every prompt fits at admission, but the outputs grow past the pool (final
# footprints 5 + 5 + 4 + 3 blocks), so the latest arrivals are pre-empted and recomputed, some twice.
PAGED = Case(kv_admission="paged", requests=((20, 60), (20, 50), (24, 40), (15, 30)), phases=(0, 1, 1, 2),
             kv_tokens=160)
CASES = {"mixed": Case(), "chunked": Case(mode="chunked"), "paged": PAGED,
         "paged-chunked": dataclasses.replace(PAGED, mode="chunked")}


def _prompt(i, n):
    return [(7 * i + k) % 200 + 3 for k in range(n)]


def _engine_trace(model_dir, cluster_file, plan, case):
    from hetserve.runtime.engine import Engine
    from hetserve.runtime.engine_config import EngineConfig
    from hetserve.runtime.params import SamplingParams

    cfg = EngineConfig(kv_capacity_tokens=case.kv_tokens, max_batched_tokens=TOKEN_BUDGET, max_num_seqs=MAX_SEQS,
                       prefill_mode=case.mode, chunk_tokens=CHUNK, kv_admission=case.kv_admission)
    eng = Engine.from_plan(plan, cluster_file, model_dir, cfg)
    try:
        eng.loop.trace = []
        handles = []
        for i, (n, out) in enumerate(case.requests):
            if i and case.phases[i] != case.phases[i - 1]:
                lead = handles[case.phases.index(case.phases[i - 1])]
                deadline = time.monotonic() + 60
                while len(lead.tokens) < 3 and not lead.finished:
                    assert time.monotonic() < deadline, "the engine stopped producing tokens"
                    time.sleep(0.001)
            handles.append(eng.submit(_prompt(i, n), SamplingParams(max_tokens=out, ignore_eos=True)))
        outputs = [h.result(timeout=60) for h in handles]
        return eng.loop.trace, [h.request_id for h in handles], outputs
    finally:
        eng.shutdown()


def _sim_steps(plan, cluster_file, model_dir, arrivals_before_step, case):
    """Simulate, placing request i just before the simulator's step ``arrivals_before_step[i]``."""
    import numpy as np

    from hetserve.sim import SimOptions
    from hetserve.sim.simulator import Simulator
    from hetserve.specs.cluster import load_cluster
    from hetserve.specs.model import load_model
    from hetserve.specs.workload import Workload

    cluster = load_cluster(str(cluster_file))
    model = dataclasses.replace(load_model(model_dir), name=plan.model)
    opts = SimOptions(token_budget=TOKEN_BUDGET, max_batch=MAX_SEQS, kv_capacity_tokens=case.kv_tokens,
                      kv_block_tokens=16, chunked_prefill=case.mode == "chunked", chunk_tokens=CHUNK,
                      kv_admission=case.kv_admission)
    reqs = case.requests
    preempted = []

    def run(times):
        k = len(times)
        wl = Workload.from_lists("replay", times, [n for n, _ in reqs[:k]], [o for _, o in reqs[:k]])
        sim = Simulator(plan, cluster, model, wl, opts)
        sim.replicas[0].trace = []
        sim.run()
        preempted[:] = sim.replicas[0].preempt_trace
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
    return [(tuple(d), tuple(p)) for _, _, d, p in steps], list(preempted)


def compare(trace, ids, plan, cluster_file, model_dir, case):
    """Engine steps and simulator steps, as (sorted decode indices, prompt indices) per step, and
    each side's pre-emptions as (index of the step they came before, pre-empted indices)."""
    index = {rid: i for i, rid in enumerate(ids)}
    arrivals, engine_steps, engine_pre = {}, [], []
    for ev in trace:
        if ev[0] == "arrive":
            arrivals[index[ev[1]]] = len(engine_steps)
        elif ev[0] == "preempt":
            engine_pre.append((len(engine_steps), tuple(index[x] for x in ev[2])))
        else:
            engine_steps.append((tuple(sorted(index[x] for x in ev[2])), tuple(index[x] for x in ev[3])))
    before = [arrivals[i] for i in range(len(case.requests))]
    steps, sim_pre = _sim_steps(plan, cluster_file, model_dir, before, case)
    sim_steps = [(tuple(sorted(d)), p) for d, p in steps]
    return engine_steps, sim_steps, engine_pre, sim_pre


def greedy(model_dir, prompt, n):
    """The model's greedy continuation of ``prompt``, ``n`` tokens, EOS ignored (as the engine's requests)."""
    import torch

    from .conftest import _HF_CACHE, hf_greedy

    hf_greedy(model_dir, [], 0)  # loads (and caches) the model
    model, out = _HF_CACHE[str(model_dir)], []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: one thread is ~10x faster on a busy machine
    try:
        with torch.no_grad():
            res = model(torch.tensor([prompt]), use_cache=True)
            for _ in range(n):
                out.append(int(res.logits[0, -1].argmax()))
                res = model(torch.tensor([[out[-1]]]), past_key_values=res.past_key_values, use_cache=True)
    finally:
        torch.set_num_threads(threads)
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", list(CASES))
def test_simulator_and_engine_form_the_same_batches(model_dirs, cluster_file, plans, name):
    case, mode = CASES[name], CASES[name].mode
    plan = plans.single()
    trace, ids, outputs = _engine_trace(model_dirs["llama"], cluster_file, plan, case)
    engine_steps, sim_steps, engine_pre, sim_pre = compare(trace, ids, plan, cluster_file, model_dirs["llama"], case)
    for i, (n, out) in enumerate(case.requests):  # each request: its prefill steps, then max_tokens - 1 decodes
        chunks = sum(i in p for _, p in engine_steps)
        recomputes = sum(i in v for _, v in engine_pre)  # each pre-emption: one more prefill, one decode less
        assert chunks == 1 + recomputes if mode == "mixed" else chunks >= -(-n // CHUNK)
        assert sum(i in d for d, _ in engine_steps) == out - 1 - recomputes
    if case.kv_admission == "paged":
        assert len({v for _, vs in engine_pre for v in vs}) >= 2  # pre-emption happened, to two requests at least
        assert engine_pre == sim_pre, f"pre-emptions: engine {engine_pre} vs simulator {sim_pre}"
        for k, victims in engine_pre:  # the latest arrivals of those running went
            running = set(engine_steps[k - 1][0]) | set(engine_steps[k - 1][1])
            assert set(victims) <= running and min(victims) > max(running - set(victims)), (k, victims, running)
        model_dir = model_dirs["llama"]
        for i in sorted({v for _, vs in engine_pre for v in vs}):  # recomputed, still the model's tokens
            n, out = case.requests[i]
            assert outputs[i] == greedy(model_dir, _prompt(i, n), out), f"request {i}"
    if case == CASES["chunked"]:
        assert any(sum(i in p for _, p in engine_steps) > -(-n // CHUNK) for i, (n, _) in enumerate(REQUESTS))
        assert any(len(p) > 1 for _, p in engine_steps)  # one step fed chunks of two prompts
    if case.kv_admission == "reserve":
        assert max(len(d) + len(p) for d, p in engine_steps) == MAX_SEQS  # the sequence cap was reached
    assert any(p and d for d, p in engine_steps)  # prompts rode in decode steps
    for k, (e, s) in enumerate(zip(engine_steps, sim_steps)):
        assert e == s, f"step {k}: engine {e} vs simulator {s}"
    assert len(sim_steps) == len(engine_steps)
