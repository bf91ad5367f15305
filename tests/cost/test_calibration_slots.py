"""A calibration applied to CPU worker slots of several GPU types on one host's cores.

The CPU demo's pool names two GPU types ("RTX-4090" slots in one box, "L4" slots in the other), but
every slot is a process on the same cores. A calibration measures that CPU as fractions of one GPU
type's datasheet peaks (its ``gpu``); the cost model prices every CPU slot at those peaks, so a slot's
GPU type stays a price tag and not a speed. Real GPUs keep their own peaks.
"""

import json

import pytest

from hetserve.cost.analytic import CostModel, PrefillBatch
from hetserve.cost.efficiency import Efficiency, load_efficiency
from hetserve.cost.layout import ReplicaLayout, StageLayout
from hetserve.errors import SpecError
from hetserve.specs.cluster import cluster_from_dict
from hetserve.specs.model import MODEL_PRESETS

MODEL = MODEL_PRESETS["llama-2-7b"]
# the shape of a CPU calibration against the RTX 4090 datasheet: memory-bound decode, host overheads
FITTED = {"compute": 1.6e-4, "memory": 8.3e-3, "step_overhead_s": 0.0016, "iteration_overhead_s": 0.0047}


def demo_like_pool(cpu_cores: int | None):
    """Box m0 of two "RTX-4090" slots, box m1 of two "L4" slots; with ``cpu_cores`` all four share one host."""
    cpu = {"cpu_cores": cpu_cores, "cpu_host": "this-computer"} if cpu_cores else {}
    return cluster_from_dict({"name": "slots", "machines": [
        {"name": "m0", "gpu": "RTX-4090", "count": 2, **cpu},
        {"name": "m1", "gpu": "L4", "count": 2, **cpu}],
        "network": {"intra_site": {"bandwidth_gbps": 10, "latency_ms": 0.2}}})


def calibration_file(tmp_path, gpu: str = "RTX-4090", **efficiency) -> str:
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({"gpu": gpu, "efficiency": {**FITTED, **efficiency}, "mean_abs_error": 0.03}))
    return str(path)


def pipeline(first: int, second: int) -> ReplicaLayout:
    return ReplicaLayout((StageLayout((first,), (0, 16)), StageLayout((second,), (16, 32))))


def times(cm: CostModel, layout: ReplicaLayout) -> tuple[float, float]:
    return cm.prefill_time(layout, PrefillBatch.single(216)), cm.decode_step_time(layout, 1, 250)


def test_a_calibration_names_the_gpu_type_its_fractions_are_of(tmp_path):
    assert load_efficiency(calibration_file(tmp_path)).reference_gpu == "RTX-4090"
    flat = tmp_path / "flat.json"
    flat.write_text(json.dumps(FITTED))
    assert load_efficiency(flat).reference_gpu is None  # a hand-written mapping: each slot's own type


def test_cpu_slots_of_another_gpu_type_run_at_the_calibrated_speed(tmp_path):
    """The demo's decode replica on its two "L4" slots is priced as on its two "RTX-4090" slots: the
    same cores. Priced at the L4's own peaks (300 GB/s against 1,008) its decode step came out 1.66x
    and the planner's decode capacity 0.66x of the same replica on the other box's slots."""
    cm = CostModel(demo_like_pool(cpu_cores=2), MODEL, load_efficiency(calibration_file(tmp_path)))
    on_4090, on_l4, across = times(cm, pipeline(0, 1)), times(cm, pipeline(2, 3)), times(cm, pipeline(2, 1))
    assert on_l4 == pytest.approx(on_4090, rel=1e-12)
    assert across[0] == pytest.approx(on_4090[0], rel=0.01)  # the box crossing's hand-off alone differs
    assert cm._flops == [cm._flops[0]] * 4 and cm._membw == [cm._membw[0]] * 4


def test_a_calibration_against_a_type_the_pool_lacks_prices_its_slots_at_that_type(tmp_path):
    """Slots of one type calibrated against another: the calibration's peaks, not the slots' type's."""
    pool = cluster_from_dict({"name": "l4-slots", "machines": [
        {"name": "m1", "gpu": "L4", "count": 2, "cpu_cores": 2}]})
    as_4090 = cluster_from_dict({"name": "4090-slots", "machines": [
        {"name": "m0", "gpu": "RTX-4090", "count": 2, "cpu_cores": 2}]})
    eff = load_efficiency(calibration_file(tmp_path))
    assert times(CostModel(pool, MODEL, eff), pipeline(0, 1)) == pytest.approx(
        times(CostModel(as_4090, MODEL, eff), pipeline(0, 1)), rel=1e-12)


def test_real_gpus_keep_their_own_peaks_under_a_calibration(tmp_path):
    cm = CostModel(demo_like_pool(cpu_cores=None), MODEL, load_efficiency(calibration_file(tmp_path)))
    on_4090, on_l4 = times(cm, pipeline(0, 1)), times(cm, pipeline(2, 3))
    assert on_l4[1] > 1.5 * on_4090[1]  # decode streams weights: 300 GB/s against 1,008


def test_without_a_reference_each_cpu_slot_keeps_its_own_types_peaks():
    cm = CostModel(demo_like_pool(cpu_cores=2), MODEL, Efficiency(**FITTED))
    assert times(cm, pipeline(2, 3))[1] > 1.5 * times(cm, pipeline(0, 1))[1]


def test_an_unknown_reference_gpu_is_refused_naming_the_field(tmp_path):
    with pytest.raises(SpecError, match="field 'gpu'"):
        load_efficiency(calibration_file(tmp_path, gpu="RTX-9999"))
    flat = tmp_path / "flat.json"
    flat.write_text(json.dumps({**FITTED, "reference_gpu": 4090}))
    with pytest.raises(SpecError, match="field 'reference_gpu'"):
        load_efficiency(flat)
