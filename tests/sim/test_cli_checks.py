"""``hetserve simulate`` says so when an option cannot act: a rate on a trace without spaced
arrivals, link scheduling with nothing on the links; and reports rejected requests."""

import json

import pytest
import yaml

from hetserve.cli.main import main
from hetserve.planner.plan import Plan
from tests.cli_errors import one_line_error

from .plans import single
from .test_cli import CLUSTER


def write(tmp_path, rows, name="trace.csv"):
    path = tmp_path / name
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(f"{t},{i},{o}\n" for t, i, o in rows))
    return str(path)


@pytest.fixture
def pool(tmp_path):
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(CLUSTER))
    single({"p0": ["m0:0"], "d0": ["m1:0"]}, routes=[("p0", "d0", 1.0)]).save(tmp_path / "pd.json")
    Plan.from_dict({"model": "llama-2-7b", "cluster": "test", "replicas": [
        {"id": "c0", "role": "colocated", "stages": [{"devices": ["m0:0"], "layers": [0, 16]},
                                                     {"devices": ["m1:0"], "layers": [16, 32]}]}]}
                   ).save(tmp_path / "pipe.json")
    Plan.from_dict({"model": "llama-2-7b", "cluster": "test", "replicas": [
        {"id": "p0", "role": "prefill", "stages": [{"devices": ["m0:0"], "layers": [0, 32]}]},
        {"id": "d0", "role": "decode", "stages": [{"devices": ["m0:1"], "layers": [0, 16]},
                                                  {"devices": ["m1:0"], "layers": [16, 32]}]}],
        "kv_routes": [{"from": "p0", "to": "d0", "weight": 1.0}]}).save(tmp_path / "pd-pipe.json")
    return tmp_path


def sim(pool, plan, *extra):
    return main(["simulate", "--plan", str(pool / plan), "--cluster", str(pool / "c.yaml"), "--no-progress", *extra])


@pytest.mark.parametrize("option", [["--rate", "5"], ["--rate-scale", "2"], ["--sweep-rates", "1,2"]])
def test_a_rate_on_arrivals_at_one_instant_is_an_error_that_says_why(pool, capsys, option):
    trace = write(pool, [(0, 100 + k, 20) for k in range(20)], "burst.csv")
    assert sim(pool, "pd.json", "--workload", trace, *option) == 2
    err = one_line_error(capsys)
    assert f"{trace}: field 'arrivals'" in err and option[0] in err
    assert "all 20 requests arriving at one instant" in err and f"drop {option[0]}" in err
    # without the rate the burst runs, all 20 at once
    assert sim(pool, "pd.json", "--workload", trace, "--json") == 0
    assert json.loads(capsys.readouterr().out)["completed"] == 20


def test_a_rate_on_one_request_is_an_error(pool, capsys):
    assert sim(pool, "pd.json", "--workload", "azure-conv", "--limit", "1", "--rate", "5") == 2
    err = capsys.readouterr().err
    assert "azure-conv: field 'arrivals'" in err and "got '1 request'" in err


def test_a_rate_on_spaced_arrivals_still_rescales_them(pool, capsys):
    trace = write(pool, [(k, 100, 20) for k in range(10)])
    assert sim(pool, "pd.json", "--workload", trace, "--rate", "3", "--json") == 0
    assert json.loads(capsys.readouterr().out)["duration_s"] < 9.0  # 9 s of arrivals compressed to 3


def test_transmission_with_nothing_on_the_links_is_refused(pool, capsys):
    """A colocated pipeline under the aggregate model sends nothing over the links: an explicit
    --transmission is refused, naming both options and the way to its effect."""
    assert sim(pool, "pipe.json", "--workload", "azure-conv", "--limit", "10", "--transmission", "molink") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--transmission molink" in err and "--pipeline aggregate" in err
    assert "--pipeline detailed" in err
    # the default scheduling is no choice of the user's: nothing to say
    assert sim(pool, "pipe.json", "--workload", "azure-conv", "--limit", "10", "--json") == 0
    assert "transmission" not in capsys.readouterr().err
    # detailed: the activations are on the links, and the choice acts
    assert sim(pool, "pipe.json", "--workload", "azure-conv", "--limit", "10", "--transmission", "molink",
               "--pipeline", "detailed", "--json") == 0
    out = capsys.readouterr()
    assert "transmission" not in out.err and json.loads(out.out)["run"]["transmission"] == "molink"


