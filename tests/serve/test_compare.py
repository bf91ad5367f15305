"""`hetserve compare` end to end: the live server and the simulator on the same requests."""

from __future__ import annotations

import json

import pytest

from hetserve.cost.kernel_pricing import describe_source


@pytest.mark.timeout(240)
def test_compare_serves_simulates_and_writes_table_and_cdfs(tmp_path, capsys, monkeypatch):
    from hetserve.cli.main import main
    from hetserve.runtime.model.make import make_model
    from hetserve.serve import loadgen

    sent, real_replay = [], loadgen.replay

    def counted(url, model, requests, **kw):
        sent.append(len(requests))
        return real_replay(url, model, requests, **kw)

    monkeypatch.setattr(loadgen, "replay", counted)

    model = make_model(tmp_path / "tiny", "llama", layers=2, hidden=64, heads=4, kv_heads=2)
    (tmp_path / "cluster.yaml").write_text("name: cmp\nmachines:\n  - {name: m0, gpu: RTX-4090, count: 2}\n")
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"model": "tiny", "cluster": "cmp", "replicas": [
        {"id": "p0", "role": "prefill", "stages": [{"devices": ["m0:0"], "layers": [0, 2]}]},
        {"id": "d0", "role": "decode", "stages": [{"devices": ["m0:1"], "layers": [0, 2]}]}],
        "kv_routes": [{"from": "p0", "to": "d0", "weight": 1.0}]}))
    out = tmp_path / "out"
    code = main(["compare", "--plan", str(plan), "--model", str(model), "--cluster", str(tmp_path / "cluster.yaml"),
                 "--workload-class", "LPLD", "--rate", "200", "-n", "6", "--max-input", "48", "--max-output", "6",
                 "--kv-admission", "paged", "-o", str(out)])
    assert code == 0
    assert sent == [2, 6]  # a warm-up request per replica, then the timed replay (the steps below are its alone)
    printed = capsys.readouterr().out
    data = json.loads((out / "compare.json").read_text())
    table = data["table"]
    for m in ("ttft_s", "tpot_s", "e2e_s"):
        for s in ("mean", "p50", "p90", "p99"):
            row = table[f"{m}.{s}"]
            assert row["served"] > 0 and row["simulated"] > 0
            assert row["ratio"] == pytest.approx(row["simulated"] / row["served"])
    assert table["throughput_tokens_per_s"]["served"] > 0
    # the simulator ran with the server's KV pools and batching knobs, not its own
    assert set(data["info"]["kv_pools"]) == {"p0", "d0"} and data["info"]["token_budget"] == 2048
    assert data["info"]["kv_admission"] == {"served": "paged", "simulated": "paged"}  # both sides (an ample pool: nothing is pre-empted)
    assert data["info"]["load_avg_1m"] and "uncalibrated" in data["info"]["simulated_source"]
    # uncalibrated times are the kernel model's (an RTX-4090's are transferred from the profiled GPUs)
    assert data["info"]["simulated_source"].endswith("RTX-4090: " + describe_source("transferred"))
    assert data["info"]["other_cores_busy"] >= 0.0  # what the neighbours took from the served side
    assert "other processes on this machine kept" in printed
    assert (out / "compare_cdf.png").stat().st_size > 10_000
    assert "TTFT p99" in printed and "output tokens/s" in printed
    # the engine steps of both sides: the same prompt tokens through p0, and 5 decode tokens per
    # request on d0 (the first comes from the prefill), however each side batched them
    steps = data["info"]["steps"]
    prompts = sum(len_ for len_ in data["info"]["prompt_tokens"])
    for side in ("served", "simulated"):
        pre, dec = steps[side]["p0 prompt"], steps[side]["d0 decode"]
        assert pre["steps"] * pre["prompt_tokens"] == pytest.approx(prompts)
        assert dec["steps"] * dec["decodes"] == pytest.approx(6 * 5)
        assert dec["step_ms"] > 0 and dec["token_ms"] > 0
    assert steps["served"]["d0 decode"]["model_ms"] > 0
    # the workers' own time on each served step (their stage leaders' wall and CPU), inside its span
    for key in ("p0 prompt", "d0 decode"):
        row = steps["served"][key]
        assert 0 < row["worker_cpu_ms"] <= 1.05 * row["worker_ms"] and row["worker_ms"] < row["step_ms"], (key, row)
    assert "worker_ms" not in steps["simulated"]["d0 decode"]
    assert set(data["info"]["cores_busy"]) == {"front end", "m0:0", "m0:1"}
    assert all(0 <= v <= 8 for v in data["info"]["cores_busy"].values())
    assert "engine steps" in printed


