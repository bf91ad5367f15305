"""Host contention (``sim.hosts``): the stages busy now and the serving front end share the cores."""

import pytest

from hetserve.planner.plan import Plan
from hetserve.sim import SimOptions, simulate
from hetserve.sim.hosts import FrontEndCost
from hetserve.specs.cluster import cluster_from_dict
from hetserve.specs.workload import Workload

from .plans import single

# contention is the subject: GPU and CPU-slot pools priced by one model (CPU slots take the roofline)
pytestmark = pytest.mark.usefixtures("roofline")


def _cluster(cores, count=2):
    m = {"name": "m0", "gpu": "A100-SXM-80G", "count": count, "site": "s0"}
    if cores:
        m["cpu_cores"] = cores
    return cluster_from_dict({"name": "test", "machines": [m]})


def _two_stages(tp: int):
    """A colocated pipeline of two stages of ``tp`` devices each, 16 layers each."""
    devs = [f"m0:{i}" for i in range(2 * tp)]
    return Plan.from_dict({"model": "llama-2-7b", "cluster": "test", "replicas": [
        {"id": "c0", "role": "colocated", "stages": [{"devices": devs[:tp], "layers": [0, 16]},
                                                      {"devices": devs[tp:], "layers": [16, 32]}]}]})


def test_a_pipeline_running_one_sequence_keeps_one_stage_busy(model):
    """A two-stage pipeline on one core serving a single request: one micro-batch, so one stage
    computes at a time and nothing is slowed (counting both stages as busy, the model before,
    doubled every step: what over-predicted the asymmetric plan's light load by 1.2x)."""
    plan = _two_stages(tp=1)
    wl = Workload.from_lists("one", [0.0], [300], [40])
    alone = simulate(plan, _cluster(None), model, wl, SimOptions())
    one_core = simulate(plan, _cluster(1), model, wl, SimOptions())
    assert one_core.t_first[0] == pytest.approx(alone.t_first[0], rel=1e-9)
    assert one_core.t_finish[0] == pytest.approx(alone.t_finish[0], rel=1e-9)
    # two requests decoding: two micro-batches, both stages busy on the one core
    two = Workload.from_lists("two", [0.0, 0.0], [300, 300], [40, 40])
    assert (simulate(plan, _cluster(1), model, two, SimOptions()).t_finish.max()
            > 1.5 * simulate(plan, _cluster(None), model, two, SimOptions()).t_finish.max())


def test_a_lone_request_keeps_busy_the_tp_of_the_stage_it_computes_on(model):
    """An asymmetric pipeline (TP 2 on 2 layers, TP 1 on 30) on one core, one request: its
    micro-batch computes on the TP 2 stage for a small share of its time, so the core runs
    ``computing_tp`` workers (time-weighted, near 1), not the stages' mean TP of 1.5: the prompt is
    stretched by that much and no more."""
    from hetserve.cost.analytic import CostModel
    from hetserve.sim.hosts import computing_tp

    plan = Plan.from_dict({"model": "llama-2-7b", "cluster": "test", "replicas": [
        {"id": "c0", "role": "colocated", "stages": [{"devices": ["m0:0", "m0:1"], "layers": [0, 2]},
                                                      {"devices": ["m0:2"], "layers": [2, 32]}]}]})
    wl = Workload.from_lists("one", [0.0], [300], [2])
    alone, one_core = _cluster(None, 3), _cluster(1, 3)
    tp = computing_tp(CostModel(one_core, model), plan.replicas[0].layout(one_core))
    assert 1.0 < tp < 1.1
    ttft = lambda cl: simulate(plan, cl, model, wl, SimOptions()).t_first[0]  # noqa: E731
    assert ttft(one_core) == pytest.approx(tp * ttft(alone), rel=1e-6)


