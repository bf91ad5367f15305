"""A calibration file edited by hand: what ``simulate``/``compare --efficiency`` refuse, naming the
file and the field, before anything is simulated or served."""

from __future__ import annotations

import json

import pytest

from hetserve.calibration.file import served_sim_options, speed_reference
from hetserve.errors import SpecError


def _calibration(tmp_path, runtime=None, speed_probe=None):
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({
        "gpu": "RTX-4090", "efficiency": {"compute": 0.03, "memory": 0.02},
        "runtime": {"request_overhead_s": 0.008, "contention_slowdown": 1.05, **(runtime or {})},
        "speed_probe": {"decode_s": 0.0035, "prefill_s": 0.0064, "samples": 320} if speed_probe is None
        else speed_probe}))
    return path


def test_a_written_calibration_reads_as_it_was_written(tmp_path):
    path = _calibration(tmp_path)
    assert served_sim_options(path)["request_overhead_s"] == 0.008
    assert speed_reference(path)[0].decode_s == 0.0035


@pytest.mark.parametrize("field, value", [
    ("request_overhead_s", -0.5), ("kv_handoff_overhead_s", -0.1), ("stream_overhead_s", -1e-3),
    ("frontend_request_cpu_s", -1), ("request_overhead_s", float("nan")), ("frontend_step_cpu_s", float("inf")),
    ("contention_slowdown", 0), ("contention_slowdown", -2)])
def test_a_runtime_term_out_of_range_is_refused_naming_the_file_and_field(tmp_path, field, value):
    path = _calibration(tmp_path, runtime={field: value})
    with pytest.raises(SpecError) as info:
        served_sim_options(path)
    assert info.value.source == str(path) and info.value.field == f"runtime.{field}"
    assert "finite" in info.value.expected


def test_a_measured_contention_under_one_still_reads_as_no_slow_down(tmp_path):
    assert served_sim_options(_calibration(tmp_path, runtime={"contention_slowdown": 0.97}))["contention_slowdown"] == 1.0


@pytest.mark.parametrize("speed_probe, field", [
    ({"decode_s": 0, "prefill_s": 0.006, "samples": 3}, "speed_probe.decode_s"),
    ({"decode_s": "x", "prefill_s": 0.006, "samples": 3}, "speed_probe.decode_s"),
    ({"decode_s": 0.003, "samples": 3}, "speed_probe.prefill_s"),
    ({"decode_s": 0.003, "prefill_s": -1.0}, "speed_probe.prefill_s"),
    ({"decode_s": 0.003, "prefill_s": 0.006, "samples": 2.5}, "speed_probe.samples"),
    ({"decode_s": 0.003, "prefill_s": 0.006, "sample": 3}, "speed_probe.sample"),
    ([0.003, 0.006], "speed_probe")])
def test_a_broken_speed_probe_is_refused_before_compare_serves(tmp_path, speed_probe, field):
    """``compare`` reads the speed reference before it starts the server and divides by it after
    serving: a zero or a missing time must stop it first, in one line."""
    path = _calibration(tmp_path, speed_probe=speed_probe)
    with pytest.raises(SpecError) as info:
        speed_reference(path)
    assert info.value.source == str(path) and info.value.field == field


def test_a_calibration_names_its_checkpoint_and_compare_does_not_read_another_ones_speed(tmp_path, monkeypatch):
    """The file stamps the calibrated checkpoint's shape (``measured_on.model``). Its speed probe
    timed that checkpoint: on a larger one `compare` read the machine 7.8x slower than at
    calibration and priced every time 4.65x; it is taken as calibrated instead, and warned of."""
    import hetserve.calibration.calibrate as calibrate_mod
    from hetserve.calibration.calibrate import calibrate
    from hetserve.calibration.file import calibration_warnings, foreign_model, model_stamp, timings_source
    from hetserve.calibration.probes import Measurements
    from hetserve.calibration.speed_probe import SpeedReading
    from hetserve.runtime.model.make import make_model
    from hetserve.specs.cluster import load_cluster
    from hetserve.specs.model import load_model

    small = load_model(make_model(tmp_path / "small", "llama", layers=2, hidden=64, heads=4, kv_heads=2))
    big = load_model(make_model(tmp_path / "big", "llama", layers=4, hidden=128, heads=4, kv_heads=2))
    measured = Measurements(ttft={32: 0.007, 128: 0.009}, tpot={1: 0.004, 4: 0.005},
                            speed=[SpeedReading(0.0035, 0.0064, 10)])
    monkeypatch.setattr(calibrate_mod, "measure", lambda *a, **kw: measured)
    cal = calibrate(str(tmp_path / "small"), "RTX-4090", reps=1)
    assert cal.measured_on["model"] == model_stamp(small)
    path = tmp_path / "cal.json"
    cal.save(path)
    assert speed_reference(path, model=small)[0] == SpeedReading(0.0035, 0.0064, 10)
    reading, note = speed_reference(path, model=big)
    assert reading is None and "as calibrated" in note and "small" in note
    assert foreign_model(path, small) is None
    warning = foreign_model(path, big)
    assert str(path) in warning and "small (llama, 2 layers, hidden 64" in warning and "4 layers, hidden 128" in warning
    # compare warns of it beside another GPU type, as plan and simulate warn of that
    pool = load_cluster("demo-cpu")
    assert calibration_warnings(path, pool.devices, big) == [warning]
    assert calibration_warnings(path, pool.devices, small) == []
    assert "checkpoint small" in timings_source(path)