@pytest.mark.timeout(240)
def test_compare_scales_the_calibration_by_the_machine_speed_it_reads_while_serving(tmp_path, capsys, monkeypatch):
    """A calibration whose speed probe read a thousand times the speed of now: compare reads the probe
    before and after serving, finds the machine far slower and prices the simulation that much slower
    than as calibrated (both tables kept). The factor dwarfs the machine's own swing between this
    test's reading and compare's a few seconds later (a shared host's speed moves 2.5x within minutes,
    3x with another test on the second core): the bounds below leave 20x either way. ``--serve-twice``:
    the same requests replayed a second time, after the first run's measurements, and that run's
    figures set against the first's."""
    from hetserve.cli.main import main
    from hetserve.runtime.model.make import make_model
    from hetserve.calibration.speed_probe import SpeedProbe
    from hetserve.serve import loadgen

    sent, real_replay = [], loadgen.replay

    def counted(url, model, requests, **kw):
        sent.append([(r.arrival_s, len(r.prompt), r.max_tokens) for r in requests])
        return real_replay(url, model, requests, **kw)

    monkeypatch.setattr(loadgen, "replay", counted)

    model = make_model(tmp_path / "tiny", "llama", layers=2, hidden=64, heads=4, kv_heads=2)
    (tmp_path / "cluster.yaml").write_text("name: cmp\nmachines:\n  - {name: m0, gpu: RTX-4090, count: 1}\n")
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"model": "tiny", "cluster": "cmp", "replicas": [
        {"id": "c0", "role": "colocated", "stages": [{"devices": ["m0:0"], "layers": [0, 2]}]}]}))
    from hetserve.calibration.speed_probe import combine

    now = combine(SpeedProbe(model).readings(3, 0.5))  # the median of three, as compare takes ten
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"gpu": "RTX-4090", "efficiency": {"compute": 2e-4, "memory": 0.8, "iteration_overhead_s": 3e-3},
                               "runtime": {"request_overhead_s": 0.002},
                               "speed_probe": {"decode_s": now.decode_s / 1000, "prefill_s": now.prefill_s / 1000}}))
    out = tmp_path / "out"
    code = main(["compare", "--plan", str(plan), "--model", str(model), "--cluster", str(tmp_path / "cluster.yaml"),
                 "--workload-class", "LPLD", "--rate", "20", "-n", "4", "--max-input", "48", "--max-output", "4",
                 "--efficiency", str(cal), "--serve-twice", "-o", str(out)])
    assert code == 0
    assert len(sent) == 3 and len(sent[1]) == 4 and sent[2] == sent[1]  # warm-up, the timed run, the same again
    flat = " ".join(capsys.readouterr().out.split())
    info = json.loads((out / "compare.json").read_text())["info"]
    speed, table = info["speed"], json.loads((out / "compare.json").read_text())["table"]
    assert 50.0 < speed["slowdown"] < 20_000.0  # a thousand times as slow as the file says, give or take the machine's swing
    assert speed["before"]["decode_s"] > 0 and speed["after"]["prefill_s"] > 0 and len(speed["readings"]) == 10
    for key in ("ttft_s.mean", "e2e_s.mean"):
        assert table[key]["simulated"] > 1.2 * speed["table_as_calibrated"][key]["simulated"]
        assert table[key]["served"] == speed["table_as_calibrated"][key]["served"]
    assert "machine speed (speed probe" in flat and f"x{speed['slowdown']:.2f}" in flat
    # the simulated times take the ratio to the power SPEED_WEIGHT, and say so
    from hetserve.calibration.speed_probe import SPEED_WEIGHT

    assert speed["weight"] == SPEED_WEIGHT
    assert speed["applied"] == pytest.approx(speed["slowdown"] ** SPEED_WEIGHT, rel=1e-3)
    assert f"x{speed['applied']:.2f}" in flat and f"x{speed['applied']:.2f}" in info["simulated_source"]
    assert "speed probe before and after serving" in info["simulated_source"]
    again = info["served_again"]
    assert set(again["table"]) == set(table) and len(again["per_request"]["ttft_s"]) == 4
    for key, row in again["table"].items():  # the second run against the first
        assert row["served"] == table[key]["served"]
        assert row["ratio"] == pytest.approx(row["simulated"] / row["served"])
    assert again["table"]["ttft_s.mean"]["simulated"] == pytest.approx(sum(again["per_request"]["ttft_s"]) / 4)
    assert "served twice" in flat and "served again / served" in flat


