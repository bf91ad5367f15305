"""Calibration recovers the efficiency factors that generated its measurements (no engine needed)."""

import pytest

from hetserve.cost.analytic import CostModel, Efficiency
from hetserve.cost.layout import ReplicaLayout, StageLayout
from hetserve.runtime.calibrate import _one_device_cluster, fit
from hetserve.runtime.make_model import make_model


def test_fit_recovers_known_efficiency(tmp_path):
    model_dir = tmp_path / "m"
    make_model(model_dir, "llama", layers=4, hidden=128, heads=4, kv_heads=2)
    from hetserve.specs.model import load_model

    spec = load_model(model_dir)
    truth = Efficiency(compute=3e-4, step_overhead_s=0.004)
    cm = CostModel(_one_device_cluster("RTX-4090"), spec, truth)
    lay = ReplicaLayout((StageLayout((0,), (0, spec.num_layers)),))
    ttft = {L: cm.ttft(lay, L) for L in (32, 128, 256, 512)}
    tpot = {b: cm.decode_step_time(lay, b, b * (16 + 12)) for b in (1, 4, 16)}
    cal = fit(str(model_dir), "RTX-4090", ttft, tpot)
    assert cal.efficiency.compute == pytest.approx(3e-4, rel=0.02)
    assert cal.efficiency.step_overhead_s == pytest.approx(0.004, rel=0.02)
    assert cal.mean_abs_error < 0.01