def test_a_calibration_that_names_no_checkpoint_reads_as_before(tmp_path):
    from hetserve.calibration.file import foreign_model
    from hetserve.specs.model import load_model

    path = _calibration(tmp_path)
    assert foreign_model(path, load_model("llama-2-7b")) is None
    assert speed_reference(path, model=load_model("llama-2-7b"))[0] is not None


def test_compare_warns_of_another_gpu_types_calibration_before_it_serves(tmp_path, monkeypatch, capsys):
    """As plan and simulate warn: an H200 calibration would time the plan's RTX-4090 unchanged."""
    import hetserve.calibration.compare as compare_mod
    from hetserve.cli.main import main
    from hetserve.runtime.model.make import make_model

    def served(opts):
        raise SystemExit(7)  # the warnings are out: nothing to serve

    monkeypatch.setattr(compare_mod, "compare", served)
    model = make_model(tmp_path / "tiny", "llama", layers=2, hidden=64, heads=4, kv_heads=2)
    cal = tmp_path / "h200.json"
    cal.write_text(json.dumps({"gpu": "H200", "efficiency": {"compute": 0.3},
                               "measured_on": {"device": "NVIDIA H200", "date": "2026-11-28"}}))
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"model": "tiny", "cluster": "demo-cpu", "replicas": [
        {"id": "c0", "role": "colocated", "stages": [{"devices": ["m0:0"], "layers": [0, 2]}]}]}))
    with pytest.raises(SystemExit):
        main(["compare", "--plan", str(plan), "--model", str(model), "--cluster", "demo-cpu", "--efficiency", str(cal)])
    err = " ".join(capsys.readouterr().err.split())
    assert f"warning: {cal} was calibrated as H200 (measured on NVIDIA H200, 2026-11-28); this pool has RTX-4090" in err


def test_calibrate_will_not_write_over_a_file_of_the_checkpoint(tmp_path, monkeypatch, capsys):
    """`-o CHECKPOINT/config.json` is refused before measuring: minutes later it replaced the
    checkpoint's config with the calibration."""
    import hetserve.calibration.calibrate as calibrate_mod
    from hetserve.cli.main import main
    from hetserve.runtime.model.make import make_model

    monkeypatch.setattr(calibrate_mod, "calibrate", lambda *a, **kw: pytest.fail("measured"))
    model = make_model(tmp_path / "tiny", "llama", layers=2, hidden=64, heads=4, kv_heads=2)
    config = (model / "config.json").read_text()
    assert main(["calibrate", "--model", str(model), "-o", str(model / "config.json")]) == 2
    err = capsys.readouterr().err
    assert "--output" in err and "config.json" in err
    assert (model / "config.json").read_text() == config


def test_a_calibration_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """A write stopped before its rename leaves the earlier calibration as it was, and no part file."""
    import os

    from hetserve.calibration.calibrate import Calibration, CalibrationPoint
    from hetserve.cost.efficiency import Efficiency

    cal = Calibration("RTX-4090", Efficiency(), (CalibrationPoint("prefill", 32, 0.01, 0.011),))
    path = tmp_path / "cal.json"
    cal.save(path)
    before = path.read_text()
    assert json.loads(before)["points"][0]["size"] == 32

    def stopped(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", stopped)
    with pytest.raises(KeyboardInterrupt):
        Calibration("RTX-4090", Efficiency(), (CalibrationPoint("prefill", 64, 0.02, 0.021),)).save(path)
    assert path.read_text() == before and [p.name for p in tmp_path.iterdir()] == ["cal.json"]
