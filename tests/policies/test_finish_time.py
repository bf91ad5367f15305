"""``eft`` placement (the default): each replica's backlog priced by the plan's flow through it, so a
replica with several times the planned capacity takes several times the requests; and
``PolicyContext.for_plan``, the one way the context is built."""

import pytest

from hetserve.cost.analytic import CostModel
from hetserve.planner.plan import Plan
from hetserve.policies.base import ReplicaState, RequestInfo
from hetserve.policies.finish_time import ExpectedFinishTime, backlog_tokens, replica_prices
from hetserve.policies.placement import DEFAULT_PLACEMENT, PolicyContext, make_placement
from hetserve.specs.cluster import cluster_from_dict
from hetserve.specs.model import load_model

TIN, TOUT, PERIOD = 1000.0, 250.0, 600.0


def _plan(replicas: dict[str, tuple[str, float]], routes=(), model="llama-2-70b", devices=None) -> Plan:
    """Replica id -> (role, planned flow per period), with the estimate the planner writes."""
    reps = [{"id": rid, "role": role, "stages": [{"devices": (devices or {}).get(rid, [f"m{i}:0"]),
                                                  "layers": [0, 80]}]}
            for i, (rid, (role, _)) in enumerate(replicas.items())]
    est = {"period_s": PERIOD, "mean_input_tokens": TIN, "mean_output_tokens": TOUT,
           "replicas": {rid: {"role": role, "capacity_requests_per_period": flow, "flow_requests_per_period": flow}
                        for rid, (role, flow) in replicas.items()}}
    return Plan.from_dict({"model": model, "cluster": "t", "replicas": reps, "estimate": est,
                           "kv_routes": [{"from": a, "to": b, "weight": w} for a, b, w in routes]})


def _state(rid, role="colocated", queued=0, running=0, prompt=0, outstanding=0.0, norm=1.0):
    return ReplicaState(rid, role, queued, running, prompt, outstanding, 0, 0, 0, capacity_norm=norm)


def _place(policy, states: dict[str, ReplicaState], n: int, tin=TIN, tout=TOUT) -> dict[str, int]:
    """Place ``n`` equal requests one after another, each added to its replica's snapshot (nothing
    finishes): the split a burst gets."""
    got = dict.fromkeys(states, 0)
    for i in range(n):
        rid = policy.choose(RequestInfo(i, 0.0, int(tin), float(tout)), list(states.values()), 0.0)
        got[rid] += 1
        s = states[rid]
        prompt = s.queued_prefill_tokens + (tin if s.role != "decode" else 0)
        out = s.outstanding_tokens + (tin if s.role != "decode" else 0) + (tout if s.role != "prefill" else 0)
        states[rid] = _state(rid, s.role, s.queued_requests + 1, 0, int(prompt), out)
    return got


def test_the_default_placement_is_eft():
    assert DEFAULT_PLACEMENT == "eft"
    assert isinstance(make_placement(DEFAULT_PLACEMENT), ExpectedFinishTime)


def test_equal_queues_go_to_the_replica_with_more_planned_flow():
    plan = _plan({"big": ("colocated", 8000.0), "small": ("colocated", 1000.0)})
    pol = ExpectedFinishTime(PolicyContext(plan=plan))
    same = [_state("small", queued=3, running=5, prompt=3000, outstanding=4000.0),
            _state("big", queued=3, running=5, prompt=3000, outstanding=4000.0)]
    req = RequestInfo(0, 0.0, 1000, 250.0)
    assert [pol.choose(req, same, 0.0) for _ in range(2)] == ["big", "big"]  # never a tie
    jsq = make_placement("jsq")  # sees two equal replicas and alternates
    assert {jsq.choose(req, same, 0.0) for _ in range(2)} == {"big", "small"}


def test_a_burst_splits_in_proportion_to_the_planned_flow():
    plan = _plan({"big": ("colocated", 8000.0), "small": ("colocated", 1000.0)})
    got = _place(ExpectedFinishTime(PolicyContext(plan=plan)),
                 {"big": _state("big"), "small": _state("small")}, 900)
    assert got["big"] == pytest.approx(800, abs=2) and got["small"] == pytest.approx(100, abs=2)


