"""``hetserve simulate`` end to end on a small cluster file."""

import json
from pathlib import Path

import yaml

from hetserve.cli.main import main

from .plans import single

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

CLUSTER = {"name": "test", "machines": [{"name": "m0", "gpu": "A100-SXM-80G", "count": 4, "site": "s0"},
                                        {"name": "m1", "gpu": "A100-SXM-80G", "count": 4, "site": "s1"}],
           "network": {"inter_site": {"bandwidth_gbps": 100, "latency_ms": 1}}}


def files(tmp_path):
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(CLUSTER))
    single({"p0": ["m0:0"], "d0": ["m1:0"]}, routes=[("p0", "d0", 1.0)]).save(tmp_path / "plan.json")
    return str(tmp_path / "plan.json"), str(tmp_path / "c.yaml")


def test_simulate_writes_outputs(tmp_path, capsys):
    plan, cluster = files(tmp_path)
    out = tmp_path / "out"
    rc = main(["simulate", "--plan", plan, "--cluster", cluster, "--workload", "azure-conv", "--limit", "60",
               "--rate", "2", "--router", "po2", "--transmission", "serial", "--slo-ttft", "5", "--slo-tpot", "0.1",
               "--no-progress", "-o", str(out)])
    assert rc == 0
    s = json.loads((out / "summary.json").read_text())
    # the first 60 requests hold 4 beyond llama-2-7b's context: rejected, as a server rejects them
    assert s["requests"] == 60 and s["completed"] == 56 and s["rejected_by"] == {"context": 4}
    assert s["run"]["placement"] == "po2"
    assert s["run"]["transmission"] == "serial" and s["slo"]["ttft_s"] == 5.0
    assert (out / "requests.csv").exists() and (out / "latency_cdf.png").exists()
    assert "TTFT" in capsys.readouterr().out


def test_simulate_json_and_class(tmp_path, capsys):
    plan, cluster = files(tmp_path)
    rc = main(["simulate", "--plan", plan, "--cluster", cluster, "--workload", "azure-conv", "--workload-class",
               "LPLD", "--limit", "30", "--rate-scale", "4", "--json"])
    assert rc == 0
    assert json.loads(capsys.readouterr().out)["completed"] == 30


def test_unknown_router_is_one_line(tmp_path, capsys):
    plan, cluster = files(tmp_path)
    rc = main(["simulate", "--plan", plan, "--cluster", cluster, "--workload", "azure-conv", "--limit", "5",
               "--router", "nope", "--no-progress"])
    err = capsys.readouterr().err
    # refused by the parser (the policies' registry as choices): one line naming the command and the value
    assert rc == 2 and err.startswith("hetserve simulate: error:") and "nope" in err and len(err.strip().splitlines()) == 1


def test_simulate_rate_sweep_table_and_plot(tmp_path, capsys):
    plan, cluster = files(tmp_path)
    out = tmp_path / "out"
    rc = main(["simulate", "--plan", plan, "--cluster", cluster, "--workload", "azure-conv", "--limit", "80",
               "--slo-ttft", "5", "--slo-tpot", "0.1", "--no-progress", "--sweep-rates", "1,8", "-o", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "rate sweep" in text and (out / "rate_sweep.png").stat().st_size > 0


def test_simulate_rejects_bad_sweep_rates(tmp_path, capsys):
    plan, cluster = files(tmp_path)
    rc = main(["simulate", "--plan", plan, "--cluster", cluster, "--workload", "azure-conv", "--limit", "10",
               "--no-progress", "--sweep-rates", "1,-2"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "--sweep-rates: expected positive rates" in err and "'1,-2'" in err


def test_without_an_slo_attainment_and_goodput_are_not_printed_as_figures(tmp_path, capsys):
    """No --slo-*: every request trivially meets "the SLO"; printing attainment 1.000 beside a TTFT
    p90 of minutes misleads. The table says n/a instead (summary and sweep)."""
    plan, cluster = files(tmp_path)
    rc = main(["simulate", "--plan", plan, "--cluster", cluster, "--workload", "azure-conv", "--limit", "40",
               "--no-progress", "--sweep-rates", "1,8"])
    assert rc == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "SLO attainment" in ln or ln.strip().startswith("│ 8")]
    assert lines and all("1.000" not in ln for ln in lines), lines
    assert any("n/a" in ln for ln in lines)


def test_a_plan_naming_a_checkpoint_not_here_says_so_and_how_to_get_it(tmp_path, capsys, monkeypatch):
    """The bundled demo plans name the checkpoint `make-model -o NAME` writes; simulated from a folder
    without it, the error names the plan file, its model field and the two ways out."""
    monkeypatch.chdir(tmp_path)
    rc = main(["simulate", "--plan", str(EXAMPLES / "plans" / "asym-colocated.json"), "--workload", "azure-conv",
               "--limit", "5", "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1
    assert "asym-colocated.json: field 'model'" in err and "'tiny-llama-gqa'" in err
    assert "pass --model" in err and "make-model ... -o tiny-llama-gqa" in err
