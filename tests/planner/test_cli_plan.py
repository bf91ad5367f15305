import json

from hetserve.cli.main import main
from hetserve.planner import Plan, validate_plan
from hetserve.specs.cluster import load_cluster
from hetserve.specs.model import load_model


def test_plan_writes_a_valid_plan(tmp_path, capsys, monkeypatch):
    from hetserve.planner.bound import throughput

    monkeypatch.setattr(throughput, "group_bound", lambda *args, **kwargs: None)  # the file, not the MILP's bound
    out, hist = tmp_path / "plan.json", tmp_path / "history.json"
    assert main(["plan", "--cluster", "hexgen2-het1", "--model", "llama-2-70b", "--workload-class", "LPHD",
                 "--max-iterations", "5", "--disaggregated", "--quiet", "-o", str(out), "--history", str(hist)]) == 0
    text = capsys.readouterr().out
    assert "KV routes" in text and "tokens/s" in text and "$" in text
    plan = Plan.load(out)
    validate_plan(plan, load_cluster("hexgen2-het1"), load_model("llama-2-70b"))
    assert json.loads(out.read_text())["estimate"]["throughput_tokens_per_s"] > 0
    # the plan keeps the search's summary; the history file has the convergence curve
    assert "history" not in json.loads(out.read_text())["estimate"]["search"]
    run = json.loads(hist.read_text())["runs"][0]
    # --max-iterations caps the search's iterations; the plan chosen after it adds a curve point only
    assert run["algorithm"] == "hexgen2" and run["iterations"] == 5
    assert len(run["history"]) in (5, 6) and run["history"][-1][1] == max(v for _, v in run["history"])