def test_the_front_end_joins_the_contention_on_its_host(model):
    """Two replicas on two shared cores: a prompt that runs while the other replica decodes is not
    slowed (2 workers, 2 cores) until the front end computes beside them: with its per-token and
    per-step CPU it is busy a share u of the time and the prompt takes (2 + u) / 2 as long; its
    per-request backlog makes it fully busy (3 / 2). Off CPU slots (GPUs) the front end costs nothing."""
    plan = single({"c0": ["m0:0"], "c1": ["m0:1"]})
    wl = Workload.from_lists("two", [0.0, 0.5], [100, 3000], [400, 2])  # c1's prompt while c0 decodes
    base = SimOptions(placement="rr")
    plain = simulate(plan, _cluster(2), model, wl, base)
    prefill = plain.t_first[1] - plain.t_start[1]
    fe = dict(frontend_step_cpu_s=0.002, frontend_token_cpu_s=0.001)
    busy = simulate(plan, _cluster(2), model, wl, SimOptions(placement="rr", **fe))
    # c0 decodes one sequence: u = step + token CPU per step, over its step time then
    step = (plain.t_finish[0] - plain.t_first[0]) / 399
    u = min(1.0, 0.003 / step)
    assert 0 < u < 1
    assert busy.t_first[1] - busy.t_start[1] == pytest.approx((2 + u) / 2 * prefill, rel=0.02)
    # each request keeps the front end busy for 1 s of CPU: c1's prompt starts inside c1's backlog
    backlog = simulate(plan, _cluster(2), model, wl, SimOptions(placement="rr", frontend_request_cpu_s=1.0))
    assert backlog.t_first[1] - backlog.t_start[1] == pytest.approx(1.5 * prefill, rel=1e-6)
    gpus = simulate(plan, _cluster(None), model, wl, SimOptions(placement="rr", frontend_request_cpu_s=1.0, **fe))
    assert gpus.t_first[1] - gpus.t_start[1] == pytest.approx(prefill, rel=1e-9)


def test_the_front_end_work_for_a_replicas_own_steps_slows_them(model):
    """A two-stage pipeline on two shared cores, two micro-batches in flight: both workers compute,
    and the front end turning their steps (per-step and per-token CPU) is a third consumer of the
    two cores, so the steps take (2 + u) / 2 as long. Each segment is priced before its batch runs:
    counted at that moment's rate, the replica's own front-end work never slowed it (before the
    first finish nothing is known of its rate: that first segment is not slowed either way)."""
    plan = _two_stages(tp=1)
    wl = Workload.from_lists("three", [0.0, 0.0, 0.0], [100, 100, 100], [60, 200, 200])
    plain = simulate(plan, _cluster(2), model, wl, SimOptions())
    fe = dict(frontend_step_cpu_s=0.004, frontend_token_cpu_s=0.001)
    busy = simulate(plan, _cluster(2), model, wl, SimOptions(**fe))
    # up to the first finish: the same; then two sequences in two micro-batches, slowed by the front end
    assert busy.t_finish[0] == pytest.approx(plain.t_finish[0], rel=1e-9)
    ratio = (busy.t_finish[1] - busy.t_finish[0]) / (plain.t_finish[1] - plain.t_finish[0])
    assert 1.05 < ratio < 1.5
    gpus = simulate(plan, _cluster(None), model, wl, SimOptions(**fe))  # GPUs: the front end has cores to spare
    assert gpus.t_finish[1] == pytest.approx(simulate(plan, _cluster(None), model, wl, SimOptions()).t_finish[1],
                                             rel=1e-9)


def test_front_end_costs_are_checked():
    with pytest.raises(ValueError):
        FrontEndCost(token_cpu_s=-1.0)
    with pytest.raises(ValueError):
        SimOptions(frontend_step_cpu_s=-0.1)