def test_disaggregated_plans_place_on_prefill_replicas_by_their_flow():
    plan = _plan({"p0": ("prefill", 3000.0), "p1": ("prefill", 1000.0), "d0": ("decode", 4000.0)},
                 routes=[("p0", "d0", 1.0), ("p1", "d0", 1.0)])
    pol = ExpectedFinishTime(PolicyContext(plan=plan))
    a, b = pol.prices["p0"], pol.prices["p1"]
    assert a[1] == b[1] == 0.0 and b[0] == pytest.approx(3 * a[0])  # prompt time only, 3x the flow
    assert pol.prices["d0"][0] == 0.0  # a decode replica's time is all output tokens
    got = _place(pol, {"p0": _state("p0", "prefill"), "p1": _state("p1", "prefill")}, 400)
    assert got == {"p0": 300, "p1": 100}


def test_backlog_counts_what_each_role_still_has_to_do():
    req = RequestInfo(0, 0.0, 100, 20.0)
    assert backlog_tokens(_state("p", "prefill", 1, 1, 50, 80.0), req) == (180.0, 0.0)
    assert backlog_tokens(_state("c", "colocated", 1, 2, 50, 300.0), req) == (150.0, 270.0)
    assert backlog_tokens(_state("d", "decode", 1, 2, 0, 300.0), req) == (0.0, 320.0)


def test_an_idle_fast_replica_wins_over_an_idle_slow_one():
    plan = _plan({"slow": ("colocated", 1000.0), "fast": ("colocated", 2000.0)})
    pol = ExpectedFinishTime(PolicyContext(plan=plan))
    req = RequestInfo(0, 0.0, 10, 10.0)
    assert [pol.choose(req, [_state("fast"), _state("slow")], 0.0) for _ in range(2)] == ["fast", "fast"]


def _fast_slow_cluster():
    return cluster_from_dict({"name": "fast-slow", "machines": [
        {"name": "h0", "gpu": "H100-SXM-80G", "count": 4, "site": "a"},
        {"name": "w0", "gpu": "A6000", "count": 4, "site": "a"}],
        "network": {"intra_site": {"bandwidth_gbps": 100, "latency_ms": 0.5}}}, "<fast-slow>")


def _fast_slow_plan(cluster, model, wl=None, estimate=True) -> Plan:
    """One H100 TP4 and one A6000 TP4 colocated replica of llama-2-70b (about 8:1 in capacity),
    with the estimate the planner writes for them (capacity = flow: no link binds)."""
    reps = [{"id": "c0", "role": "colocated", "stages": [{"devices": [f"h0:{i}" for i in range(4)], "layers": [0, 80]}]},
            {"id": "c1", "role": "colocated", "stages": [{"devices": [f"w0:{i}" for i in range(4)], "layers": [0, 80]}]}]
    bare = Plan.from_dict({"model": model.name, "cluster": cluster.name, "replicas": reps})
    if not estimate:
        return bare
    tin, tout = wl.mean_input, wl.mean_output
    cost = CostModel(cluster, model)
    caps = {r.id: cost.colocated_capacity(r.layout(cluster), tin, tout, PERIOD) for r in bare.replicas}
    est = {"throughput_tokens_per_s": sum(caps.values()) * tout / PERIOD, "requests_per_period": sum(caps.values()),
           "period_s": PERIOD, "mean_input_tokens": tin, "mean_output_tokens": tout,
           "replicas": {k: {"role": "colocated", "capacity_requests_per_period": v, "flow_requests_per_period": v}
                        for k, v in caps.items()}}
    return Plan.from_dict({**bare.to_dict(), "estimate": est})


def test_without_plan_figures_the_cost_model_prices_the_replicas():
    cluster, model = _fast_slow_cluster(), load_model("llama-2-70b")
    bare = _fast_slow_plan(cluster, model, estimate=False)
    ctx = PolicyContext.for_plan(bare, cluster, model)
    prices = replica_prices(ctx)
    assert set(prices) == {"c0", "c1"}
    (a0, b0), (a1, b1) = prices["c0"], prices["c1"]
    assert 0 < a0 < b0 and 0 < a1 < b1  # an output token costs more than a prompt token
    assert b1 / b0 > 4  # the A6000 replica is several times slower per token
    # no plan figures and no cost model: the snapshot's capacity_norm ranks (one scale for all)
    pol = ExpectedFinishTime(PolicyContext(plan=bare))
    assert pol.prices == {}
    cands = [_state("c0", outstanding=900.0, norm=1.0), _state("c1", outstanding=100.0, norm=0.1)]
    assert pol.choose(RequestInfo(0, 0.0, 10, 10.0), cands, 0.0) == "c0"


