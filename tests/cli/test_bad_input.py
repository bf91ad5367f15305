"""Every bad input the CLI can get: one line naming it and what was expected, exit code 2, no traceback.

Options are covered by walking the parser (every numeric option of every command gets NaN, a
negative and a non-number); files by one table per file kind, read through ``describe`` (which
does nothing but load them) and through the commands that take them."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from hetserve.cli.main import build_parser, main


def run(argv: list[str], capsys) -> tuple[int, list[str]]:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse refuses a value while parsing
        code = exc.code
    captured = capsys.readouterr()
    return code, [ln for ln in captured.err.splitlines() if ln.strip()]


def _numeric_options() -> list[tuple[str, str]]:
    out = []
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for command, parser in sub.choices.items():
        for action in parser._actions:
            if action.option_strings and getattr(action.type, "__name__", "") in ("int", "float"):
                out.append((command, action.option_strings[-1]))
    return out


OPTIONS = _numeric_options()


def test_the_walk_finds_the_options_it_should():
    assert {("serve", "--port"), ("simulate", "--slo-ttft"), ("plan", "--time-limit"), ("make-model", "--layers"),
            ("capacity", "--rate"), ("serve", "--drain-timeout")} <= set(OPTIONS)


@pytest.mark.parametrize("value", ["nan", "-1", "inf", "abc"])
@pytest.mark.parametrize("command, option", OPTIONS, ids=[f"{c}{o}" for c, o in OPTIONS])
def test_every_numeric_option_refuses_bad_numbers(command, option, value, capsys):
    code, err = run([command, option, value], capsys)
    assert code == 2 and len(err) == 1, err
    assert option in err[0] and "expected" in err[0] and "Traceback" not in err[0]


def test_a_port_past_65535_is_refused_before_anything_starts(capsys):
    code, err = run(["serve", "--plan", "x.json", "--model", "m", "--port", "70000"], capsys)
    assert code == 2 and err == ["hetserve serve: error: argument --port: expected an integer in [0, 65535], "
                                 "got '70000'"]


CLUSTER = "name: c\nmachines:\n  - {name: a, gpu: RTX-4090, count: COUNT}\n"
CONFIG = {"model_type": "llama", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 128}
OPT_CONFIG = {"model_type": "opt", "vocab_size": 320, "hidden_size": 64, "ffn_dim": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "max_position_embeddings": 128}
NOT_UTF8 = b"\xff\xfe\x00bad"

# (kind, file name, content, words the one line must hold)
FILES = [
    ("cluster", "c.yaml", CLUSTER.replace("COUNT", "true"), ["count"]),
    ("cluster", "c.yaml", CLUSTER.replace("COUNT", "200000"), ["count", "1024"]),
    ("cluster", "c.yaml", CLUSTER.replace("COUNT", "2") + "network:\n  intra_site: {bandwidth_gbps: .inf, "
     "latency_ms: 1}\n", ["bandwidth_gbps", "finite"]),
    ("cluster", "c.yaml", NOT_UTF8, ["UTF-8"]),
    ("cluster", "missing.yaml", None, ["missing.yaml"]),
    ("cluster", "c.yaml", "", ["empty file"]),
    ("model", "config.json", json.dumps({**CONFIG, "num_key_value_heads": "abc"}), ["num_key_value_heads"]),
    ("model", "config.json", json.dumps({**CONFIG, "num_key_value_heads": 3}), ["shape"]),
    ("model", "config.json", json.dumps({**CONFIG, "head_dim": -4}), ["head_dim"]),
    ("model", "config.json", NOT_UTF8, ["UTF-8"]),
    ("model", "config.json", json.dumps({**OPT_CONFIG, "num_attention_heads": 5}), ["num_attention_heads", "64"]),
    ("workload", "w.csv", NOT_UTF8, ["UTF-8"]),
    ("workload", "w.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\nnan,10,10\n", ["timestamp", "finite"]),
    ("workload", "w.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\ninf,10,10\n", ["timestamp", "finite"]),
    ("workload", "w.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n0,-5,10\n", ["positive"]),
    ("workload", "w.csv", "a,b\n1,2\n", ["header"]),
    # numbers near float's range overflow once in bytes/s; a key given twice keeps only one value
    ("cluster", "c.yaml", CLUSTER.replace("COUNT", "2") + "network:\n  intra_site: {bandwidth_gbps: 1e308, "
     "latency_ms: 1}\n", ["bandwidth_gbps", "less than or equal to 1000000"]),
    ("cluster", "c.yaml", CLUSTER.replace("COUNT", "2") + "network:\n  intra_site: {bandwidth_gbps: 100, "
     "latency_ms: 1}\n  intra_site: {bandwidth_gbps: 1, latency_ms: 1}\n", ["intra_site", "twice"]),
    ("cluster", "c.yaml", CLUSTER.replace("COUNT", "2").replace("count: 2", "count: 2, site: ''"), ["site"]),
    ("model", "config.json", json.dumps({k: v for k, v in CONFIG.items() if k != "intermediate_size"}),
     ["'intermediate_size'", "a positive integer"]),
]


@pytest.mark.parametrize("header", ["\ufeffTIMESTAMP,ContextTokens,GeneratedTokens", "Timestamp,contexttokens,"
                                    "GeneratedTokens"])
def test_a_traces_arrival_times_are_read_whatever_the_headers_spelling(header, tmp_path):
    from hetserve.specs.workload import load_workload

    path = tmp_path / "w.csv"
    path.write_text(header + "\n0,10,10\n5,10,10\n", encoding="utf-8")
    assert list(load_workload(str(path)).arrival_s) == [0.0, 5.0]  # the file's, not made-up Poisson arrivals


def test_a_float64_checkpoint_is_sized_as_the_float32_it_is_served_in(tmp_path):
    from hetserve.specs.model import load_model

    (tmp_path / "config.json").write_text(json.dumps({**CONFIG, "torch_dtype": "float64"}))
    assert load_model(str(tmp_path)).dtype_bytes == 4


def test_make_model_never_writes_over_a_folder_that_holds_files(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    code, err = run(["make-model", "-o", str(tmp_path)], capsys)
    assert code == 2 and len(err) == 1 and "config.json" in err[0] and "empty folder" in err[0]
    assert (tmp_path / "config.json").read_text() == "{}"


@pytest.mark.parametrize("argv, words", [
    (["--chunked-prefill", "--prefill-mode", "prefill_first"], ["--chunked-prefill", "one prefill mode"]),
    (["--chunked-prefill", "--prefill-mode", "mixed"], ["--chunked-prefill", "one prefill mode", "mixed"]),
    (["--chunk-tokens", "64"], ["--chunk-tokens", "--prefill-mode chunked beside it", "mixed"]),
    (["--prefill-mode", "chunked", "--chunk-tokens", "0"], ["--chunk-tokens", "> 0"]),
])
def test_simulate_refuses_options_that_would_drop_each_other(argv, words, tmp_path, capsys):
    from hetserve.planner.plan import Plan

    Plan.from_dict({"model": "llama-2-7b", "cluster": "hexgen2-homo", "replicas": [
        {"id": "c0", "role": "colocated", "stages": [{"devices": ["m0:0"], "layers": [0, 32]}]}]}).save(tmp_path / "p.json")
    code, err = run(["simulate", "--plan", str(tmp_path / "p.json"), "--workload", "azure-conv", "--limit", "5",
                     "--no-progress", *argv], capsys)
    assert code == 2 and len(err) == 1 and all(w in err[0] for w in words), err


def test_simulate_prefill_mode_chunked_is_chunked_prefill(tmp_path, capsys):
    """`simulate --prefill-mode` takes serve's values (and prefill_first); chunked is --chunked-prefill."""
    from hetserve.planner.plan import Plan

    Plan.from_dict({"model": "llama-2-7b", "cluster": "hexgen2-homo", "replicas": [
        {"id": "c0", "role": "colocated", "stages": [{"devices": ["h100-0:0"], "layers": [0, 32]}]}]}).save(tmp_path / "p.json")
    base = ["simulate", "--plan", str(tmp_path / "p.json"), "--workload", "azure-conv", "--limit", "40",
            "--no-progress", "--json"]
    outs = []
    for extra in (["--prefill-mode", "chunked"], ["--chunked-prefill"], ["--chunked-prefill", "--prefill-mode", "chunked"], []):
        assert main(base + extra) == 0
        summary = json.loads(capsys.readouterr().out)
        summary.get("run", {}).pop("wall_s", None)
        outs.append(summary)
    assert outs[0] == outs[1] == outs[2] != outs[3]
    assert main(base + ["--prefill-mode", "chunked", "--chunk-tokens", "64"]) == 0  # serve's chunk size, simulated
    assert json.loads(capsys.readouterr().out) not in outs


