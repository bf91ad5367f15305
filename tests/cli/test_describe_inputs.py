"""``hetserve describe workload`` and ``describe cluster``: no figure where there is none (a trace
with no span has no arrival rate, not a rate of 0), nothing of the trace left out (its ``n`` and
``prompt_logprobs`` columns), and no name cut short on an 80-column console."""

import pytest

from hetserve.cli.main import main
from hetserve.specs.cluster import load_cluster

HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens"


@pytest.fixture
def narrow(monkeypatch):
    """An 80-column console, as a pipe or a plain terminal gives."""
    monkeypatch.setenv("COLUMNS", "80")


@pytest.mark.parametrize("rows, says", [
    ("0,100,10\n0,200,5\n", "2 requests, all arriving at one instant: no arrival rate"),
    ("3,100,10\n", "1 request: no arrival rate"),
])
def test_a_trace_with_no_span_has_no_rate(tmp_path, capsys, rows, says):
    trace = tmp_path / "t.csv"
    trace.write_text(f"{HEADER}\n{rows}")
    assert main(["describe", "workload", str(trace)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert says in out and "mean rate" not in out


def test_a_spread_trace_says_its_rate(tmp_path, capsys):
    trace = tmp_path / "t.csv"
    trace.write_text(f"{HEADER}\n0,100,10\n2,200,5\n")
    assert main(["describe", "workload", str(trace)]) == 0
    assert "2 requests over 2.00 s, mean rate 0.50 req/s" in capsys.readouterr().out


def test_a_traces_choices_and_scoring_columns_are_described(tmp_path, capsys):
    trace = tmp_path / "n.csv"
    trace.write_text(f"{HEADER},n,prompt_logprobs\n0,374,44,4,0\n1,396,1,1,1\n2,100,20,1,0\n")
    assert main(["describe", "workload", str(trace)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "choices (column n): 1 request with n > 1 (max 4, 6 choices in all; output is per choice)" in out
    assert "1 scoring their prompt (prompt_logprobs)" in out
    assert main(["describe", "workload", "azure-conv"]) == 0
    assert "choices" not in capsys.readouterr().out  # a plain trace: no such line


@pytest.mark.parametrize("name", ["hexgen2-het1", "hexgen2-het3"])
def test_describe_cluster_cuts_no_name_on_a_narrow_console(name, capsys, narrow):
    assert main(["describe", "cluster", name]) == 0
    out = capsys.readouterr().out
    assert "…" not in out
    rows = [ln for ln in out.splitlines() if ln.startswith("│")]
    assert rows and all(ln.rstrip().endswith("│") and len(ln) <= 80 for ln in rows)  # no row cropped
    assert all(d.gpu.name in out and d.site in out for d in load_cluster(name).devices)
