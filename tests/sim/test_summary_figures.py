"""A summary figure no request has is null, never a zero that reads as measured; a one-token output
has no token interval, so TPOT and ATGT leave it out, as the served measurements do."""

import json

import numpy as np

from hetserve.serve.loadgen import LoadResult, summarize
from hetserve.sim import simulate
from hetserve.specs.workload import Workload

from .plans import single


def test_one_token_outputs_leave_tpot_and_atgt_alone(cluster, model):
    plan = single({"c0": ["m0:0"]})
    many = simulate(plan, cluster, model, Workload.from_lists("t", [0.0, 5.0], [100, 120], [20, 30])).summary()
    with_one = simulate(plan, cluster, model, Workload.from_lists("t", [0.0, 5.0, 10.0], [100, 120, 80],
                                                                 [20, 30, 1])).summary()
    assert with_one["completed"] == 3
    for key in ("tpot_s", "atgt_s"):
        assert with_one[key] == many[key], key  # not pulled down by a zero
    assert with_one["ttft_s"] != many["ttft_s"]  # the third request counts where it has the figure


def test_figures_no_request_has_are_null_in_the_json(cluster, model):
    res = simulate(single({"c0": ["m0:0"]}), cluster, model, Workload.from_lists("t", [0.0, 1.0], [100, 90], [1, 1]))
    s = json.loads(json.dumps(res.summary()))
    assert s["completed"] == 2 and s["ttft_s"]["mean"] > 0
    assert s["tpot_s"] == s["atgt_s"] == {"mean": None, "p50": None, "p90": None, "p99": None}
    assert s["kv_transfer_s"]["p99"] is None  # a colocated plan hands no KV off
    none_done = simulate(single({"c0": ["m0:0"]}), cluster, model,
                         Workload.from_lists("t", [0.0], [10**6], [5])).summary()
    assert none_done["completed"] == 0 and none_done["e2e_s"]["mean"] is None


def test_served_summaries_use_the_same_rule():
    ok = [LoadResult(0.0, 10, 5, 0.1, 0.02, 0.2), LoadResult(0.5, 10, 1, 0.1, None, 0.1)]
    s = summarize(ok)
    assert s["tpot_s"]["mean"] == 0.02 and np.isclose(s["ttft_s"]["mean"], 0.1)
    assert summarize([])["ttft_s"]["mean"] is None


def test_requests_csv_has_no_token_interval_for_a_one_token_output(cluster, model, tmp_path):
    """The per-request file agrees with the summary: a mean of its TPOT column (nan left out) is the
    summary's, where a 0 written for the one-token output would pull it down."""
    import csv
    import math

    res = simulate(single({"c0": ["m0:0"]}), cluster, model,
                   Workload.from_lists("t", [0.0, 5.0, 10.0], [100, 120, 80], [20, 30, 1]))
    res.save(tmp_path, plots=False)
    rows = list(csv.DictReader((tmp_path / "requests.csv").open()))
    assert math.isnan(float(rows[2]["tpot_s"])) and math.isnan(float(rows[2]["atgt_s"]))
    assert rows[2]["slo_met"] == "1"
    tpots = [float(r["tpot_s"]) for r in rows if not math.isnan(float(r["tpot_s"]))]
    assert np.isclose(np.mean(tpots), json.loads((tmp_path / "summary.json").read_text())["tpot_s"]["mean"],
                      rtol=1e-5)