def test_simulate_json_with_a_rate_sweep_is_one_document(tmp_path, capsys):
    from hetserve.planner.plan import Plan

    Plan.from_dict({"model": "llama-2-7b", "cluster": "hexgen2-homo", "replicas": [
        {"id": "c0", "role": "colocated", "stages": [{"devices": ["h100-0:0"], "layers": [0, 32]}]}]}).save(tmp_path / "p.json")
    assert main(["simulate", "--plan", str(tmp_path / "p.json"), "--workload", "azure-conv", "--limit", "30",
                 "--no-progress", "--json", "--sweep-rates", "1,3"]) == 0
    doc = json.loads(capsys.readouterr().out)  # nothing but the document on stdout
    assert [r["rate"] for r in doc["rate_sweep"]] == [1.0, 3.0] and "ttft_s" in doc["summary"]


def test_capacity_refuses_a_heartbeat_it_cannot_scale_by(capsys):
    code, err = run(["capacity", "--model", "llama-2-7b", "--gpu", "A100-SXM-80G", "--workload", "azure-conv",
                     "--rate", "2", "--slo-ttft", "1", "--slo-tpot", "0.1", "--heartbeat", "10"], capsys)
    assert code == 2 and len(err) == 1 and "--heartbeat" in err[0] and "two rates" in err[0], err