def test_a_busy_front_end_delays_a_replica_by_the_other_replicas_work(model):
    """The front end is one serial server (one GIL): a replica's next step waits for it in
    proportion to its utilisation by work that is not the replica's own. c0 decodes alone, then
    beside c1 decoding on the same front end: with ``frontend_dispatch_s`` its step grows by
    dispatch × (c1's step and token CPU per second of c1's step) — two replicas, longer TPOT than
    one. Its own tokens (in phase with its steps) never delay it, and on a pipeline running two
    micro-batches a small wait hides behind the other micro-batch."""
    plan = single({"c0": ["m0:0"], "c1": ["m0:1"]})
    fe = dict(frontend_step_cpu_s=0.002, frontend_token_cpu_s=0.001, frontend_dispatch_s=0.02)

    def c0_tpot(wl, **kw):  # request 2 on c0 (round robin: 0 -> c0, 1 -> c1, 2 -> c0)
        res = simulate(plan, _cluster(None), model, wl, SimOptions(placement="rr", **kw))
        return (res.t_finish[2] - res.t_first[2]) / (200 - 1), res

    # request 0 only prefills (one token); request 1 on c1 decodes (or not, alone) the whole time
    one = Workload.from_lists("one", [0.0, 0.0, 0.5], [100, 100, 100], [1, 1, 200])
    two = Workload.from_lists("two", [0.0, 0.0, 0.5], [100, 100, 100], [1, 3000, 200])
    alone, _ = c0_tpot(one)
    assert c0_tpot(one, **fe)[0] == pytest.approx(alone, rel=1e-9)  # its own work: no wait
    assert c0_tpot(two)[0] == pytest.approx(alone, rel=1e-9)  # no front-end costs: replicas independent
    beside, _ = c0_tpot(two, **fe)
    from hetserve.cost.analytic import CostModel
    from hetserve.cost.layout import ReplicaLayout, StageLayout

    cm = CostModel(_cluster(None), model)
    c1_step = cm.decode_step_time(ReplicaLayout((StageLayout((1,), (0, 32)),)), 1, 101)  # its segment's rate
    assert beside == pytest.approx(alone + 0.02 * min(1.0, 0.003 / c1_step), rel=1e-3)
    assert beside > alone * 1.05
    pp = ReplicaLayout((StageLayout((0,), (0, 16)), StageLayout((1,), (16, 32))))
    ring = cm.decode_step_time(pp, 2, 600, micro_batches=2)
    assert cm.decode_step_time(pp, 2, 600, 2, dispatch_s=1e-5) == ring  # hidden by the other micro-batch
    assert cm.decode_step_time(pp, 1, 300, 1, dispatch_s=1e-3) == pytest.approx(
        cm.decode_step_time(pp, 1, 300, 1) + 1e-3, rel=1e-12)  # one micro-batch: on its path


def test_each_decoding_step_waits_for_its_tokens_fixed_streaming_part(model):
    """``stream_step_overhead_s``: every decode step of a request waits that much more for the front
    end (its tokens' fixed SSE part); a prefill replica's prompt step does not (its first token is
    the request overhead's). One request on a prefill/decode pair: its TTFT is unchanged and its
    TPOT grows by exactly the overhead; on a colocated replica the same, and on a two-stage
    pipeline, whose one micro-batch waits it on the ring's way back to its first stage."""
    wl = Workload.from_lists("one", [0.0], [100], [50])
    pipeline = _two_stages(tp=1)
    for plan in (single({"c0": ["m0:0"]}), single({"p0": ["m0:0"], "d0": ["m0:1"]}, routes=[("p0", "d0", 1.0)]),
                 pipeline):
        base = simulate(plan, _cluster(None), model, wl, SimOptions())
        more = simulate(plan, _cluster(None), model, wl, SimOptions(stream_step_overhead_s=0.003))
        assert more.ttft[0] == pytest.approx(base.ttft[0], rel=1e-9), plan.replicas
        assert more.tpot[0] == pytest.approx(base.tpot[0] + 0.003, rel=1e-6), plan.replicas
    with pytest.raises(ValueError, match="stream_step_overhead_s"):
        SimOptions(stream_step_overhead_s=-1e-3)


