"""What a new user met in the CLI: each test names the behaviour it guards."""

import copy
import json

import pytest

from hetserve.cli.main import main

DISAGG = "examples/plans/demo-tiny-disagg.json"  # names model tiny-llama: a checkpoint not here


def _edited(tmp_path, edit) -> str:
    plan = json.load(open(DISAGG))
    plan.pop("estimate", None)
    plan = copy.deepcopy(plan)
    edit(plan)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(plan))
    return str(path)


def _stage(plan, replica, stage):
    return plan["replicas"][replica]["stages"][stage]


@pytest.mark.parametrize("edit, said", [
    (lambda p: _stage(p, 1, 0).update(devices=["m0:0"]), "device m0:0 is used twice"),
    (lambda p: _stage(p, 1, 0).update(devices=["m9:0"]), "'m9:0' is not in cluster demo-tiny"),
    (lambda p: _stage(p, 0, 1).update(layers=[3, 8]), "overlapping the previous stage"),
    (lambda p: _stage(p, 0, 1).update(layers=[4, 6]), "stages end at layer 6"),
])
def test_describe_plan_without_its_model_still_refuses_what_the_cluster_shows(tmp_path, capsys, edit, said):
    """The plan's model is not here: the checks that need only the cluster still run (exit 2)."""
    assert main(["describe", "plan", _edited(tmp_path, edit), "--cluster", "demo-tiny"]) == 2
    assert said in capsys.readouterr().err


