"""The live runs kept in ``bench/runs/`` (gzipped ``bench_predict --json`` files) hold what
``bench_predict --replay`` needs to measure their figures again: ``read_run`` opens them, and every
cell carries its calibration's content, its served requests and its served engine steps."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _bench_predict():
    spec = importlib.util.spec_from_file_location("bench_predict", ROOT / "bench" / "predict/run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_kept_run_opens_and_holds_what_a_replay_reads():
    bench = _bench_predict()
    runs = sorted((ROOT / "bench" / "runs").glob("*.json.gz"))
    assert runs, "bench/runs/ holds no run"
    for path in runs:
        data = bench.read_run(str(path))
        assert len(data["cells"]) == 6, path.name  # 3 plans x 2 rates
        for cell in data["cells"]:
            assert cell["plan"] in bench.plans(), path.name
            assert cell["calibration_data"]["points"] and cell["calibration_data"]["efficiency"]
            assert cell["served"] and cell["served_steps"] and cell["table"]


def test_read_run_reads_a_plain_json_file_too(tmp_path):
    bench = _bench_predict()
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"cells": [], "calibration": None}))
    assert bench.read_run(str(path)) == {"cells": [], "calibration": None}
