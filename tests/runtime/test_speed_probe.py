"""The machine's speed probe and what a slow-down does to the calibrated times."""

from __future__ import annotations

import json
import statistics
import time

import pytest

from hetserve.cost.analytic import CostModel
from hetserve.cost.efficiency import Efficiency
from hetserve.cost.layout import ReplicaLayout, StageLayout
from hetserve.calibration.file import load_speed_probe, served_efficiency, served_sim_options, speed_reference
from hetserve.calibration.probe_shapes import one_device_cluster
from hetserve.calibration.speed_probe import SpeedProbe, SpeedReading, combine, paired_round_median, round_median, slowdown
from hetserve.specs.model import load_model

CPU_LIKE = Efficiency(compute=2e-4, memory=3e-3, attention=1e-4, step_overhead_s=1e-3, iteration_overhead_s=4e-3,
                      seq_overhead_s=2e-4, collective_overhead_s=5e-4, collective_s_per_byte=2e-9,
                      multi_row_s_per_byte=5e-11, prompt_step_overhead_s=2e-3)


def test_a_machine_twice_as_slow_doubles_every_priced_time(model_dirs):
    """Every compute term the cost model prices on a calibrated CPU scales with the slow-down (fixed
    costs, compute, attention, weights streamed); a pipeline's hand-on and TP 2's collectives keep
    their links' time (a link is not the cores)."""
    spec = load_model(model_dirs["llama"])
    cluster = one_device_cluster("RTX-4090", 2)
    layouts = [ReplicaLayout((StageLayout((0,), (0, spec.num_layers)),)),
               ReplicaLayout((StageLayout((0,), (0, 1)), StageLayout((1,), (1, spec.num_layers)))),
               ReplicaLayout((StageLayout((0, 1), (0, spec.num_layers)),))]
    now, slow = CostModel(cluster, spec, CPU_LIKE), CostModel(cluster, spec, CPU_LIKE.at_speed(2.0))
    one, *linked = layouts
    assert slow.ttft(one, 96) == pytest.approx(2 * now.ttft(one, 96), rel=1e-9)
    assert slow.decode_step_time(one, 4, 4 * 40) == pytest.approx(2 * now.decode_step_time(one, 4, 4 * 40), rel=1e-9)
    for lay in linked:
        for t_now, t_slow in ((now.ttft(lay, 96), slow.ttft(lay, 96)),
                              (now.decode_step_time(lay, 4, 160), slow.decode_step_time(lay, 4, 160))):
            assert 1.95 * t_now < t_slow <= 2 * t_now * (1 + 1e-9)
    assert slow.ttft(linked[1], 96) < 1.999 * now.ttft(linked[1], 96)  # TP 2's all-reduces of a prompt: link time
    assert CPU_LIKE.at_speed(1.0) == CPU_LIKE
    with pytest.raises(ValueError):
        CPU_LIKE.at_speed(0.0)


def test_served_options_scale_their_times_not_the_contention_ratio(tmp_path):
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"efficiency": {"compute": 2e-4, "iteration_overhead_s": 4e-3},
                               "runtime": {"request_overhead_s": 0.01, "stream_overhead_s": 1e-4,
                                           "kv_handoff_overhead_s": 0.002, "contention_slowdown": 1.3,
                                           "frontend_request_cpu_s": 0.003, "frontend_step_cpu_s": 2e-4,
                                           "frontend_token_cpu_s": 1e-4, "frontend_dispatch_s": 5e-4,
                                           "stream_step_overhead_s": 8e-4},
                               "speed_probe": {"decode_s": 0.006, "prefill_s": 0.03, "samples": 80}}))
    one, slow = served_sim_options(cal), served_sim_options(cal, 1.5)
    assert slow["contention_slowdown"] == one["contention_slowdown"] == 1.3
    for k in one:
        if k != "contention_slowdown":
            assert slow[k] == pytest.approx(1.5 * one[k]) and one[k] > 0, k
    eff, eff_slow = served_efficiency(cal), served_efficiency(cal, 1.5)
    assert eff_slow.seq_overhead_s == pytest.approx(1.5 * eff.seq_overhead_s)  # the stream overhead included
    assert eff_slow.compute == pytest.approx(eff.compute / 1.5)
    assert load_speed_probe(cal) == SpeedReading(0.006, 0.03, 80)
    # a runtime term misspelt or not a number: an error naming it, not a default or a traceback
    from hetserve.errors import SpecError

    content = json.loads(cal.read_text())
    for key, value, expected in (("request_overhead", 0.01, "one of"), ("request_overhead_s", "10 ms", "a number")):
        cal.write_text(json.dumps({**content, "runtime": {key: value}}))
        with pytest.raises(SpecError) as err:
            served_sim_options(cal)
        assert err.value.field == f"runtime.{key}" and expected in err.value.expected