@pytest.mark.parametrize("kind, name, content, words", FILES, ids=[f"{k}-{i}" for i, (k, *_ ) in enumerate(FILES)])
def test_every_file_kind_reports_one_line(kind, name, content, words, tmp_path, capsys):
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    code, err = run(["describe", kind, str(path)], capsys)
    assert code == 2 and len(err) == 1, err
    assert name in err[0] and all(w in err[0] for w in words), err[0]


def test_serve_checks_the_model_folder_before_starting_workers(tmp_path, capsys):
    from hetserve.planner.plan import Plan

    plan = tmp_path / "plan.json"
    Plan.from_dict({"model": "tiny", "cluster": "demo-cpu", "replicas": [
        {"id": "c0", "role": "colocated", "stages": [{"devices": ["m0:0"], "layers": [0, 2]}]}]}).save(plan)
    code, err = run(["serve", "--plan", str(plan), "--model", str(tmp_path / "nonexistent"), "--port", "0"], capsys)
    assert code == 2 and len(err) == 1 and "nonexistent" in err[0] and "config.json" in err[0]


def test_simulate_says_when_requests_exceed_the_models_context(tmp_path, capsys):
    wl = tmp_path / "w.csv"
    wl.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n0,1000000000000,10\n1,10,10\n")
    model = tmp_path / "tiny-llama"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**CONFIG, "num_hidden_layers": 8}))
    args = ["simulate", "--plan", "examples/plans/demo-tiny-disagg.json", "--model", str(model),
            "--workload", str(wl), "--json", "--no-progress"]
    code, err = run(args + ["--within-context"], capsys)
    assert code == 0 and len(err) == 1 and "dropped 1 of 2 requests" in err[0]  # said, not silent
    code, err = run(args, capsys)
    assert any("1 of 2 requests" in ln and "context" in ln for ln in err), err


def test_runtime_config_names_the_opt_field_that_does_not_fit(tmp_path):
    from hetserve.errors import SpecError
    from hetserve.runtime.model.config import ArchConfig

    with pytest.raises(SpecError, match="num_attention_heads.*hidden_size \\(64\\)"):
        ArchConfig.from_dict({**OPT_CONFIG, "num_attention_heads": 5}, "x/config.json")


def test_capacity_refuses_a_rate_its_simulation_cannot_resolve(capsys):
    code, err = run(["capacity", "--model", "llama-2-7b", "--gpu", "A100-SXM-80G", "--workload", "azure-conv", "--rate", "1e12", "--slo-ttft", "1",
                     "--slo-tpot", "0.1"], capsys)
    assert code == 2 and len(err) == 1, err
    assert "--rate" in err[0] and "1e+12" in err[0] and "--method fluid" in err[0], err[0]


