"""n = 4 choices of a 512-token prompt with 32 new tokens, on the engine and in the simulator: the
same KV blocks at the peak (the prompt's full blocks held once), and the same decode rows, four per
step (the engine prefills the other choices' rests in the step after the first one's prefill, so its
first and last decode steps carry three and one fewer rows; the simulator's choices start together:
docs/simulator.md). One worker and a tiny Llama start in about 10 s, the simulator in no time: ``long``."""

from __future__ import annotations

import dataclasses

import pytest

from hetserve.runtime.params import SamplingParams

pytestmark = pytest.mark.long

PROMPT = [(i * 7) % 250 + 1 for i in range(512)]
OUT = 32


@pytest.fixture(scope="module")
def plan():
    from hetserve.planner.plan import Plan

    from tests.runtime.conftest import LAYERS

    return Plan.from_dict({"model": "tiny", "cluster": "runtime-test", "replicas": [
        {"id": "c0", "role": "colocated", "stages": [{"devices": ["m0:0"], "layers": [0, LAYERS]}]}]})


def engine_runs(plan, cluster_file, model_dir) -> dict[int, tuple[list[tuple[int, int]], int]]:
    """n -> ((decode rows, prompts) per step, peak KV blocks) of one request of n choices."""
    from hetserve.runtime.engine import Engine
    from hetserve.runtime.engine_config import EngineConfig

    eng = Engine.from_plan(plan, cluster_file, model_dir, EngineConfig(kv_capacity_tokens=4096, block_size=16))
    blocks, out = eng.schedulers["c0"].blocks, {}
    try:
        for n in (1, 4):
            eng.loop.trace = []
            blocks.peak_used_blocks = blocks.num_used_blocks
            params = [SamplingParams(max_tokens=OUT, temperature=1.0, seed=100 + i, ignore_eos=True) for i in range(n)]
            first = eng.submit(PROMPT, params[0], replica="c0")
            rest = [eng.submit(PROMPT, p, replica="c0", share_prefix_with=first) for p in params[1:]]
            for h in (first, *rest):
                h.result(60)
            steps = [(len(ev[2]), len(ev[3])) for ev in eng.loop.trace if ev[0] == "step"]
            out[n] = steps, blocks.peak_used_blocks
    finally:
        eng.shutdown()
    return out


def sim_run(plan, cluster_file, model_dir, n: int) -> tuple[list[tuple[int, int]], float]:
    from hetserve.sim import SimOptions
    from hetserve.sim.simulator import Simulator
    from hetserve.specs.cluster import load_cluster
    from hetserve.specs.model import load_model
    from hetserve.specs.workload import Workload

    model = dataclasses.replace(load_model(model_dir), name=plan.model)
    sim = Simulator(plan, load_cluster(str(cluster_file)), model, Workload.from_lists("one", [0.0], [512], [OUT], [n]),
                    SimOptions(kv_capacity_tokens=4096, kv_block_tokens=16))
    sim.replicas[0].trace = []
    sim.run()
    steps = [(len(d) * n, len(p) * n) for _, _, d, p in sim.replicas[0].trace]  # a request's rows are its choices
    return steps, sim.replicas[0].kv_peak / 16


def test_n_choices_hold_and_decode_in_the_simulator_as_on_the_engine(plan, cluster_file, model_dirs):
    engine = engine_runs(plan, cluster_file, model_dirs["llama"])
    for n in (1, 4):
        e_steps, e_peak = engine[n]
        s_steps, s_peak = sim_run(plan, cluster_file, model_dirs["llama"], n)
        assert s_peak == e_peak == (34 if n == 1 else 43)
        assert sum(d for d, _ in s_steps) == sum(d for d, _ in e_steps) == n * (OUT - 1)  # every decode row
        assert max(d for d, _ in s_steps) == max(d for d, _ in e_steps) == n  # n rows a step
    assert engine[1][0] == sim_run(plan, cluster_file, model_dirs["llama"], 1)[0]  # n = 1: step for step