@pytest.mark.parametrize("role", ["colocated", "prefill-decode"])
def test_host_contention_stretches_computing_not_the_tp_collectives(model, role):
    """A TP-2 replica on one core is slowed 2x (both members compute), but the collectives' fixed
    cost (``Efficiency.collective_overhead_s``: members meeting, not computing) is paid once:
    time on one core = 2 x (time alone - collectives) + collectives, for prompts and decode steps.
    Stretching the collectives too over-predicted the CPU demo's asymmetric TP-2 plan by 1.2-1.3x."""
    from dataclasses import replace

    from hetserve.cost.analytic import CostModel
    from hetserve.cost.efficiency import Efficiency

    stage = lambda devs: [{"devices": devs, "layers": [0, 32]}]  # noqa: E731
    if role == "colocated":
        reps, routes, count = [{"id": "c0", "role": "colocated", "stages": stage(["m0:0", "m0:1"])}], [], 2
    else:
        reps = [{"id": "p0", "role": "prefill", "stages": stage(["m0:0", "m0:1"])},
                {"id": "d0", "role": "decode", "stages": stage(["m0:2", "m0:3"])}]
        routes, count = [{"from": "p0", "to": "d0", "weight": 1.0}], 4
    plan = Plan.from_dict({"model": "llama-2-7b", "cluster": "test", "replicas": reps, "kv_routes": routes})
    wl = Workload.from_lists("one", [0.0], [300], [40])
    eff = replace(Efficiency(), collective_overhead_s=0.004)
    runs = {}
    for cores in (None, 1):
        c = _cluster(cores, count)
        runs[cores] = simulate(plan, c, model, wl, SimOptions(), cost=CostModel(c, model, eff))
    alone, shared = runs[None], runs[1]
    fixed = (2 * 32 + 3) * 0.004  # per pass through the TP-2 stage (cost.analytic.TP_STEP_COLLECTIVES = 3)
    ttft_alone = alone.t_first[0] - alone.t_start[0]
    ttft_shared = shared.t_first[0] - shared.t_start[0]
    assert ttft_shared == pytest.approx(2 * (ttft_alone - fixed) + fixed, rel=1e-6)
    tpot_alone = (alone.t_finish[0] - alone.t_first[0]) / 39
    tpot_shared = (shared.t_finish[0] - shared.t_first[0]) / 39
    # (disaggregated: t_first -> t_finish also holds the KV hand-off, the same on both; 1e-3 of it)
    assert tpot_shared == pytest.approx(2 * (tpot_alone - fixed) + fixed, rel=1e-3)


def test_a_decode_segment_feels_a_prefill_that_starts_beside_it(model):
    """Prefill and decode replicas on one shared core: request 0 decodes on d0 when request 1's long
    prompt (one output token: it never joins d0) starts prefilling on p0. d0's running segment is
    re-priced at that prefill's start and again at its end, so request 0 finishes later by about the
    prefill's length (both share the core: d0 computes at half speed meanwhile). The segment used to
    keep the factor it started with, so the prefill was never felt. On GPUs nothing changes."""
    plan = Plan.from_dict({"model": "llama-2-7b", "cluster": "test", "replicas": [
        {"id": "p0", "role": "prefill", "stages": [{"devices": ["m0:0"], "layers": [0, 32]}]},
        {"id": "d0", "role": "decode", "stages": [{"devices": ["m0:1"], "layers": [0, 32]}]}],
        "kv_routes": [{"from": "p0", "to": "d0", "weight": 1.0}]})
    alone = Workload.from_lists("one", [0.0], [100], [2000])
    beside = Workload.from_lists("two", [0.0, 1.0], [100, 4000], [2000, 1])
    for cores in (1, None):
        a = simulate(plan, _cluster(cores), model, alone, SimOptions())
        b = simulate(plan, _cluster(cores), model, beside, SimOptions())
        prefill = b.t_first[1] - b.t_start[1]
        assert a.t_first[0] < 1.0 < b.t_first[1] < a.t_finish[0]  # the prefill runs inside request 0's decode
        if cores is None:
            assert b.t_finish[0] == pytest.approx(a.t_finish[0], rel=1e-9)
        else:
            assert b.t_finish[0] - a.t_finish[0] == pytest.approx(prefill / 2, rel=0.1)


