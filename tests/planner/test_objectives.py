"""The upper bound, the budget and cost objectives, SLO-aware capacities."""

import pytest

from hetserve.cli.main import main
from hetserve.planner import ALGORITHMS, PlanOptions, plan, validate_plan
from hetserve.planner.bound.throughput import upper_bound
from hetserve.planner.bound.min_cost import min_cost
from hetserve.planner.context import PlanContext
from hetserve.planner.slo import SLOTargets, decode_batch_within, slo_capacity, ttft_load_cap
from hetserve.sim.simulator import SimOptions, simulate
from hetserve.specs.cluster import load_cluster
from hetserve.specs.model import load_model
from hetserve.specs.workload import SLO


def _tps(p):
    return p.estimate["throughput_tokens_per_s"]


# the bound above exact on the small presets and on App. E's pool for every class: test_search.py's
# exact-bounds tests, which run exact there already


def test_bound_is_above_every_algorithm_on_a_preset(llama70b, azure):
    c = load_cluster("hexgen2-het4")
    ub = upper_bound(PlanContext(c, llama70b, azure)).tokens_per_s
    for algo in ("hexgen2", "uniform", "hexgen", "genetic"):
        p = ALGORITHMS[algo](c, llama70b, azure, PlanOptions(seed=0, max_iterations=8))
        assert _tps(p) <= ub * (1 + 1e-9), algo
        assert p.estimate["upper_bound_tokens_per_s"] == pytest.approx(ub)


@pytest.mark.long  # two budget-constrained searches on het1 (~17 s): `make test-long`
def test_budget_plans_never_exceed_the_budget_and_use_it(llama70b, azure):
    c = load_cluster("hexgen2-het1")  # $20.88/h in all at the catalogue's prices
    values = []
    # budgets that buy 6 and 10 of its 20 GPUs: each subset's group bound is solved in about a
    # second, where $20 (19 GPUs) took over a minute and checked nothing more
    for budget in (8.0, 10.0):
        p = plan(c, llama70b, azure, "hexgen2", PlanOptions(seed=0, max_iterations=15, budget_usd_per_hour=budget))
        validate_plan(p, c, llama70b)
        assert p.estimate["cost_usd_per_hour"] <= budget + 1e-9
        assert p.estimate["budget_usd_per_hour"] == budget
        assert _tps(p) <= p.estimate["upper_bound_tokens_per_s"] * (1 + 1e-9)
        values.append(_tps(p))
    assert values[1] > values[0]  # a larger budget buys more


@pytest.mark.long
def test_cost_plan_meets_the_rate_in_simulation(llama70b, azure):
    c = load_cluster("hexgen2-het1")
    rate, slo = 1.5, SLO(ttft_s=2.0, tpot_s=0.1)
    opts = PlanOptions(seed=0, max_iterations=15, objective="cost", rate=rate, slo_ttft_s=2.0, slo_tpot_s=0.1)
    p = plan(c, llama70b, azure, "hexgen2", opts)
    validate_plan(p, c, llama70b)
    e = p.estimate
    assert e["min_cost_bound_usd_per_hour"] <= e["cost_usd_per_hour"] < c.usd_per_hour()
    # chunked prefill (vLLM's default) keeps a colocated replica's prompts from stalling its batch
    # (the planner planned every request, those beyond the context too: they run as given here)
    r = simulate(p, c, llama70b, azure.with_rate(rate).head(300), SimOptions(slo=slo, chunked_prefill=True,
                                                                             beyond_context="run"))
    s = r.summary()
    # every request served; most within the SLOs (the planner's SLO model is mean-based: 0.89 measured)
    assert s["completed"] == 300 and s["slo_attainment"] >= 0.85


@pytest.mark.long  # three min-cost MILPs on het1 (~26 s): `make test-long`
def test_min_cost_bound_grows_with_the_rate(llama70b, azure):
    ctx = PlanContext(load_cluster("hexgen2-het1"), llama70b, azure)
    a, b = min_cost(ctx, 1000)[0], min_cost(ctx, 2500)[0]
    assert 0 < a < b
    assert min_cost(ctx, 10 * upper_bound(ctx).requests_per_period) is None


def test_slo_capacities(llama70b, azure):
    ctx = PlanContext(load_cluster("hexgen2-het4"), llama70b, azure)
    lay = ctx.layouts.best(ctx.classes[0][:4] if len(ctx.classes[0]) >= 4 else ctx.classes[1][:4], "decode")[0]
    i, o, T = ctx.input_tokens, ctx.output_tokens, ctx.period_s
    full = ctx.layouts.layout_capacity(lay, "decode")
    loose = slo_capacity(ctx.cost, lay, "decode", i, o, T, SLOTargets(tpot_s=10.0))
    assert loose == pytest.approx(full)
    step_full = ctx.cost.decode_step_time(lay, ctx.cost.max_decode_batch(lay, i + o),
                                          ctx.cost.max_decode_batch(lay, i + o) * (i + o / 2))
    step_one = ctx.cost.decode_step_time(lay, 1, i + o / 2)
    tight = SLOTargets(tpot_s=(step_one + step_full) / 2)
    b = decode_batch_within(ctx.cost, lay, i, o, tight.tpot_s)
    assert 0 < b < ctx.cost.max_decode_batch(lay, i + o)
    assert ctx.cost.decode_step_time(lay, b, b * (i + o / 2)) <= tight.tpot_s
    assert slo_capacity(ctx.cost, lay, "decode", i, o, T, tight) < full
    assert ttft_load_cap(1.0, 0.5) == 0.0 and ttft_load_cap(0.0, 1.0) == 1.0
    assert 0 < ttft_load_cap(0.5, 1.0) < 1


