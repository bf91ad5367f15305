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
    assert "finite number" in info.value.expected


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
