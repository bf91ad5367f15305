"""Learned performance models (hetserve.cost.fitted): recovery of known laws and fit reports."""

import numpy as np
import pytest

from hetserve.cost.analytic import CostModel
from hetserve.cost.fitted import (
    Measurements, fit_decode, fit_from_cost_model, fit_kv, fit_prefill, read_measurements, write_measurements)
from hetserve.cost.layout import ReplicaLayout, StageLayout
from hetserve.errors import SpecError
from hetserve.specs.cluster import load_cluster
from hetserve.specs.model import load_model

RNG = np.random.default_rng(1)


def noisy(y, rel=1e-4):
    return y * (1 + rel * RNG.standard_normal(len(y)))


def test_prefill_recovers_known_coefficients():
    x = RNG.integers(10, 8000, 300).astype(float)
    m, rep = fit_prefill(x, noisy(2.5e-4 * x + 0.012))
    assert m.k1 == pytest.approx(2.5e-4, rel=1e-3)
    assert m.c1 == pytest.approx(0.012, rel=1e-2)
    assert rep.r2 > 0.9999 and rep.mape < 1e-3
    assert m.max_tokens(0.012 + 2.5e-4 * 1000) == pytest.approx(1000, rel=1e-2)


def test_decode_recovers_known_coefficients():
    b = RNG.integers(1, 128, 400).astype(float)
    ctx = b * RNG.integers(50, 3000, 400)
    t = noisy(3e-7 * ctx + 2e-4 * b + 0.02)
    m, rep = fit_decode(b, ctx, t)
    assert (m.k2, m.c2, m.c3) == (pytest.approx(3e-7, rel=1e-3), pytest.approx(2e-4, rel=1e-2),
                                  pytest.approx(0.02, rel=1e-2))
    assert rep.r2 > 0.9999 and rep.max_rel_error < 1e-3
    # Eq. 4: at the limit the iteration takes exactly the ATGT target
    lim = m.context_limit(10, 0.05)
    assert m.time(10, lim) == pytest.approx(0.05)


def test_kv_recovers_linear_law():
    x = RNG.integers(1, 4096, 100).astype(float)
    m, rep = fit_kv(x, 524288 * x + 4096)
    assert m.h == pytest.approx(524288) and m.j == pytest.approx(4096, rel=1e-6)
    assert rep.r2 == pytest.approx(1.0)


def test_csv_roundtrip(tmp_path):
    meas = Measurements.empty()
    for x in (100, 200, 400, 800):
        meas.prefill_tokens.append(x), meas.prefill_s.append(1e-4 * x + 0.01)
    for b, c in ((1, 100), (4, 800), (16, 5000), (32, 20000), (8, 900)):
        meas.decode_batch.append(b), meas.decode_context.append(c), meas.decode_s.append(1e-7 * c + 1e-4 * b + 0.01)
    p = tmp_path / "m.csv"
    write_measurements(p, meas)
    pm = read_measurements(p).fit(kv_capacity_tokens=1000, kv_bytes_per_token=2.0)
    assert pm.prefill.k1 == pytest.approx(1e-4) and pm.decode.k2 == pytest.approx(1e-7, rel=1e-6)
    assert pm.kv.h == 2.0 and pm.reports["decode"].r2 > 0.999999


def test_csv_errors_name_the_file(tmp_path):
    p = tmp_path / "bad.csv"
    p.write_text("phase,batch_size,num_tokens,value\nwarmup,1,2,3\n")
    with pytest.raises(SpecError, match="bad.csv:2"):
        read_measurements(p)
    p.write_text("a,b\n")
    with pytest.raises(SpecError, match="header"):
        read_measurements(p)


def test_fit_from_analytic_cost_model_is_close():
    cluster, model = load_cluster("aladdin-a100"), load_model("llama-2-13b")
    cost = CostModel(cluster, model)
    layout = ReplicaLayout((StageLayout((0,), (0, model.num_layers)),))
    pm = fit_from_cost_model(cost, layout, seed=3)
    assert pm.reports["prefill"].r2 > 0.99 and pm.reports["prefill"].mape < 0.05
    assert pm.reports["decode"].r2 > 0.9 and pm.reports["decode"].mape < 0.1
    assert pm.kv.h == pytest.approx(model.kv_bytes_per_token)
    assert pm.kv_capacity_tokens == pytest.approx(cost.kv_capacity_tokens(layout))
    assert pm.decode.k2 > 0 and pm.prefill.k1 > 0