@pytest.mark.parametrize("where", ["a-file", "no-such-dir/sub/out"])
def test_an_output_path_that_cannot_be_written_is_one_line(where, tmp_path, capsys):
    """-o naming an existing file (a folder was wanted) or a place that cannot be created: one line
    naming the path, exit code 2, no traceback."""
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "no-such-dir").write_text("a file, so no folder can be made under it")
    out = str(tmp_path / where)
    code, err = run(["make-model", "--arch", "llama", "--layers", "1", "--hidden", "32", "--heads", "2",
                     "--kv-heads", "1", "--ffn", "64", "-o", out], capsys)
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("hetserve make-model: error: ") and str(tmp_path) in err[0] and "Traceback" not in err[0]


@pytest.mark.parametrize("command", ["calibrate", "plan"])
def test_an_output_file_that_cannot_be_written_is_refused_before_the_work(command, tmp_path, capsys, monkeypatch):
    """calibrate measures for minutes and plan searches: -o under a file (no folder there) is refused
    first, naming --output, and the work never starts."""
    import hetserve.planner.objectives as objectives
    import hetserve.calibration.calibrate as calibrate

    def work(*a, **k):
        raise AssertionError("the work started before the output path was checked")
    monkeypatch.setattr(calibrate, "calibrate", work)
    monkeypatch.setattr(objectives, "plan_for", work)
    (tmp_path / "afile").write_text("x")
    out = str(tmp_path / "afile" / "x.json")
    assert run(["make-model", "--arch", "llama", "--layers", "1", "--hidden", "32", "--heads", "2", "--kv-heads", "1",
                "--ffn", "64", "-o", str(tmp_path / "m")], capsys)[0] == 0
    argv = (["calibrate", "--model", str(tmp_path / "m"), "-o", out] if command == "calibrate" else
            ["plan", "--cluster", "demo-tiny", "--model", "llama-2-7b", "--workload", "azure-conv", "-o", out])
    code, err = run(argv, capsys)
    assert code == 2 and len(err) == 1, err
    assert "--output" in err[0] and out in err[0] and "is not a folder" in err[0], err[0]


@pytest.mark.parametrize("argv", [
    ["calibrate", "--model", "llama-2-7b"],
    ["compare", "--plan", "PLAN", "--cluster", "demo-tiny", "--model", "llama-2-7b", "--workload-class", "LPLD"],
], ids=["calibrate", "compare"])
def test_a_model_that_is_no_checkpoint_folder_is_refused_at_once(argv, tmp_path, capsys, monkeypatch):
    """A preset name (or any path without config.json) where a checkpoint folder is needed: one line
    naming --model, exit code 2, before any worker starts or the Hugging Face hub is asked."""
    plan = {"model": "tiny", "cluster": "demo-tiny", "replicas": [
        {"id": "c0", "role": "colocated", "stages": [{"devices": ["m0:0"], "layers": [0, 2]}]}]}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    argv = [str(tmp_path / "plan.json") if a == "PLAN" else a for a in argv]
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # were the hub asked, this would hang, then trace back
    code, err = run(argv, capsys)
    assert code == 2 and len(err) == 1, err
    assert "--model" in err[0] and "checkpoint folder" in err[0] and "Traceback" not in err[0]


@pytest.mark.parametrize("command,option", [("simulate", "--router"), ("simulate", "--route"),
                                            ("simulate", "--transmission"), ("capacity", "--router")])
def test_simulate_and_capacity_refuse_an_unknown_policy_naming_the_choices(command, option, capsys):
    """A policy name outside its registry is refused by the parser (as ``serve`` and ``compare``
    refuse it): one line with the option, the value and every choice, exit code 2, before any plan,
    model or workload is read."""
    from hetserve.policies.placement import placement_names
    from hetserve.policies.routing import route_names
    from hetserve.policies.transmission import transmission_names

    names = {"--router": placement_names(), "--route": route_names(), "--transmission": transmission_names()}[option]
    required = {"simulate": ["--plan", "p.json", "--workload", "azure-conv"],
                "capacity": ["--gpu", "A100-SXM-80G", "--model", "llama-2-7b", "--workload", "azure-conv",
                             "--rates", "5", "--slo-ttft", "1", "--slo-tpot", "0.1"]}[command]
    code, err = run([command, *required, option, "foo"], capsys)
    assert code == 2 and len(err) == 1 and command in err[0], err
    assert option in err[0] and "'foo'" in err[0] and all(f"'{n}'" in err[0] for n in names), err


@pytest.mark.parametrize("layers, words", [("0-10", "expected a list of two, e.g. [0, 4], got '0-10'"),
                                           ([0, 1, 2], "expected at most 2 items, not 3")])
