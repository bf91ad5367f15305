"""``hetserve simulate``'s outputs and option conflicts: no earlier run's file passes for this run's,
summary.json says where its times come from, and options that would be dropped or could not act are
refused in one line."""

import json

import pytest
import yaml

from hetserve.cli.main import main
from hetserve.planner.plan import Plan
from tests.cli_errors import one_line_error

from .plans import single
from .test_cli import CLUSTER


@pytest.fixture
def pool(tmp_path):
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(CLUSTER))
    single({"c0": ["m0:0"]}).save(tmp_path / "one.json")
    # a pipelined prefill replica: prefill stays aggregate under --pipeline detailed too
    Plan.from_dict({"model": "llama-2-7b", "cluster": "test", "replicas": [
        {"id": "p0", "role": "prefill", "stages": [{"devices": ["m0:0"], "layers": [0, 16]},
                                                   {"devices": ["m0:1"], "layers": [16, 32]}]},
        {"id": "d0", "role": "decode", "stages": [{"devices": ["m1:0"], "layers": [0, 32]}]}],
        "kv_routes": [{"from": "p0", "to": "d0", "weight": 1.0}]}).save(tmp_path / "pipe-prefill.json")
    Plan.from_dict({"model": "llama-2-7b", "cluster": "test", "replicas": [
        {"id": "c0", "role": "colocated", "stages": [{"devices": ["m0:0"], "layers": [0, 16]},
                                                     {"devices": ["m1:0"], "layers": [16, 32]}]}]}
                   ).save(tmp_path / "pipe.json")
    return tmp_path


def sim(pool, plan, *extra):
    return main(["simulate", "--plan", str(pool / plan), "--cluster", str(pool / "c.yaml"), "--workload",
                 "azure-conv", "--limit", "20", "--no-progress", *extra])


def test_an_earlier_runs_rate_sweep_is_removed_and_said(pool, capsys):
    out = pool / "sw"
    assert sim(pool, "one.json", "--sweep-rates", "1,2", "-o", str(out)) == 0
    assert (out / "rate_sweep.png").is_file() and "replacing" not in capsys.readouterr().err  # a new folder
    (out / "notes.txt").write_text("mine")
    assert sim(pool, "one.json", "-o", str(out)) == 0
    err = capsys.readouterr().err
    assert not (out / "rate_sweep.png").exists()
    assert f"removed {out / 'rate_sweep.png'}" in err and "--sweep-rates" in err
    assert f"replacing an earlier run's summary.json, requests.csv and latency_cdf.png in {out}" in err
    # this run's files are all there; a file simulate never writes is left alone
    assert {p.name for p in out.iterdir()} == {"summary.json", "requests.csv", "latency_cdf.png", "notes.txt"}
    # with a sweep again the plot is this run's, and nothing is said about removing it
    assert sim(pool, "one.json", "--sweep-rates", "1", "-o", str(out)) == 0
    assert (out / "rate_sweep.png").is_file() and "removed" not in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--placement", "rr", "--router", "jsq"], ["--router", "jsq", "--placement", "rr"],
                                  ["--placement", "rr", "--placement", "jsq"]])
def test_two_placements_are_refused(pool, capsys, argv):
    """``--router`` is ``--placement``'s other spelling: two different values would drop one."""
    assert sim(pool, "one.json", *argv, "--json") == 2
    err = one_line_error(capsys)
    assert "one placement" in err and "--router is --placement's other spelling" in err
    assert f"{argv[0]} {argv[1]} and {argv[2]} {argv[3]}" in err


def test_one_placement_in_both_spellings_is_taken(pool, capsys):
    assert sim(pool, "one.json", "--placement", "rr", "--router", "rr", "--json") == 0
    assert json.loads(capsys.readouterr().out)["run"]["placement"] == "rr"


@pytest.mark.parametrize("plan", ["one.json", "pipe-prefill.json"])
def test_detailed_pipeline_with_no_pipeline_to_detail_is_refused(pool, capsys, plan):
    """As ``--transmission`` with nothing on the links: an option with nothing to act on is refused,
    naming the option, the plan and why."""
    assert sim(pool, plan, "--pipeline", "detailed") == 2
    err = one_line_error(capsys)
    assert err.startswith("hetserve simulate: error: --pipeline detailed") and plan in err and "drop --pipeline" in err
    assert "has none" in err


def test_detailed_pipeline_on_a_pipeline_runs(pool, capsys):
    assert sim(pool, "pipe.json", "--pipeline", "detailed", "--json") == 0
    assert json.loads(capsys.readouterr().out)["run"]["pipeline"] == "detailed"


def test_summary_json_says_where_its_times_come_from(pool, capsys):
    """The table's caption and summary.json's ``timings`` say the same: the cost model's pricing per
    GPU type (fitted, transferred, roofline), or the calibration file the times were calibrated by."""
    out = pool / "o"
    assert sim(pool, "one.json", "-o", str(out)) == 0
    table = " ".join(capsys.readouterr().out.split())
    t = json.loads((out / "summary.json").read_text())["timings"]
    assert t["calibration"] is None and t["pricing"] == {"A100-SXM-80G": "fitted"}
    assert t["source"].startswith("cost model (uncalibrated: an estimate), A100-SXM-80G: fitted")
    assert f"times from the {t['source']}" in table
    cal = pool / "cal.json"
    cal.write_text(json.dumps({"gpu": "A100-SXM-80G", "efficiency": {},
                               "measured_on": {"device": "A100", "date": "2026-11-30"}}))
    assert sim(pool, "one.json", "--efficiency", str(cal), "--json") == 0
    t = json.loads(capsys.readouterr().out)["timings"]
    assert t["calibration"] == str(cal) and t["source"] == f"cost model calibrated by {cal} (measured on A100, 2026-11-30)"