@pytest.mark.parametrize("cpu_host", [None, "pc"])
def test_boxes_emulated_on_one_computer_share_its_cores(model, cpu_host):
    """Two machines of one core each: a prompt on m1 beside a decode on m0 contends for the cores
    only where both name the same ``cpu_host`` (the CPU demo's two boxes on one computer); each
    machine its own host, the prompt runs as alone."""
    machines = [{"name": n, "gpu": "A100-SXM-80G", "count": 1, "site": "s0", "cpu_cores": 1,
                 **({"cpu_host": cpu_host} if cpu_host else {})} for n in ("m0", "m1")]
    cluster = cluster_from_dict({"name": "test", "machines": machines,
                                 "network": {"intra_site": {"bandwidth_gbps": 10, "latency_ms": 0.2}}})
    plan = single({"c0": ["m0:0"], "c1": ["m1:0"]})
    wl = Workload.from_lists("two", [0.0, 0.5], [100, 3000], [400, 2])  # c1's prompt while c0 decodes
    res = simulate(plan, cluster, model, wl, SimOptions(placement="rr"))
    alone = simulate(plan, cluster, model, Workload.from_lists("one", [0.5], [3000], [2]), SimOptions(placement="rr"))
    prefill, prefill_alone = res.t_first[1] - res.t_start[1], alone.t_first[0] - alone.t_start[0]
    if cpu_host:
        assert prefill == pytest.approx(2 * prefill_alone, rel=1e-6)  # two workers, one core
    else:
        assert prefill == pytest.approx(prefill_alone, rel=1e-9)


def test_two_micro_batches_stretch_the_tp_collectives_too(model):
    """A pipeline of two TP-2 stages on one core. Decoding one sequence (one micro-batch) the
    collectives' fixed cost is members meeting while nothing else of the replica computes: not
    stretched (TPOT on one core < 2x alone, the busy TP group's factor). Decoding two (two
    micro-batches, all four workers) the other stage computes beside each TP group's collectives,
    so the whole iteration is stretched 4x. Unstretched there, the asymmetric plan's two-sequence
    token interval was 0.85 of served while one sequence's was right."""
    from dataclasses import replace

    from hetserve.cost.analytic import CostModel
    from hetserve.cost.efficiency import Efficiency

    eff = replace(Efficiency(), collective_overhead_s=0.004)
    decode = {}
    for n in (1, 2):
        wl = Workload.from_lists("n", [0.0] * n, [300] * n, [40] * n)
        for cores in (None, 1):
            c = _cluster(cores, 4)
            r = simulate(_two_stages(tp=2), c, model, wl, SimOptions(), cost=CostModel(c, model, eff))
            assert r.t_first.max() == pytest.approx(r.t_first.min(), rel=1e-9)  # one prompt step for all
            decode[n, cores] = r.t_finish.max() - r.t_first.max()
    assert decode[1, 1] < 1.9 * decode[1, None]
    assert decode[2, 1] == pytest.approx(4 * decode[2, None], rel=1e-9)


