"""``hetserve simulate``'s printed figures: each table says where its figures come from, and no
figure is printed where the run has none (a latency of 0 for requests that never ran)."""

import json

import pytest
import yaml

from hetserve.cli.main import main

from .plans import single
from .test_cli import CLUSTER

HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


@pytest.fixture
def wide(monkeypatch):
    """A console wide enough that rich wraps no table row the assertions read."""
    monkeypatch.setenv("COLUMNS", "400")


def _files(tmp_path):
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(CLUSTER))
    single({"c0": ["m0:0"]}).save(tmp_path / "one.json")
    return tmp_path


def sim(pool, workload, *extra):
    return main(["simulate", "--plan", str(pool / "one.json"), "--cluster", str(pool / "c.yaml"), "--workload",
                 workload, "--no-progress", *extra])


def test_a_run_whose_every_request_is_rejected_prints_no_latency(tmp_path, capsys, wide):
    """Every request beyond llama-2-7b's 4,096 tokens: rejected at arrival, none completed. The
    summary's latency stats are null there; the table shows none, and says why."""
    pool = _files(tmp_path)
    trace = pool / "long.csv"
    trace.write_text(HEADER + "0,5000,20\n1,6000,20\n")
    assert sim(pool, str(trace)) == 0
    out = capsys.readouterr().out
    rows = [ln for ln in out.splitlines() if ln.startswith("│ TTFT") or ln.startswith("│ E2E")]
    assert len(rows) == 2 and all("0 " not in r and "–" in r for r in rows), rows
    assert "no request completed (every one rejected): no latency" in " ".join(out.split())
    assert "0 / 2" in out and "2 beyond the model's context" in out


def test_a_run_with_completed_requests_prints_its_latencies(tmp_path, capsys, wide):
    pool = _files(tmp_path)
    assert sim(pool, "azure-conv", "--limit", "5") == 0
    out = capsys.readouterr().out
    ttft = next(ln for ln in out.splitlines() if ln.startswith("│ TTFT"))
    assert "–" not in ttft and "no request completed" not in out


def test_the_rate_sweep_table_says_where_its_figures_come_from(tmp_path, capsys, wide):
    pool = _files(tmp_path)
    assert sim(pool, "azure-conv", "--limit", "20", "--sweep-rates", "1,2") == 0
    out = " ".join(capsys.readouterr().out.split())
    sweep = out[out.index("rate sweep"):]
    assert "simulated; times from the cost model (uncalibrated: an estimate), A100-SXM-80G: fitted" in sweep


def test_a_sweep_under_o_keeps_its_figures_as_numbers_and_a_later_run_removes_them(tmp_path, capsys):
    """With -o the sweep's figures were only in the plot; rate_sweep.json holds them as --json prints
    them, with where their times come from, and goes with the plot when a later run draws no sweep."""
    pool = _files(tmp_path)
    out = pool / "o"
    assert sim(pool, "azure-conv", "--limit", "20", "--sweep-rates", "1,2", "-o", str(out)) == 0
    saved = json.loads((out / "rate_sweep.json").read_text())
    assert [r["rate"] for r in saved["rate_sweep"]] == [1.0, 2.0]
    assert saved["rate_sweep"][0]["summary"]["requests"] == 20
    assert saved["timings"]["source"].startswith("cost model (uncalibrated: an estimate)")
    capsys.readouterr()
    assert sim(pool, "azure-conv", "--limit", "20", "-o", str(out)) == 0
    assert not (out / "rate_sweep.json").exists() and not (out / "rate_sweep.png").exists()
    assert f"removed {out / 'rate_sweep.png'} and {out / 'rate_sweep.json'}" in capsys.readouterr().err


def test_a_hand_written_efficiency_file_is_not_called_a_calibration(tmp_path, capsys, wide):
    """``--efficiency`` takes a calibration (``hetserve calibrate -o``) or a flat mapping of Efficiency
    fields someone wrote: the latter measured nothing, and the caption and summary.json say so, with
    the pricing it leads to (roofline: datasheet peaks x those factors)."""
    pool = _files(tmp_path)
    flat = pool / "flat.json"
    flat.write_text(json.dumps({"compute": 0.3}))
    assert sim(pool, "azure-conv", "--limit", "5", "--efficiency", str(flat), "--json") == 0
    source = json.loads(capsys.readouterr().out)["timings"]["source"]
    assert source == (f"cost model with the efficiency factors of {flat} (not a calibration: nothing measured, an "
                      "estimate), A100-SXM-80G: roofline (datasheet peaks x Efficiency)")
    assert "calibrated" not in source