def test_a_saturated_run_delivers_the_plan_estimate_with_eft_and_not_with_jsq():
    """1,500 Azure requests at 3x the plan's rate on an 8:1 pair of replicas. The simulator is
    deterministic: eft delivers 1.08x the estimate (output tokens over the whole run, drain
    included); jsq 0.31x: it keeps the slow replica's queue as long as the fast one's."""
    from hetserve.sim.simulator import SimOptions, simulate
    from hetserve.specs.workload import load_workload

    cluster, model = _fast_slow_cluster(), load_model("llama-2-70b")
    wl = load_workload("azure-conv").head(1500)
    plan = _fast_slow_plan(cluster, model, wl)
    est = plan.estimate["throughput_tokens_per_s"]
    rate = 3 * plan.estimate["requests_per_period"] / PERIOD
    got = {pol: simulate(plan, cluster, model, wl.with_rate(rate), SimOptions(placement=pol)).summary()
           ["throughput_tokens_per_s"] / est for pol in ("eft", "jsq")}
    assert 0.85 <= got["eft"] <= 1.15, got
    assert got["jsq"] < 0.85, got


# ----------------------------------------------------------------------------- PolicyContext.for_plan


def test_for_plan_builds_cost_layouts_and_keeps_the_rest():
    from hetserve.specs.workload import SLO

    cluster, model = _fast_slow_cluster(), load_model("llama-2-70b")
    plan = _fast_slow_plan(cluster, model, estimate=False)
    ctx = PolicyContext.for_plan(plan, cluster, model, "wl", slo=SLO(1.0, 0.1), seed=3,
                                 options={"gamma": 0.7})
    assert isinstance(ctx.cost, CostModel) and set(ctx.layouts) == {"c0", "c1"}
    assert (ctx.plan, ctx.workload, ctx.seed, ctx.options, ctx.slo.ttft_s) == (plan, "wl", 3, {"gamma": 0.7}, 1.0)
    shared = CostModel(cluster, model)
    assert PolicyContext.for_plan(plan, cluster, model, cost=shared).cost is shared
    with pytest.raises(ValueError, match="not both"):
        PolicyContext.for_plan(plan, cluster, model, cost=shared, efficiency=shared.eff)
    with pytest.raises(ValueError, match="llama-2-7b"):
        PolicyContext.for_plan(plan, cluster, load_model("llama-2-7b"))


def test_for_plan_takes_a_predictor_only_with_the_predictor_protocol():
    from hetserve.policies.predictor import BucketMeanPredictor

    cluster, model = _fast_slow_cluster(), load_model("llama-2-70b")
    plan = _fast_slow_plan(cluster, model, estimate=False)
    bucket = BucketMeanPredictor()
    assert PolicyContext.for_plan(plan, cluster, model, predictor=bucket).predictor is bucket

    class TwoArguments:  # predict(prompt_tokens, seq) / observe(prompt, completion): the wrong protocol
        def predict(self, prompt_tokens, seq):
            return 1.0

        def observe(self, prompt, completion):
            pass

    with pytest.raises(TypeError, match="request_id, input_tokens"):
        PolicyContext.for_plan(plan, cluster, model, predictor=TwoArguments())
    with pytest.raises(TypeError, match="observe"):
        PolicyContext.for_plan(plan, cluster, model, predictor=type("P", (), {"predict": lambda s, a, b, c=0: 1.0})())


def test_a_prefill_replica_counts_the_decode_work_it_has_sent_on():
    """A prefill replica empties as soon as its prompts are done; the decode replicas its routes
    feed are not among placement's candidates. The policy books each request's output on them (by
    route weight) until the request finishes, so a burst splits by the whole path's flow."""
    plan = _plan({"p0": ("prefill", 1000.0), "d0": ("decode", 1000.0), "c0": ("colocated", 1000.0)},
                 routes=[("p0", "d0", 1.0)])
    pol = ExpectedFinishTime(PolicyContext(plan=plan))
    states = {"p0": _state("p0", "prefill"), "c0": _state("c0")}
    sent = []
    for i in range(200):
        rid = pol.choose(RequestInfo(i, 0.0, int(TIN), TOUT), list(states.values()), 0.0)
        if rid == "c0":  # the colocated replica keeps it; the prefill replica hands it on at once
            s = states["c0"]
            states["c0"] = _state("c0", "colocated", s.queued_requests + 1, 0, int(s.queued_prefill_tokens + TIN),
                                  s.outstanding_tokens + TIN + TOUT)
        else:
            sent.append(i)
    assert len(sent) == pytest.approx(100, abs=2)
    for i in sent:  # decoded and done: the path is free again
        pol.on_finish(i, int(TIN), int(TOUT))
    assert pol.choose(RequestInfo(999, 0.0, int(TIN), TOUT), list(states.values()), 0.0) == "p0"