@pytest.mark.parametrize("argv,msg", [
    (["--objective", "cost"], "--objective cost: give --rate"),
    (["--objective", "goodput"], "--objective goodput: give --slo-ttft"),
    (["--slo-ttft", "2"], "--slo-ttft / --slo-tpot: only read by --objective goodput or cost"),
    (["--budget-usd-per-hour", "-3"], "--budget-usd-per-hour"),
    (["--budget-usd-per-hour", "1"], "no subset of hexgen2-het1 within $1.00/h"),
])
def test_objective_bad_input_is_one_line_exit_2(argv, msg, capsys):
    assert main(["plan", "--cluster", "hexgen2-het1", "--model", "llama-2-70b", "--quiet", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and msg in err


def test_explain_names_the_cut_and_builds_what_ifs(case_study, llama70b, azure):
    from hetserve.planner.explain import _variants, bottlenecks

    w = azure.of_class("HPLD")
    p = ALGORITHMS["exact"](case_study, llama70b, w, PlanOptions(seed=0))
    lines = bottlenecks(p, case_study, llama70b, w, PlanOptions(seed=0))
    assert lines and any(("saturated" in s or "full" in s or "colocated" in s) for s in lines), lines
    data = {"name": "x", "machines": [{"name": "h0", "gpu": "H100-SXM-80G", "count": 4, "site": "a"},
                                      {"name": "a0", "gpu": "A100-SXM-80G", "count": 4, "site": "b"}],
            "network": {"inter_site": {"bandwidth_gbps": 3, "latency_ms": 15}}}
    fake = type("P", (), {"estimate": {"network": {"pipe:a>b": {"capacity_gbps": 3.0}}}})()
    rows = {label: d for label, d, _ in _variants(data, fake)}
    assert rows["+1 H100-SXM-80G (on h0)"]["machines"][0]["count"] == 5
    link = rows["2× pipe:a>b (3 → 6 Gbit/s)"]["network"]["links"][-1]
    assert link["between"] == ["a", "b"] and link["bandwidth_gbps"] == 6.0


def test_what_ifs_report_each_re_plan_before_it_runs(azure):
    """`plan --explain` re-plans once per variant (tens of seconds each on a big pool); the CLI's
    progress bar hangs on ``on_variant``, called once per variant, in order, before its re-plan."""
    from hetserve.planner.explain import what_ifs

    model = load_model("llama-2-7b")
    p = plan(load_cluster("molink-3x4090"), model, azure, "uniform", PlanOptions(seed=0))
    seen, planned = [], []

    def fn(c, m, w, o):
        planned.append(len(seen))  # the callback has already announced this variant
        return ALGORITHMS["uniform"](c, m, w, o)

    rows = what_ifs(p, "molink-3x4090", model, azure, PlanOptions(seed=0), fn,
                    on_variant=lambda i, n, label: seen.append((i, n, label)))
    assert rows and [s[2] for s in seen] == [r[0] for r in rows]
    assert [s[0] for s in seen] == list(range(len(rows))) and {s[1] for s in seen} == {len(rows)}
    assert planned == list(range(1, len(rows) + 1))


@pytest.mark.parametrize("slo", [["--slo-ttft", "0.05"], ["--slo-tpot", "0.0001"]])
def test_slos_no_replica_meets_say_so_not_memory(slo, capsys):
    """SLOs no layout meets give every replica a capacity of 0: the error names the targets and the
    fastest replica's own TTFT and TPOT, not the pool's memory (which holds the model)."""
    assert main(["plan", "--cluster", "demo-cpu", "--model", "llama-2-7b", "--objective", "goodput", *slo,
                 "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no replica of llama-2-7b on demo-cpu meets" in err, err
    assert f"{'TTFT' if slo[0] == '--slo-ttft' else 'TPOT'} ≤ {slo[1]} s" in err and "memory" not in err
    assert "TTFT" in err and "TPOT" in err and "--objective throughput" in err


def test_a_goodput_plan_says_its_value_and_bound_count_what_meets_the_slos(capsys):
    assert main(["plan", "--cluster", "demo-cpu", "--model", "llama-2-7b", "--objective", "goodput",
                 "--slo-ttft", "2", "--slo-tpot", "0.1", "--quiet"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "estimated throughput within the SLOs" in text and "tokens/s within the SLOs under the cost model" in text