def test_a_plan_stages_layers_that_are_no_pair_say_what_a_pair_is(layers, words, tmp_path, capsys):
    plan = json.loads((Path(__file__).resolve().parents[2] / "examples/plans/asym-colocated.json").read_text())
    plan["replicas"][0]["stages"][0]["layers"] = layers
    (tmp_path / "p.json").write_text(json.dumps(plan))
    code, err = run(["simulate", "--plan", str(tmp_path / "p.json"), "--model", "llama-2-7b",
                     "--workload", "azure-conv"], capsys)
    assert code == 2 and len(err) == 1, err
    assert "field 'replicas.0.stages.0.layers'" in err[0] and words in err[0], err[0]


@pytest.mark.parametrize("flag, name, words", [
    ("--plot", "conv.txt", "a picture file ending in"),  # matplotlib failed on it after the search
    ("--plot", "conv", "no extension"),  # matplotlib wrote conv.png while the CLI said "wrote conv"
    ("--history", "no-such-dir/h.json", "no folder"),  # refused only after the search
])
def test_plan_refuses_a_plot_or_history_path_it_cannot_write_before_searching(flag, name, words, tmp_path, capsys,
                                                                             monkeypatch):
    import hetserve.planner.objectives as objectives

    def work(*a, **k):
        raise AssertionError("the search started before the output path was checked")
    monkeypatch.setattr(objectives, "plan_for", work)
    out = str(tmp_path / name)
    code, err = run(["plan", "--cluster", "demo-cpu", "--model", "llama-2-7b", flag, out], capsys)
    assert code == 2 and len(err) == 1, err
    assert flag in err[0] and words in err[0], err[0]


@pytest.mark.parametrize("command", ["simulate", "compare"])
def test_an_output_folder_that_is_a_file_is_refused_before_the_work(command, tmp_path, capsys, monkeypatch):
    """simulate / compare -o name a folder: an existing file there was found only after the whole
    simulation (or serving), as "File exists"."""
    import hetserve.calibration.compare as compare_module
    import hetserve.sim as sim

    def work(*a, **k):
        raise AssertionError("the work started before the output folder was checked")
    monkeypatch.setattr(sim, "simulate", work)
    monkeypatch.setattr(compare_module, "compare", work)
    taken = tmp_path / "out.json"
    taken.write_text("x")
    argv = {"simulate": ["simulate", "--plan", "examples/plans/demo-tiny-disagg.json", "--workload", "azure-conv",
                         "-o", str(taken)],
            "compare": ["compare", "--plan", "examples/plans/demo-tiny-disagg.json", "--model", str(tmp_path),
                        "-o", str(taken)]}[command]
    code, err = run(argv, capsys)
    assert code == 2 and len(err) == 1, err
    assert "--output" in err[0] and "a folder to write into" in err[0] and "an existing file" in err[0], err[0]


def test_capacity_takes_a_rate_given_twice_as_one(capsys):
    """`--rates 5,5` fitted the worker law to two equal rates and ended in a ValueError traceback."""
    code = main(["capacity", "--model", "llama-2-7b", "--gpu", "A100-SXM-80G", "--workload", "azure-conv",
                 "--rates", "5,5", "--slo-ttft", "5", "--slo-tpot", "0.1", "--method", "fluid"])
    out = capsys.readouterr().out
    assert code == 0 and "N_w" not in out  # one rate: a row, no law


def test_plan_never_writes_over_a_file_it_reads_or_another_it_writes(tmp_path, capsys):
    cluster = tmp_path / "c.yaml"
    cluster.write_text(CLUSTER.replace("COUNT", "2"))
    code, err = run(["plan", "--cluster", str(cluster), "--model", "llama-2-7b", "-o", str(cluster)], capsys)
    assert code == 2 and len(err) == 1 and "--cluster file" in err[0]
    assert cluster.read_text() == CLUSTER.replace("COUNT", "2")
    out = str(tmp_path / "p.json")
    code, err = run(["plan", "--cluster", str(cluster), "--model", "llama-2-7b", "-o", out, "--history", out], capsys)
    assert code == 2 and len(err) == 1 and "--output file" in err[0]


@pytest.mark.parametrize("argv", [["plan", "--cluster", "hexgen2-homo", "--model", "llama-2-7b", "--efficiency"],
                                  ["cost", "layer", "--gpu", "H200", "--model", "llama-2-7b", "--table"]])
