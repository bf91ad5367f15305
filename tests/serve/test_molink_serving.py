"""MoLink transmission scheduling measured for real: a three-stage pipeline whose stage-to-stage
links are shaped to 100 Mbit/s and 30 ms (the MoLink preset), under a mixed load of long prompts
(bulk prefill activations) arriving while short requests decode. The same requests, at the same
offsets, run once with FIFO (serial) links and once with MoLink. What MoLink changes is the order
on the wire: decode activations overtake bulk prefill chunks. So the test asserts on what the links
themselves recorded — the mean time a decode message waited for its first byte to go out — which
the ordering sets (a FIFO decode message waits behind ~80 ms prefill chunks), not on end-to-end
TPOT, which CPU contention on a loaded machine can swamp. Two runs compared, no wall-clock threshold."""

from __future__ import annotations

import numpy as np
import pytest


PLAN = {"model": "mid", "cluster": "molink-3x4090", "replicas": [
    {"id": "c0", "role": "colocated", "stages": [{"devices": ["pc0:0"], "layers": [0, 1]},
                                                 {"devices": ["pc1:0"], "layers": [1, 2]},
                                                 {"devices": ["pc2:0"], "layers": [2, 3]}]}]}


def mixed_load(n: int = 20, gap_s: float = 0.3, seed: int = 0):
    """Alternating long (150-350 token: 0.6-1.4 MB of activations per hop) and short (10-40 token)
    prompts every ``gap_s``, 24 output tokens each: new prompts keep arriving while others decode."""
    from hetserve.serve.loadgen import LoadRequest

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = int(rng.integers(150, 350)) if i % 2 == 0 else int(rng.integers(10, 40))
        out.append(LoadRequest(i * gap_s, rng.integers(32, 127, size=length).tolist(), 24))
    return out


@pytest.mark.long
@pytest.mark.slow
def test_molink_gives_lower_mean_tpot_than_fifo_on_shaped_links(tmp_path):
    from hetserve.planner.plan import Plan
    from hetserve.runtime.model.make import make_model
    from hetserve.serve.launch import ServeOptions, start_server
    from hetserve.serve.loadgen import replay, summarize

    # hidden 1024 in float32: 4 KB of activations per token, so a 250-token prompt holds a
    # 100 Mbit/s link for ~80 ms while a decode step's activations take well under 1 ms; the
    # small FFN keeps the CPU time per token low, so the links, not the two cores, set the pace
    model = make_model(tmp_path / "mid", "llama", layers=3, hidden=1024, heads=8, ffn=128, max_positions=2048)
    plan = Plan.from_dict(PLAN)
    load = mixed_load()
    summaries, waits = {}, {}
    for policy in ("serial", "molink"):
        opts = ServeOptions(plan=plan, model_dir=str(model), model_name="mid", shape_links=True,
                            transmission=policy)
        with start_server(opts) as srv:
            results = replay(srv.url, "mid", load)
            links = srv.deployment.engine.link_stats()
        assert all(r.error is None for r in results), [r.error for r in results if r.error]
        assert [r.output_tokens for r in results] == [r.max_tokens for r in load]
        summaries[policy] = summarize(results)
        sent = sum(s.messages["decode"] for s in links)
        assert sent > 0, "no decode activations crossed a link"
        waits[policy] = sum(s.queueing_s["decode"] for s in links) / sent
    serial, molink = summaries["serial"]["tpot_s"]["mean"], summaries["molink"]["tpot_s"]["mean"]
    print(f"mean TPOT: serial {serial * 1e3:.1f} ms, molink {molink * 1e3:.1f} ms; "
          f"mean TTFT: serial {summaries['serial']['ttft_s']['mean']:.2f} s, "
          f"molink {summaries['molink']['ttft_s']['mean']:.2f} s; mean decode-message wait on the links: "
          f"serial {waits['serial'] * 1e3:.1f} ms, molink {waits['molink'] * 1e3:.1f} ms")
    # decode messages no longer queue behind prefill bulk: at least halve their wait on the wire
    assert waits["molink"] < 0.5 * waits["serial"]
