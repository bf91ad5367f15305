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


def _fleet(tmp_path, machines: int):
    """``machines`` machines of two shapes, five to a site: 100 Gbit/s in a site, 3 between sites."""
    rows = "".join(f"  - {{name: m{i}, gpu: {'H100-SXM-80G' if i % 2 else 'A6000'}, count: 8, site: s{i // 5}}}\n"
                   for i in range(machines))
    path = tmp_path / f"fleet{machines}.yaml"
    path.write_text(f"name: fleet\nmachines:\n{rows}network:\n  intra_site: {{bandwidth_gbps: 100, latency_ms: 0.2}}\n"
                    "  inter_site: {bandwidth_gbps: 3, latency_ms: 15}\n")
    return str(path)


def test_describe_cluster_groups_a_fleets_rows_with_their_counts(tmp_path, capsys, monkeypatch):
    """A pool of many machines reads as its machine shapes and link kinds, each with its count: one
    row per machine pair would be 1,770 rows for 60 machines (and take a minute to lay out)."""
    monkeypatch.setenv("COLUMNS", "200")
    lines = {}
    for machines in (60, 120):
        assert main(["describe", "cluster", _fleet(tmp_path, machines)]) == 0
        out = capsys.readouterr().out
        lines[machines] = len(out.splitlines())
        pairs, within = machines * (machines - 1) // 2, (machines // 5) * 10  # 10 pairs in each site of 5
        assert f"{machines * 8} devices on {machines} machines, {machines // 5} sites" in out
        assert f"{within:,}" in out and f"{pairs - within:,}" in out  # pairs within a site and between sites
        assert f"{machines // 2}: m0, m2, m4, …" in out and f"{machines // 2}: m1, m3, m5, …" in out
        assert f"{machines // 5 * (machines // 5 - 1) // 2:,}: pipe s0 ↔ s1" in out
    assert lines[60] == lines[120] < 60  # the rows do not grow with the pool