def test_a_json_input_that_is_no_text_is_one_line(argv, tmp_path, capsys):
    path = tmp_path / "x.json"
    path.write_bytes(NOT_UTF8)
    code, err = run([*argv, str(path)], capsys)
    assert code == 2 and len(err) == 1 and "x.json" in err[0] and "utf-8" in err[0], err


def test_cost_layer_prices_only_shards_the_model_can_be_cut_into(capsys):
    code, err = run(["cost", "layer", "--gpu", "H200", "--model", "llama-2-7b", "--tp", "1,3"], capsys)
    assert code == 2 and len(err) == 1 and "TP degree 3 does not divide" in err[0], err


def test_a_subcommands_errors_lead_with_its_whole_name_as_argparse_does(capsys):
    ours = run(["cost", "layer", "--gpu", "NOPE", "--model", "llama-2-7b"], capsys)[1]
    argparse_own = run(["cost", "layer", "--gpu", "H200", "--model", "llama-2-7b", "--tp", "x"], capsys)[1]
    assert ours[0].startswith("hetserve cost layer: error: --gpu") and argparse_own[0].startswith(
        "hetserve cost layer: error: argument --tp"), (ours, argparse_own)
    assert run(["describe", "cluster", "nope"], capsys)[1][0].startswith("hetserve describe: error: nope")


TWO_STAGES = {"model": "llama-2-7b", "cluster": "hexgen2-homo", "replicas": [
    {"id": "c0", "role": "colocated", "stages": [{"devices": ["h100-0:0"], "layers": [0, 16]},
                                                 {"devices": ["h100-0:1"], "layers": [16, 32]}]}]}


@pytest.mark.parametrize("command", ["simulate", "serve"])
def test_micro_batches_past_twice_the_stages_are_refused(command, tmp_path, capsys):
    (tmp_path / "p.json").write_text(json.dumps(TWO_STAGES))
    extra = ["--workload", "azure-conv"] if command == "simulate" else ["--model", str(tmp_path / "none")]
    code, err = run([command, "--plan", str(tmp_path / "p.json"), *extra, "--micro-batches", "5"], capsys)
    assert code == 2 and len(err) == 1 and "--micro-batches" in err[0] and "[1, 4]" in err[0], err


@pytest.mark.parametrize("period", ["1e-9", "1e300"])
def test_plan_refuses_a_period_outside_a_millisecond_to_a_day(period, capsys):
    code, err = run(["plan", "--cluster", "demo-cpu", "--model", "llama-2-7b", "--period", period], capsys)
    assert code == 2 and len(err) == 1 and "--period" in err[0] and "[0.001, 86400]" in err[0], err


@pytest.mark.parametrize("stamp", ["1e300", "4e8"])
def test_a_trace_time_past_ten_years_names_file_line_and_column(stamp, tmp_path, capsys):
    path = tmp_path / "w.csv"
    path.write_text(f"TIMESTAMP,ContextTokens,GeneratedTokens\n0,10,10\n{stamp},10,10\n")
    code, err = run(["describe", "workload", str(path)], capsys)
    assert code == 2 and len(err) == 1 and "w.csv:3: field 'TIMESTAMP'" in err[0] and "ten years" in err[0], err


@pytest.mark.parametrize("content, field", [({"compute": 1e-300}, "'compute'"),
                                            ({"efficiency": {"attention": -0.1}}, "'efficiency.attention'"),
                                            ({"memory": float("nan")}, "'memory'")])
def test_an_efficiency_fraction_out_of_range_names_file_and_field(content, field, tmp_path, capsys):
    (tmp_path / "e.json").write_text(json.dumps(content))
    code, err = run(["plan", "--cluster", "demo-cpu", "--model", "llama-2-7b", "--efficiency",
                     str(tmp_path / "e.json")], capsys)
    assert code == 2 and len(err) == 1 and "e.json" in err[0] and field in err[0] and "1e-18, 1]" in err[0], err


def test_an_options_error_names_the_option_alone():
    """A refused option is not a file with fields: '--x: expected ...', not "--x: field '(option)': ..."."""
    from hetserve.errors import SpecError

    assert str(SpecError("--chunk-tokens", SpecError.OPTION, "a chunked prefill mode", 64)) == \
        "--chunk-tokens: expected a chunked prefill mode, got 64"
    assert str(SpecError("c.yaml", "machines", "a list")) == "c.yaml: field 'machines': expected a list"
