"""The simulator's step trace as ``hetserve compare`` reads it (``hetserve.step_compare``): every prompt
token and every decode token of a burst lands in exactly one traced step, whatever the batching."""

import numpy as np
import pytest

from hetserve.sim import SimOptions
from hetserve.sim.simulator import Simulator
from hetserve.step_compare import simulated_rows, summarise

from .plans import single
from .test_behaviour import burst


@pytest.mark.parametrize("replicas", [{"p0": ["m0:0"], "d0": ["m1:0"]}, {"c0": ["m0:0"]}])
def test_every_token_of_a_burst_is_in_one_traced_step(cluster, model, replicas):
    wl = burst(12, inp=300, out=20)  # all at t = 0: prompts and decodes are batched
    routes = [("p0", "d0", 1.0)] if "p0" in replicas else None
    sim = Simulator(single(replicas, routes=routes), cluster, model, wl, SimOptions())
    for rep in sim.replicas:
        rep.trace = []
    sim.run()
    rows = simulated_rows(sim.replicas, lambda i: int(wl.input_tokens[i]))
    steps = summarise(rows)
    first = "p0" if "p0" in replicas else "c0"
    last = "d0" if "d0" in replicas else "c0"
    pre, dec = steps[f"{first} prompt"], steps[f"{last} decode"]
    decode_slots = sum(len(r.decode_ids) for r in rows)  # mixed steps carry decodes too
    assert pre["steps"] * pre["prompt_tokens"] == pytest.approx(wl.input_tokens.sum())
    assert pre["steps"] < 12 and dec["decodes"] > 1  # batched: the trace is not one request per step
    assert decode_slots == (np.asarray(wl.output_tokens) - 1).sum()
    assert all(r.finished > r.started for r in rows) and dec["token_ms"] > 0