def test_a_prompt_beside_a_decoding_micro_batch_is_priced_stage_by_stage(model):
    """A two-stage TP-1 pipeline on one core decodes request 0 when request 1's prompt arrives and
    takes the free micro-batch slot. On each stage the prompt shares the core only with the decode's
    work on the other stage, for at most that work's time (``sim.hosts.pipeline_step_beside``), so
    it takes a little longer than alone, not twice as long: priced as one step with both stages'
    workers busy throughout, the asymmetric plan's prompt steps beside its decodes came out
    1.22-1.41x the served ones."""
    from hetserve.cost.analytic import CostModel, PrefillBatch

    plan = _two_stages(tp=1)
    wl = Workload.from_lists("two", [0.0, 1.0], [100, 2000], [400, 2])
    one_core = _cluster(1)
    res = simulate(plan, one_core, model, wl, SimOptions())
    assert res.t_first[0] < 1.0 < res.t_first[1] < res.t_finish[0]  # the prompt runs beside request 0's decode
    cost = CostModel(one_core, model)
    alone = cost.prefill_time(plan.replicas[0].layout(one_core), PrefillBatch.of([2000]))
    beside = res.t_first[1] - res.t_start[1]
    assert alone < beside < 1.2 * alone


def test_a_prompt_beside_a_micro_batch_waits_for_it_only_on_the_stage_it_holds():
    """A prompt step reaching a stage at a random moment waits there only while the other
    micro-batch holds that stage's worker: for a micro-batch taking 1 ms on stage 0 and 9 ms on
    stage 1, 4.1 ms on average, not 5 (half its time on every stage, as if it sat on each one the
    prompt reached). The expectation is taken here over the other micro-batch's phase, on a grid."""
    import numpy as np

    from hetserve.cost.analytic import PrefillBatch
    from hetserve.cost.layout import ReplicaLayout, StageLayout
    from hetserve.sim.hosts import pipeline_step_beside

    p, d = [0.004, 0.020], [0.001, 0.009]  # the prompt's and the other micro-batch's time per stage

    class StageTimes:  # the cost model's times per stage, nothing else
        def stage_prefill_time(self, stage, prompts, is_last):
            return p[stage.devices[0]]

        def stage_decode_time(self, stage, b, context, is_last):
            return d[stage.devices[0]]

        def collectives_time(self, stage):
            return 0.0

        def pp_handoff_time(self, a, b, tokens):
            return 0.0

    layout = ReplicaLayout((StageLayout((0,), (0, 16)), StageLayout((1,), (16, 32))))
    step = pipeline_step_beside(StageTimes(), layout, PrefillBatch.of([128]), 1, 16, 1, lambda workers: 1.0)
    cycle = sum(d)
    phase = (np.arange(100_000) + 0.5) / 100_000 * cycle  # where the other micro-batch is in its cycle
    ends = np.cumsum(d)
    wait = sum(np.where((phase >= end - t) & (phase < end), end - phase, 0.0).mean() for t, end in zip(d, ends))
    assert wait == pytest.approx(0.0041, rel=1e-3)
    assert step - sum(p) == pytest.approx(wait, rel=1e-3)

def test_prompts_riding_in_one_of_two_micro_batches_are_priced_stage_by_stage(model):
    """Both micro-batch slots of a two-stage TP-1 pipeline on one core decode (requests 0 and 1),
    so request 2's prompt waits for their boundary and rides in one micro-batch's step while the
    other goes on. Stage by stage, the step shares the core only with the other micro-batch's work
    on the other stage: a little longer than the same step on GPUs (no shared cores), where all
    stages' workers counted busy throughout made it over twice as long."""
    plan = _two_stages(tp=1)
    wl = Workload.from_lists("three", [0.0, 0.0, 1.0], [100, 100, 2000], [400, 400, 2])
    step = {}
    for cores in (None, 1):
        res = simulate(plan, _cluster(cores), model, wl, SimOptions())
        assert res.t_first[1] < 1.0 < res.t_first[2] < res.t_finish[:2].min()  # it rides beside both decodes
        step[cores] = res.t_first[2] - res.t_start[2]
    assert step[None] < step[1] < 1.3 * step[None]