def test_describe_plan_without_its_model_says_what_it_left_unchecked(tmp_path, capsys):
    assert main(["describe", "plan", _edited(tmp_path, lambda p: None), "--cluster", "demo-tiny"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "checked without the model" in out and "not checked" in out and "memory" in out and "tiny-llama" in out


def _config(folder) -> dict:
    return json.loads((folder / "config.json").read_text())


def test_make_model_like_a_preset_writes_the_presets_dtype(tmp_path, capsys, monkeypatch):
    """--like llama-2-7b is float16 in its published config.json: the folder says so, and is sized
    so (13 GB, not float32's 27 GB); a tiny model of the defaults stays float32."""
    monkeypatch.setenv("COLUMNS", "1000")
    assert main(["make-model", "--like", "llama-2-7b", "--random-weights", "-o", str(tmp_path / "7b")]) == 0
    assert _config(tmp_path / "7b")["dtype"] == "float16"
    capsys.readouterr()
    assert main(["describe", "model", str(tmp_path / "7b")]) == 0
    out = capsys.readouterr().out
    assert "float16 (config.json dtype)" in out and "13 GB" in out and "27 GB" not in out
    assert main(["make-model", "--like", "qwen2-7b", "--arch", "llama", "--random-weights", "--dtype", "float32",
                 "-o", str(tmp_path / "q")]) == 0  # --dtype overrides the preset's
    assert _config(tmp_path / "q")["dtype"] == "float32"
    assert main(["make-model", "--layers", "2", "--random-weights", "-o", str(tmp_path / "tiny")]) == 0
    assert _config(tmp_path / "tiny").get("dtype") is None  # float32, unnamed, as before


def test_make_model_like_a_preset_with_weights_holds_them_in_its_dtype(tmp_path):
    from hetserve.specs.model import weights_dtype

    assert main(["make-model", "--like", "llama-2-7b", "--layers", "2", "--hidden", "64", "--heads", "4",
                 "--kv-heads", "4", "--ffn", "128", "--vocab", "320", "--max-positions", "256",
                 "-o", str(tmp_path / "small")]) == 0
    assert _config(tmp_path / "small")["dtype"] == "float16"
    assert weights_dtype(tmp_path / "small")[0] == "float16"


def test_plan_objective_cost_reports_the_whole_search_time(tmp_path, capsys):
    """--objective cost runs a search per budget and device subset: "planned in" is all of them,
    not the chosen inner plan's time alone, and says how many ran."""
    import re
    import time

    out_file = tmp_path / "p.json"
    start = time.perf_counter()
    assert main(["plan", "--cluster", "demo-cpu", "--model", "llama-2-7b", "--objective", "cost", "--rate", "3",
                 "--slo-ttft", "5", "--time-limit", "1", "--quiet", "-o", str(out_file)]) == 0
    took = time.perf_counter() - start
    e = json.loads(out_file.read_text())["estimate"]
    whole = e["objective_search"]
    assert whole["inner_plans"] >= len(e["budgets_tried"]) >= 1 and whole["inner_plans"] >= 2
    assert e["search"]["wall_s"] < whole["wall_s"] <= took
    said = " ".join(capsys.readouterr().out.split())
    m = re.search(r"planned in ([\d.]+) s in all \((\d+) inner plans", said)
    assert m and float(m[1]) == pytest.approx(whole["wall_s"], abs=0.06) and int(m[2]) == whole["inner_plans"]


def _no_trace(monkeypatch):
    """Reading the trace fails the test: the refusal must come before it."""
    import hetserve.specs.workload as workload

    def refuse(*a, **k):
        raise AssertionError("the trace was loaded before a cheap argument was checked")
    monkeypatch.setattr(workload, "load_workload", refuse)


@pytest.mark.parametrize("argv, said", [
    (["capacity", "--gpu", "A100", "--model", "llama-2-7b"], "--gpu: field 'gpu': expected one of"),
    (["capacity", "--gpu", "T4", "--model", "llama-2-70b"], "its weights alone take 138 GB, 8 T4 in one box"),
    (["capacity", "--cluster", "demo-cpu", "--model", "llama-2-70b"], "its weights alone take 138 GB"),
])
def test_capacity_refuses_cheap_arguments_before_loading_the_trace(monkeypatch, capsys, argv, said):
    _no_trace(monkeypatch)
    assert main([*argv, "--rate", "1", "--workload", "azure-conv", "--slo-ttft", "1", "--slo-tpot", "0.1"]) == 2
    out, err = capsys.readouterr()
    assert said in err and "note:" not in out


def test_plan_refuses_a_pool_too_small_for_the_weights_before_loading_the_trace(monkeypatch, capsys):
    _no_trace(monkeypatch)
    assert main(["plan", "--cluster", "demo-cpu", "--model", "llama-2-70b", "--quiet"]) == 2
    out, err = capsys.readouterr()
    assert "llama-2-70b needs 138 GB for its weights alone" in err and "note:" not in out


def test_simulate_and_compare_take_the_same_request_count_spelling():
    """-n / --num-requests in both commands, --limit kept in both as the older spelling."""
    from hetserve.cli.main import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command").choices
    for command, dest in (("simulate", "limit"), ("compare", "num_requests")):
        # the three spellings are one option (one dest), listed in --help
        action = next(a for a in sub[command]._actions if "-n" in a.option_strings)
        assert set(action.option_strings) == {"-n", "--num-requests", "--limit"} and action.dest == dest
        assert "--limit" in sub[command].format_help()


def test_the_phase_bar_names_each_phase_on_a_terminal_and_is_silent_off_one():
    import io

    from rich.console import Console

    from hetserve.cli.progress import phase_progress

    for terminal, quiet, shown in ((True, False, True), (True, True, False), (False, False, False)):
        out = io.StringIO()
        with phase_progress(Console(file=out, force_terminal=terminal, width=100), quiet) as report:
            report("round 1 of 7: every probe", 0, 7)
            report("the GIL probe")
        text = out.getvalue()
        assert ("round 1 of 7" in text and "the GIL probe" in text) == shown and (shown or text == "")


class _Stop(Exception):
    pass


def test_calibrate_and_compare_hand_their_phases_to_the_bar(tmp_path, monkeypatch):
    """The long commands pass a progress callback down (calibrate's probe rounds, compare's serve /
    replay / simulate), where the bar shows them."""
    import hetserve.calibration.calibrate as calibration
    import hetserve.calibration.compare as comparison

    told = {}

    def fake_calibrate(model_dir, gpu, **kw):
        told["calibrate"] = kw.get("progress")
        raise _Stop

    def fake_compare(opts):
        told["compare"] = opts.progress
        raise _Stop

    monkeypatch.setattr(calibration, "calibrate", fake_calibrate)
    monkeypatch.setattr(comparison, "compare", fake_compare)
    assert main(["make-model", "--layers", "2", "-o", str(tmp_path / "m")]) == 0
    with pytest.raises(_Stop):
        main(["calibrate", "--model", str(tmp_path / "m")])
    with pytest.raises(_Stop):
        main(["compare", "--plan", DISAGG, "--model", str(tmp_path / "m"), "--cluster", "demo-tiny"])
    assert callable(told["calibrate"]) and callable(told["compare"])