@pytest.mark.parametrize("again_ratio, words", [(1.0, "bounds how close any prediction of one can be"),
                                                 (0.7, "this machine's speed moved between them")])
def test_served_twice_reads_the_second_run_as_the_counts_say(capsys, again_ratio, words):
    """Where the second served run lies further from the first than the simulation does, the machine
    moved between the runs: the line says so instead of calling the runs' spread a bound."""
    from rich.console import Console

    from hetserve.calibration.compare import Comparison
    from hetserve.calibration.compare_report import print_table

    table = {"ttft_s.mean": {"served": 0.1, "simulated": 0.1, "ratio": 1.0},
             "tpot_s.mean": {"served": 0.01, "simulated": 0.0105, "ratio": 1.05}}
    again = {k: {**v, "ratio": again_ratio} for k, v in table.items()}
    c = Comparison(table, {}, {}, {"load_avg_1m": [1.0, 1.0], "simulated_source": "cost model",
                                   "served_again": {"table": again}})
    print_table(c, Console(width=400))
    out = capsys.readouterr().out
    assert words in out and "simulation in 2" in out


def test_a_figure_no_request_had_is_null_in_compare_json(tmp_path, monkeypatch):
    """One-token outputs only: no TPOT served or simulated. compare.json is JSON (null, not NaN)."""
    import numpy as np

    from hetserve.calibration import compare as cmp

    table = cmp.table_of({"ttft_s": np.array([0.1, 0.2]), "tpot_s": np.array([]), "e2e_s": np.array([0.3, 0.4])},
                         {"ttft_s": np.array([0.1, 0.3]), "tpot_s": np.array([]), "e2e_s": np.array([0.3, 0.5])},
                         100.0, 90.0)
    monkeypatch.setattr(cmp, "plot_cdfs", lambda c, path: path)
    cmp.Comparison(table, {}, {}, {}).save(tmp_path)
    data = json.loads((tmp_path / "compare.json").read_text(), parse_constant=lambda name: pytest.fail(name))
    assert data["table"]["tpot_s.p90"] == {"served": None, "simulated": None, "ratio": None}
    assert data["table"]["ttft_s.mean"]["ratio"] == pytest.approx(0.2 / 0.15)


def test_compare_json_holds_the_per_request_figures_its_table_and_cdfs_are_of(tmp_path, monkeypatch):
    """Every figure of the table can be computed again from compare.json alone, and the CDFs'
    legend says which side was measured and which predicted."""
    import matplotlib.figure
    import numpy as np

    from hetserve.calibration import compare as cmp

    served = {"ttft_s": np.array([0.05, 0.08, 0.3]), "tpot_s": np.array([0.010, 0.012]), "e2e_s": np.array([0.2, 0.3, 0.5])}
    simulated = {"ttft_s": np.array([0.04, 0.09, np.inf]), "tpot_s": np.array([0.011, 0.011]),
                 "e2e_s": np.array([0.25, 0.3, np.inf])}  # the third never finished in the simulation
    table = cmp.table_of(served, simulated, 20.0, 18.0)
    legends = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, path, **kw: legends.append(
        [t.get_text() for t in fig.axes[0].get_legend().get_texts()]))
    cmp.Comparison(table, served, simulated, {"requests": 3, "simulated_source": "cost model"}).save(tmp_path)
    data = json.loads((tmp_path / "compare.json").read_text(), parse_constant=lambda name: pytest.fail(name))
    per = data["per_request"]
    assert per["simulated"]["ttft_s"] == [0.04, 0.09, None]
    again = cmp.table_of(*({k: np.array([np.inf if x is None else x for x in v]) for k, v in per[side].items()}
                           for side in ("served", "simulated")), 20.0, 18.0)
    for key, row in data["table"].items():
        for side in ("served", "simulated", "ratio"):
            assert row[side] == pytest.approx(again[key][side]), (key, side)
    assert data["table"]["ttft_s.p50"]["served"] == pytest.approx(float(np.median(per["served"]["ttft_s"])))
    assert legends == [["served (measured)", "simulated (predicted)"]]