def test_transmission_on_kv_only_warns_about_the_pipelines(pool, capsys):
    assert sim(pool, "pd-pipe.json", "--workload", "azure-conv", "--limit", "10", "--transmission", "serial",
               "--json") == 0
    err = capsys.readouterr().err
    assert "warning: --transmission serial schedules only the KV hand-offs under --pipeline aggregate" in err
    assert "(d0)" in err and "--pipeline detailed" in err
    # no pipelines: KV hand-offs are all the links carry, and the choice acts on them
    assert sim(pool, "pd.json", "--workload", "azure-conv", "--limit", "10", "--transmission", "serial",
               "--json") == 0
    out = capsys.readouterr()
    assert "transmission" not in out.err
    # MoLink's decode-first rule has no decode traffic to put first: it is said, and it sends as serial does
    serial = json.loads(out.out)
    assert sim(pool, "pd.json", "--workload", "azure-conv", "--limit", "10", "--transmission", "molink",
               "--json") == 0
    out = capsys.readouterr()
    assert "warning: --transmission molink sends decode activations ahead of bulk traffic" in out.err
    molink = json.loads(out.out)
    assert molink["ttft_s"] == serial["ttft_s"] and molink["e2e_s"] == serial["e2e_s"]


def test_rejected_requests_in_the_json_and_the_table(pool, capsys):
    trace = write(pool, [(0.1 * k, 10**12 if k == 3 else 200, 40) for k in range(8)])
    assert sim(pool, "pd.json", "--workload", trace, "--json") == 0
    out = capsys.readouterr()
    s = json.loads(out.out)
    assert s["requests"] == 8 and s["completed"] == 7 and s["rejected"] == 1 and s["rejected_by"] == {"context": 1}
    assert "rejected at arrival as a server rejects them" in out.err
    assert sim(pool, "pd.json", "--workload", trace, "--run-beyond-context", "--json") == 0
    assert json.loads(capsys.readouterr().out)["rejected_by"] == {"kv": 1}  # no pool holds it either
    assert sim(pool, "pd.json", "--workload", trace) == 0
    table = capsys.readouterr().out
    assert "requests rejected" in table and "1 beyond the model's context" in table and "7 / 8" in table
    assert sim(pool, "pd.json", "--workload", trace, "--within-context", "--json") == 0
    s = json.loads(capsys.readouterr().out)
    assert s["requests"] == s["completed"] == 7 and s["rejected"] == 0


def test_describe_workload_refuses_a_rate_it_cannot_apply(tmp_path, capsys):
    trace = write(tmp_path, [(0, 100, 20)] * 5, "burst.csv")
    assert main(["describe", "workload", trace, "--rate", "5"]) == 2
    assert f"{trace}: field 'arrivals'" in capsys.readouterr().err
    assert main(["describe", "workload", trace]) == 0


def test_every_command_refuses_a_rate_the_trace_cannot_take(pool, capsys):
    """The rule lives in ``Workload.with_rate``: capacity and describe refuse it as simulate does."""
    trace = write(pool, [(0, 100 + k, 20) for k in range(20)], "burst.csv")
    assert main(["capacity", "--model", "llama-2-7b", "--gpu", "A100-SXM-80G", "--workload", trace, "--rate", "5",
                 "--slo-ttft", "1", "--slo-tpot", "0.1", "--requests", "20"]) == 2
    assert "at one instant" in capsys.readouterr().err
    assert main(["describe", "workload", trace, "--rate", "5"]) == 2
    assert "at one instant" in capsys.readouterr().err


@pytest.mark.parametrize("option, word", [("--efficiency", "nope.json"), ("--token-budget", "--token-budget")])
def test_a_bad_option_is_refused_before_the_trace_is_read(pool, capsys, monkeypatch, option, word):
    """Input errors come before any work: the plan, ``--efficiency`` and the token budget are checked
    before the workload is read (so no warning about the trace precedes the one-line error)."""
    from hetserve.specs import workload

    def no_trace(*args, **kwargs):
        raise AssertionError("the trace was read before the options were checked")

    monkeypatch.setattr(workload, "load_workload", no_trace)
    trace = write(pool, [(0, 10, 10)])
    value = str(pool / "nope.json") if option == "--efficiency" else "1"
    assert sim(pool, "pd.json", "--workload", trace, option, value) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and word in err[0], err


@pytest.mark.parametrize("plan, options, word", [
    ("pd.json", ["--pipeline", "detailed"], "--pipeline detailed"),
    ("pipe.json", ["--transmission", "molink"], "--transmission molink"),
    ("pipe.json", ["--within-context", "--transmission", "molink"], "--transmission molink"),
])
def test_an_option_refused_comes_alone_before_the_traces_warnings(pool, capsys, plan, options, word):
    """A refusal is the one line a refused run prints: the trace's context warning (or
    --within-context's note) waits until every option is checked."""
    trace = write(pool, [(0, 5000, 20), (1, 100, 20)])  # the first beyond llama-2-7b's 4096 tokens
    assert sim(pool, plan, "--workload", trace, *options) == 2
    assert word in one_line_error(capsys)
    # a run that goes ahead still says it (the warning, or --within-context's note)
    assert sim(pool, "pd.json", "--workload", trace, "--json", *[o for o in options if o == "--within-context"]) == 0
    assert "exceed llama-2-7b's context" in capsys.readouterr().err