def test_compare_scales_a_cpu_calibration_by_the_probe_and_takes_a_gpu_one_as_calibrated(tmp_path):
    """The probe times the checkpoint on one CPU thread: it indexes a CPU engine's speed. A calibration
    whose engine ran on a GPU (``measured_on.gpus``) gets no correction, and compare says why."""
    probe = {"decode_s": 0.006, "prefill_s": 0.03, "samples": 80}
    files = {}
    for name, measured_on, reading in (("cpu", {"device": "AMD EPYC", "cores": 2}, probe),
                                       ("gpu", {"device": "NVIDIA H200 (CUDA 13.0)", "cores": 16, "gpus": 1}, probe),
                                       ("old", {"device": "AMD EPYC", "cores": 2}, None)):
        files[name] = tmp_path / f"{name}.json"
        files[name].write_text(json.dumps({"efficiency": {"compute": 2e-4}, "measured_on": measured_on,
                                           "speed_probe": reading}))
    assert speed_reference(files["cpu"]) == (SpeedReading(0.006, 0.03, 80), None)
    reading, why = speed_reference(files["gpu"])
    assert reading is None and "GPU" in why
    reading, why = speed_reference(files["cpu"], correction=False)
    assert reading is None and "--no-speed-correction" in why
    assert speed_reference(files["old"]) == (None, None)  # calibrated before the probe existed
    assert speed_reference(None) == (None, None)


def test_the_probes_ratio_carries_to_the_served_times_by_its_weight():
    """``compare`` scales the calibrated times by the probe's ratio to the power ``SPEED_WEIGHT``: the
    part of it that followed the served runs' speed; 1 takes all of it, 0 none; a weight outside
    [0, 1] is refused."""
    from hetserve.calibration.speed_probe import SPEED_WEIGHT, weighted

    assert 0 < SPEED_WEIGHT < 1
    assert weighted(2.0) == pytest.approx(2.0 ** SPEED_WEIGHT) and weighted(0.5) == pytest.approx(0.5 ** SPEED_WEIGHT)
    assert 1.0 < weighted(1.4) < 1.4 and 0.7 < weighted(0.7) < 1.0  # toward 1 from either side
    assert weighted(1.4, 1.0) == 1.4 and weighted(1.4, 0.0) == 1.0
    with pytest.raises(ValueError, match="weight"):
        weighted(1.4, 1.5)


def test_slowdown_is_the_geometric_mean_of_the_two_ratios():
    then = SpeedReading(0.005, 0.030, 10)
    assert slowdown(SpeedReading(0.010, 0.030, 10), then) == pytest.approx(2 ** 0.5)
    assert slowdown(then, then) == 1.0
    assert combine([SpeedReading(0.004, 0.02, 5), SpeedReading(0.006, 0.04, 7), SpeedReading(0.005, 0.03, 1)]) == \
        SpeedReading(0.005, 0.03, 13)


def test_a_calibration_round_on_a_slow_machine_counts_at_the_reference_speed():
    """A probe measured in three rounds, the machine 1.5x slower in one of them (its speed reading
    says so): each sample scaled by its round's reading gives the time at the median reading's
    speed, where the plain median is pulled up by the slow round."""
    normal, slow = SpeedReading(0.005, 0.030, 8), SpeedReading(0.0075, 0.045, 8)
    readings = [normal, slow, normal]
    samples = [(0, 0.010), (1, 0.0151), (2, 0.0102), (1, 0.0149)]  # rounds 0 and 2 normal, round 1 slow
    assert statistics.median(s for _, s in samples) == pytest.approx(0.01255)
    assert round_median(samples, readings) == pytest.approx(statistics.median([0.010, 0.0151 / 1.5, 0.0102, 0.0149 / 1.5]))
    assert round_median(samples, readings) == pytest.approx(0.0100333, rel=1e-4)
    assert round_median(samples, []) == pytest.approx(0.01255)  # no readings: the plain median
    with pytest.raises(ValueError):
        round_median([], readings)


def test_two_probes_are_differenced_round_by_round():
    """The stream overhead is HTTP − engine TPOT. Paired per round, the difference is the median of
    the rounds' own differences (1.0, 2.5, 1.5 ms: 1.5); the difference of the two medians (9.5 − 7.0)
    mixes two rounds and gives 2.5. A round one probe lacks is left out; a slow round's difference
    is scaled to the reference speed as ``round_median`` scales a sample."""
    engine = [(0, 0.0060), (1, 0.0070), (2, 0.0090)]
    http = [(0, 0.0070), (1, 0.0095), (2, 0.0105), (3, 0.0500)]  # round 3: no engine sample
    assert round_median(http[:3], []) - round_median(engine, []) == pytest.approx(0.0025)
    assert paired_round_median(http, engine, []) == pytest.approx(0.0015)
    normal, slow = SpeedReading(0.005, 0.030, 8), SpeedReading(0.010, 0.060, 8)
    # round 1 twice as slow: its 2.5 ms counts as 1.25 at the reference (median reading: normal)
    assert paired_round_median(http, engine, [normal, slow, normal, normal]) == pytest.approx(0.00125)


@pytest.mark.parametrize("arch", ["llama", "opt"])
def test_the_probe_times_the_checkpoint_in_this_process(model_dirs, arch):
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # not one (the test process's own setting): a probe that left one set shows
    try:
        probe = SpeedProbe(model_dirs[arch])
        r = probe.read(0.2)
        assert torch.get_num_threads() == 2  # one thread while it reads, as a worker; restored after
    finally:
        torch.set_num_threads(threads)
    assert r.samples >= 8 and r.samples % 8 == 0 and r.decode_s > 0 and r.prefill_s > 0
    # Which median is which: on a model this small a 128-token prompt and a one-token step both cost
    # the call's overhead, so their order is noise; a prompt made 50 ms dearer tells them apart.
    real, extra = probe.model, 0.05

    def model(input_ids, **kw):
        if input_ids.shape[1] == probe.prompt_tokens:
            time.sleep(extra)
        return real(input_ids, **kw)

    probe.model = model
    r = probe.read(0.0)
    assert r.decode_s < extra <= r.prefill_s