def test_compare_and_plot(tmp_path, capsys):
    png = tmp_path / "conv.png"
    assert main(["plan", "--cluster", "demo-cpu", "--model", "llama-2-7b", "--compare", "hexgen2,uniform,exact",
                 "--quiet", "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "hexgen2" in text and "uniform" in text and "exact" in text
    # rich prints 80 columns where the output is not a terminal: every header and figure in full
    assert all(h in text for h in ("search s", "$/h", "P/D/C", "iters")) and "…" not in text
    # the legend gives T and the caption where the figures come from (the plan's own pricing line)
    flat = " ".join(text.split())
    assert "req/T: requests per period T = 600 s" in flat and "tokens/s: output tokens per second" in flat
    assert "tokens/s and req/T: the planner's estimates under the cost model; priced by: " in flat
    assert "transferred from the profiled GPUs" in flat
    assert png.stat().st_size > 1000


def test_infeasible_pool_is_one_line_exit_2(capsys):
    assert main(["plan", "--cluster", "molink-3x4090", "--model", "llama-2-70b", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert "llama-2-70b needs 138 GB for its weights alone, the pool molink-3x4090 has 72 GB" in err


def test_a_pool_of_small_slots_says_its_memory_not_zero(capsys):
    """CPU worker slots hold well under a GB each: the message says how much, not '0 GB'."""
    assert main(["plan", "--cluster", "demo-tiny", "--model", "llama-2-7b", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "llama-2-7b needs 13 GB for its weights alone" in err and " 0 GB" not in err
    assert main(["describe", "cluster", "demo-tiny"]) == 0
    assert " 0 GB" not in capsys.readouterr().out


def test_unknown_algorithm_exit_2(capsys):
    assert main(["plan", "--cluster", "demo-cpu", "--model", "llama-2-7b", "--algorithm", "magic"]) == 2
    assert "unknown planning algorithm 'magic'" in capsys.readouterr().err


def test_explain_prints_the_cut_and_a_what_if_table_with_each_re_plans_bound(capsys):
    assert main(["plan", "--cluster", "molink-3x4090", "--model", "llama-2-7b", "--algorithm", "uniform",
                 "--explain", "--quiet"]) == 0
    text = capsys.readouterr().out
    assert "what bounds this plan" in text and "what-ifs" in text
    rows = [line for line in text.splitlines() if "+1 " in line]
    assert rows and all(line.rstrip(" │|").split()[-1].replace(",", "").isdigit() for line in rows), rows
    # each row says whether it is the current plan on the edited pool or a re-plan, and never reads
    # below the plan (more hardware cannot take the current plan away)
    assert all(("re-planned" in line or "current plan" in line) and "-" not in line.split("%")[0][-8:]
               for line in rows), rows


def test_a_plan_that_serves_nothing_is_refused_naming_the_link(tmp_path, capsys):
    """Two single-GPU sites that each cannot hold the model, joined by a link of almost no bandwidth:
    the best plan serves 0 tokens/s; the command says why, with the link's figure, and writes nothing."""
    pool = tmp_path / "slow.yaml"
    pool.write_text("name: slow\nmachines:\n  - {name: a, gpu: RTX-4090, count: 1, site: s1}\n"
                    "  - {name: b, gpu: RTX-4090, count: 1, site: s2}\n"
                    "network:\n  inter_site: {bandwidth_gbps: 1e-9, latency_ms: 100000}\n")
    out = tmp_path / "plan.json"
    assert main(["plan", "--cluster", str(pool), "--model", "llama-2-13b", "--quiet", "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "serves 0 tokens/s" in err and "pipe:s1>s2" in err and "1e-09 Gbit/s" in err, err
    assert not out.exists()


def test_a_calibration_of_another_gpu_type_is_pointed_out(tmp_path, capsys, monkeypatch):
    """--efficiency from a calibration made as a GPU type the pool lacks: planned with, and said."""
    monkeypatch.setenv("COLUMNS", "1000")  # rich folds a long path mid-word at the terminal's width
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"gpu": "H100-SXM-80G", "efficiency": {},
                               "measured_on": {"device": "AMD EPYC", "date": "2026-11-30 13:46 UTC"}}))
    args = ["plan", "--cluster", "demo-cpu", "--model", "llama-2-7b", "--algorithm", "uniform", "--quiet"]
    saved = tmp_path / "plan.json"
    assert main(args + ["--efficiency", str(cal), "-o", str(saved)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "calibrated as H100-SXM-80G (measured on AMD EPYC, 2026-11-30 13:46 UTC)" in out
    assert "L4, RTX-4090" in out
    # the plan says whose efficiencies priced it, on screen and in the file
    mark = f"cost model calibrated by {cal} (measured on AMD EPYC, 2026-11-30 13:46 UTC)"
    assert f"efficiencies: the {mark}" in out
    assert json.loads(saved.read_text())["estimate"]["calibration"] == mark
    cal.write_text(json.dumps({"gpu": "L4", "efficiency": {}}))
    assert main(args + ["--efficiency", str(cal)]) == 0
    assert "calibrated as" not in capsys.readouterr().out


def test_time_limit_help_says_what_runs_past_the_limit(capsys):
    """The limit is one plan search's: the cost objective's budgets and --explain's what-ifs each
    search again, so the help says they come on top (a run of several times the limit is no bug)."""
    try:
        main(["plan", "--help"])
    except SystemExit:
        pass
    text = " ".join(capsys.readouterr().out.split())
    assert "--time-limit S seconds for one plan search (default 110; each --compare algorithm has its own)" in text
    assert "--objective cost: each budget tried is such a search with the full limit" in text
    assert "--explain: a quick re-plan per what-if, each up to the limit" in text


def test_a_cost_plan_names_its_budget_as_the_one_it_searched_and_its_bound_as_within_it(capsys):
    """``--objective cost`` is given no budget: the one printed is the cheapest the search tried
    that serves the rate, and the bound beside it is of placements within that budget."""
    assert main(["plan", "--cluster", "demo-cpu", "--model", "llama-2-7b", "--objective", "cost", "--rate", "0.5",
                 "--slo-ttft", "5", "--slo-tpot", "0.5", "--time-limit", "3", "--quiet"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "the cheapest budget tried that serves the rate $" in out
    assert "% of the bound: no placement within $" in out and "no placement of this pool" not in out
