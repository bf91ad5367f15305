"""The simulator's step trace as ``hetserve compare`` reads it (``hetserve.calibration.step_compare``): every prompt
token and every decode token of a burst lands in exactly one traced step, whatever the batching."""

import numpy as np
import pytest

from hetserve.sim import SimOptions
from hetserve.sim.simulator import Simulator
from hetserve.calibration.step_compare import simulated_rows, summarise

from .plans import single
from .test_behaviour import burst


@pytest.mark.parametrize("replicas", [{"p0": ["m0:0"], "d0": ["m1:0"]}, {"c0": ["m0:0"]}])
def test_every_token_of_a_burst_is_in_one_traced_step(cluster, model, replicas):
    wl = burst(12, inp=300, out=20)  # all at t = 0: prompts and decodes are batched
    routes = [("p0", "d0", 1.0)] if "p0" in replicas else None
    sim = Simulator(single(replicas, routes=routes), cluster, model, wl, SimOptions())
    for rep in sim.replicas:
        rep.trace = []
    sim.run()
    rows = simulated_rows(sim.replicas, lambda i: int(wl.input_tokens[i]))
    steps = summarise(rows)
    first = "p0" if "p0" in replicas else "c0"
    last = "d0" if "d0" in replicas else "c0"
    pre, dec = steps[f"{first} prompt"], steps[f"{last} decode"]
    decode_slots = sum(len(r.decode_ids) for r in rows)  # mixed steps carry decodes too
    assert pre["steps"] * pre["prompt_tokens"] == pytest.approx(wl.input_tokens.sum())
    assert pre["steps"] < 12 and dec["decodes"] > 1  # batched: the trace is not one request per step
    assert decode_slots == (np.asarray(wl.output_tokens) - 1).sum()
    assert all(r.finished > r.started for r in rows) and dec["token_ms"] > 0


def test_other_cores_busy_sees_a_busy_neighbour_and_not_the_served_processes():
    """``hetserve compare`` and bench_predict flag served figures measured beside a busy neighbour:
    a process that is not among the served ones and spins for the window shows up as about one
    core; the same spinning counted as served shows up as nothing."""
    import os
    import subprocess
    import sys
    import time
    from pathlib import Path

    from hetserve.calibration.step_compare import cpu_utilisation, machine_busy_cpu_s, other_cores_busy, process_cpu_s

    assert other_cores_busy({}, None, 1.0, 1.0) is None  # a missing reading is "not measured", never 0
    if not Path("/proc/stat").exists():  # off Linux the readings are missing, and say so
        assert machine_busy_cpu_s() is None and process_cpu_s(os.getpid()) is None
        return
    # the spinner says when it spins and spins until its stdin closes: the window is inside its spinning
    # however long a loaded machine takes to start an interpreter
    spinner = ("import sys, threading\nstop = threading.Event()\n"
               "threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()\n"
               "print('spinning', flush=True)\nwhile not stop.is_set(): pass")
    spin = subprocess.Popen([sys.executable, "-c", spinner], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert spin.stdout.readline() == "spinning\n"
        procs = {"me": os.getpid(), "spinner": spin.pid}
        cpu0, m0, t0 = {k: process_cpu_s(p) for k, p in procs.items()}, machine_busy_cpu_s(), time.monotonic()
        time.sleep(1.0)
        wall = time.monotonic() - t0
        cpu1, m1 = {k: process_cpu_s(p) for k, p in procs.items()}, machine_busy_cpu_s()
    finally:
        spin.stdin.close()
        spin.wait(timeout=10)
        spin.stdout.close()
    me = cpu_utilisation({"me": cpu0["me"]}, cpu1, wall)
    both = cpu_utilisation(cpu0, cpu1, wall)
    beside = other_cores_busy(me, m0, m1, wall)  # the spinner is a neighbour
    assert beside is not None and beside > 0.6  # about one core, less the scheduler's slack
    served = other_cores_busy(both, m0, m1, wall)  # the spinner is one of the served processes
    assert served == pytest.approx(max(0.0, beside - both["spinner"]))


def test_decode_steps_split_by_prompt_steps_of_other_replicas_beside_them():
    """A decode step is "alone" when no other replica runs a prompt step during it and "beside
    prompt" when one covers at least half of it; a replica's own prompt steps do not count, and a
    plan whose only prompts are its own replica's gets no split."""
    from hetserve.calibration.step_compare import StepRow, beside_prompts

    p = StepRow("p0", 0.010, 0.050, (), 0.0, (128,))
    d = [StepRow("d0", 0.000, 0.008, (1,), 20.0, ()),  # before the prompt
         StepRow("d0", 0.012, 0.022, (1, 2), 40.0, ()),  # inside it
         StepRow("d0", 0.045, 0.060, (1, 2), 42.0, ()),  # a third of it: neither
         StepRow("d0", 0.070, 0.080, (2,), 30.0, ())]
    rows = [p, *d]
    assert beside_prompts(rows) == {1: 0.0, 2: 1.0, 3: pytest.approx(1 / 3), 4: 0.0}
    steps = summarise(rows)
    assert steps["d0 decode"]["steps"] == 4
    assert steps["d0 decode alone"]["steps"] == 2 and steps["d0 decode alone"]["step_ms"] == pytest.approx(9.0)
    assert steps["d0 decode beside prompt"]["steps"] == 1 and steps["d0 decode beside prompt"]["decodes"] == 2
    assert "p0 prompt" in steps and not any(k.startswith("p0 decode") for k in steps)
    own = [StepRow("c0", 0.0, 0.04, (), 0.0, (64,)), StepRow("c0", 0.01, 0.02, (1,), 9.0, ())]
    assert set(summarise(own)) == {"c0 prompt", "c0 decode"}


def test_simulated_decode_steps_beside_a_prefill_are_slower_only_on_shared_cores(model):
    """On worker slots sharing one core, the simulator's decode steps that run beside the other
    replica's prefill take longer than those alone; on GPUs (no ``cpu_cores``) they do not."""
    from hetserve.specs.cluster import cluster_from_dict
    from hetserve.specs.workload import Workload

    def split(cores):
        m = {"name": "m0", "gpu": "A100-SXM-80G", "count": 2, "site": "s0", **({"cpu_cores": cores} if cores else {})}
        cluster = cluster_from_dict({"name": "test", "machines": [m]})
        wl = Workload.from_lists("spaced", np.arange(12) * 0.25, [2000] * 12, [60] * 12)
        sim = Simulator(single({"p0": ["m0:0"], "d0": ["m0:1"]}, routes=[("p0", "d0", 1.0)]), cluster, model, wl,
                        SimOptions())
        for rep in sim.replicas:
            rep.trace = []
        sim.run()
        steps = summarise(simulated_rows(sim.replicas, lambda i: int(wl.input_tokens[i])))
        return steps["d0 decode alone"], steps["d0 decode beside prompt"]

    alone, beside = split(1)
    assert alone["steps"] > 10 and beside["steps"] > 10
    assert beside["step_ms"] > 1.5 * alone["step_ms"]
    alone, beside = split(None)
    assert beside["step_ms"] == pytest.approx(alone["step_ms"], rel=0.05)


def test_step_rows_survive_a_json_file_untimed_workers_included():
    """bench_predict keeps each cell's served engine steps in its JSON (``rows_to_json``) so that a
    replay can split them again: every field comes back, a worker that was not timed (NaN) as NaN."""
    import json
    import math

    from hetserve.calibration.step_compare import StepRow, rows_from_json, rows_to_json

    rows = [StepRow("d0", 0.5, 0.51, (3, 4), 140.0, (), 0.007, 0.0065),
            StepRow("p0", 0.5, 0.54, (), 0.0, (128, 91)),  # no worker time: NaN
            StepRow("c0", 1.0, 1.02, (7,), 33.0, (12,), 0.015, 0.012)]
    back = rows_from_json(json.loads(json.dumps(rows_to_json(rows))))
    assert len(back) == 3
    for a, b in zip(rows, back):
        for f in ("replica", "started", "finished", "decode_ids", "decode_context", "prompt_tokens"):
            assert getattr(a, f) == getattr(b, f), f
        for f in ("worker_s", "worker_cpu_s"):
            x, y = getattr(a, f), getattr(b, f)
            assert (math.isnan(x) and math.isnan(y)) or x == y, f
    assert back[1].kind == "prompt" and back[0].kind == "decode"


def test_bench_predict_replay_makes_the_step_tables_again_from_the_saved_steps(tmp_path, monkeypatch):
    """``bench_predict --replay`` re-simulates a saved cell and, where the file holds the served
    engine steps, splits them again beside the new simulation's own (not the tables saved with the
    file, which the code of then made), and leaves no temporary folder behind."""
    import importlib.util
    import json
    import tempfile
    from pathlib import Path

    from rich.console import Console

    from hetserve.calibration.step_compare import StepRow, rows_to_json

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("bench_predict", root / "bench" / "predict/run.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    served_rows = [StepRow("c0", 0.0, 0.04, (), 0.0, (128,), 0.035, 0.03),
                   StepRow("c0", 0.04, 0.05, (0,), 129.0, (), 0.007, 0.006),
                   StepRow("c0", 0.05, 0.06, (0,), 130.0, (), 0.007, 0.006)]
    cell = {"plan": "pipeline-2", "rate": 2.0, "fraction": 0.2, "requests": 6, "load_avg_1m": [0.1, 0.1],
            "calibration": "gone.json",
            "calibration_data": {"gpu": "RTX-4090",
                                 "efficiency": {"compute": 2e-4, "memory": 0.8, "iteration_overhead_s": 3e-3},
                                 "runtime": {"request_overhead_s": 0.002}},
            "engine": {}, "kv_pools": {"c0": 16384},
            "served": {"per_request": {"ttft_s": [0.05] * 6, "tpot_s": [0.01] * 6, "e2e_s": [0.3] * 6},
                       "throughput_tokens_per_s": 40.0},
            "steps": None, "speed": None, "served_steps": rows_to_json(served_rows)}
    path = tmp_path / "cells.json"
    path.write_text(json.dumps({"cells": [cell]}))
    scratch = tmp_path / "scratch"  # the replay's temporary folder (a checkpoint of 25 MB) goes with it
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    (out,) = bench.replay_cells(str(path), True, Console(file=open(tmp_path / "log", "w")))
    assert not [p for p in scratch.iterdir() if p.name.startswith("bench-predict-replay-")]
    served, simulated = out["steps"]["served"], out["steps"]["simulated"]
    assert served["c0 prompt"]["steps"] == 1 and served["c0 decode"]["steps"] == 2
    assert served["c0 decode"]["worker_ms"] == pytest.approx(7.0)
    assert served["c0 prompt"]["model_ms"] > 0  # the cost model's time for the served batch
    assert simulated["c0 prompt"]["steps"] == 6  # the six replayed prompts, simulated now
    assert out["table"]["ttft_s.mean"]["served"] == pytest.approx(0.05)
    # each request's arrival and simulated TTFT, for bench/predict/occupancy.py's split
    assert len(out["arrival_s"]) == 6 and out["arrival_s"][0] == 0.0
    assert sum(out["simulated_ttft_s"]) / 6 == pytest.approx(out["table"]["ttft_s.mean"]["simulated"])
    # asked for, the rows themselves (bench/predict/steps.py): the served ones with the cost model's
    # time for each, and the simulated steps the tables were made from
    assert "step_rows" not in out
    (kept,) = bench.replay_quietly(json.loads(path.read_text()), str(path), keep_rows=True)
    rows = kept["step_rows"]
    assert rows["served"] == served_rows and len(rows["model_s"]) == 3 and min(rows["model_s"]) > 0
    assert sum(len(r.prompt_tokens) for r in rows["simulated"]) == 6


def test_predict_steps_splits_decode_steps_by_batch_and_prompt_steps_by_what_ran_beside():
    """``bench/predict/steps.py``: decode-only steps grouped by their sequences (six and more in one
    row), with the served span, worker times, model time and context per sequence averaged; a
    prompt step is *beside* where another step of the replica overlapped it, *with decodes* where
    decodes rode in it, else *alone*."""
    from bench.predict.steps import BATCH_CAP, decode_by_batch, prompt_kinds
    from hetserve.calibration.step_compare import StepRow

    rows = [StepRow("c0", 0.00, 0.05, (), 0.0, (100,), 0.04, 0.03),  # alone
            StepRow("c0", 0.05, 0.07, (0,), 101.0, (), 0.015, 0.012),
            StepRow("c0", 0.06, 0.12, (), 0.0, (50, 30), 0.05, 0.04),  # beside the decode above
            StepRow("c0", 0.12, 0.20, (0,), 102.0, (60,), 0.07, 0.06),  # with a decode
            StepRow("c0", 0.20, 0.23, (0, 1), 200.0, (), 0.02, 0.018),
            StepRow("c0", 0.23, 0.27, tuple(range(BATCH_CAP + 2)), 800.0, (), 0.03, 0.025)]
    model = [0.04, 0.01, 0.05, 0.06, 0.02, 0.03]
    batches = decode_by_batch(rows, model)
    assert [(g["batch"], g["steps"]) for g in batches] == [(1, 1), (2, 1), (BATCH_CAP, 1)]
    assert batches[0]["span_s"] == pytest.approx(0.02) and batches[0]["worker_s"] == pytest.approx(0.015)
    assert batches[1]["model_s"] == pytest.approx(0.02) and batches[1]["context"] == pytest.approx(100.0)
    kinds = prompt_kinds(rows, model)
    assert {k: v["steps"] for k, v in kinds.items()} == {"alone": 1, "beside": 1, "with decodes": 1}
    assert kinds["beside"]["span_s"] == pytest.approx(0.06) and kinds["beside"]["tokens"] == 80
    assert kinds["alone"]["model_s"] == pytest.approx(0.04)
    assert np.isnan(prompt_kinds(rows)["alone"]["model_s"])  # simulated rows: no model column


def test_predict_steps_token_periods_count_the_sequences_of_the_replica_decoding_in_them():
    """``bench/predict/steps.py``: a sequence's token period runs from one of its decode-only steps to
    its next, keyed by the sequences of *its* replica decoding in that time (two micro-batches of a
    pipeline take turns: each period holds both); a step carrying a prompt ends the periods there."""
    from bench.predict.steps import PERIOD_CAP, token_periods
    from hetserve.calibration.step_compare import StepRow

    rows = [StepRow("c0", 0.00, 0.01, (0,), 20.0, ()),  # alone: 0 -> 0.01
            StepRow("c0", 0.01, 0.02, (0,), 21.0, ()),
            StepRow("c0", 0.02, 0.03, (1,), 20.0, ()),  # a second micro-batch: 0 waits 0.01 -> 0.04
            StepRow("c0", 0.04, 0.05, (0,), 22.0, ()),
            StepRow("c0", 0.05, 0.08, (0,), 23.0, (64,)),  # with a prompt: 0's period ends unmeasured
            StepRow("c0", 0.08, 0.09, (0,), 24.0, ()),
            StepRow("d0", 0.03, 0.04, (7,), 20.0, ()),  # another replica: never beside c0's sequences
            StepRow("d0", 0.06, 0.07, (7,), 21.0, ()),
            StepRow("x0", 0.00, 0.01, tuple(range(PERIOD_CAP + 1)), 99.0, ()),
            StepRow("x0", 0.02, 0.03, tuple(range(PERIOD_CAP + 1)), 99.0, ())]
    periods = token_periods(rows)
    assert sorted(periods) == [1, 2, PERIOD_CAP]
    assert periods[1] == pytest.approx([0.01, 0.03])  # c0's first, d0's
    assert periods[2] == pytest.approx([0.03])  # 0.01 -> 0.04 beside sequence 1; none across the prompt
    assert periods[PERIOD_CAP] == pytest.approx([0.02] * (PERIOD_CAP + 1))


def test_bench_predict_counts_the_calibration_points_within_ten_percent_once_per_calibration(tmp_path):
    """Issue 13's calibration target, as bench_predict prints it: every point of each distinct
    calibration its cells used (two cells of one plan share one), a point 11 % off a miss."""
    from bench.predict.report import calibration_fit

    def point(measured, predicted, phase="decode", size=1):
        return {"phase": phase, "size": size, "stages": 1, "tp": 1, "measured_s": measured, "predicted_s": predicted}
    good = {"points": [point(1.0, 1.09), point(2.0, 1.85, "prefill", 128)]}
    bad = {"points": [point(1.0, 1.0), point(1.0, 0.89, "prefill", 32)]}
    cells = [{"calibration": "a.json", "calibration_data": good}, {"calibration": "a.json", "calibration_data": good},
             {"calibration": "b.json", "calibration_data": bad}, {"calibration": "c.json"}]
    within, points, all_within, cals, misses = calibration_fit(cells)
    assert (within, points, all_within, cals) == (3, 4, 1, 2)
    assert misses == ["prefill 32 on 1 stage(s) TP 1 -11.0%"]


def test_predict_oracle_moves_a_cell_only_where_a_factor_gains_a_figure():
    """``bench/predict/oracle.py``'s choice per cell: the most figures within ±15 %; on a tie factor 1,
    then the factor nearest to it."""
    from bench.predict.oracle import oracle

    per_factor = {0.9: [7, 3, 5], 1.0: [6, 5, 5], 1.1: [2, 3, 5], 1.2: [7, 3, 5]}
    at_one, best, chosen = oracle(per_factor)
    assert (at_one, best, chosen) == (16, 17, [0.9, 1.0, 1.0])


def test_predict_oracle_by_figure_keeps_each_cells_ratios_apart_at_one_and_at_its_factor():
    """``--by-figure``: per plan, load and metric, the geometric mean of the ratios and the hits, at
    factor 1 and at the factor the oracle chose for each cell (not another cell's, not factor 1)."""
    from bench.predict.oracle import METRICS, figure_bias

    def cell(plan, fraction, ttft):
        ratios = {m: (ttft if m == "ttft_s.mean" else 1.0) for m in METRICS}
        return {"plan": plan, "fraction": fraction, "ratios": ratios}

    picked = [(cell("a", 0.2, 1.30), cell("a", 0.2, 1.10)), (cell("a", 0.2, 1.20), cell("a", 0.2, 1.21)),
              (cell("b", 0.8, 0.80), cell("b", 0.8, 1.00))]
    rows = {(r["plan"], r["fraction"], r["metric"]): r for r in figure_bias(picked)}
    assert len(rows) == 2 * len(METRICS)
    a = rows["a", 0.2, "ttft_s.mean"]
    assert a["cells"] == 2 and a["hits"] == 0 and a["hits_oracle"] == 1
    assert a["ratio"] == pytest.approx((1.30 * 1.20) ** 0.5)
    assert a["ratio_oracle"] == pytest.approx((1.10 * 1.21) ** 0.5)
    b = rows["b", 0.8, "ttft_s.mean"]
    assert (b["ratio"], b["ratio_oracle"], b["hits"], b["hits_oracle"]) == (pytest.approx(0.8), 1.0, 0, 1)
    assert rows["a", 0.2, "tpot_s.p90"]["hits"] == 2


def test_predict_occupancy_splits_requests_by_what_was_in_flight_at_their_arrival():
    """``bench/predict/occupancy.py``: a request counts the earlier ones whose served E2E had not ended
    when it arrived; each class's served and simulated TTFT means; the shape divides a cell's level
    out (1 in flight over idle, per cell, then their geometric mean)."""
    from bench.predict.occupancy import in_flight_at_arrival, shape, split_cell

    arrival = [0.0, 0.1, 0.15, 1.0, 1.05]
    e2e = [0.2, 0.2, 0.5, 0.1, 0.3]  # 0 ends at 0.2, 1 at 0.3, 2 at 0.65, 3 at 1.1
    assert list(in_flight_at_arrival(np.array(arrival), np.array(e2e))) == [0, 1, 2, 0, 1]
    cell = {"arrival_s": arrival, "simulated_ttft_s": [0.11, 0.24, 0.3, 0.09, 0.2],
            "served": {"per_request": {"ttft_s": [0.1, 0.2, 0.3, 0.1, 0.2], "e2e_s": e2e}}}
    split = split_cell(cell)
    assert split["idle"] == (2, pytest.approx(0.1), pytest.approx(0.1))
    assert split["1 in flight"] == (2, pytest.approx(0.2), pytest.approx(0.22))
    assert split["2+ in flight"] == (1, pytest.approx(0.3), pytest.approx(0.3))
    assert shape([split]) == pytest.approx(1.1)  # 1.1 beside one request, 1.0 idle
    other = {"idle": (3, 0.1, 0.12), "1 in flight": (1, 0.2, 0.24)}  # level 1.2, shape 1.0
    assert shape([split, other]) == pytest.approx(1.1 ** 0.5)
    assert shape([{"idle": (3, 0.1, 0.12)}]) is None


def test_the_step_tables_print_every_figure_whole_on_an_80_column_console():
    """``compare`` is often piped (80 columns): no figure or header is cut to an ellipsis."""
    from rich.console import Console

    from hetserve.calibration.step_compare import print_steps

    served = {"c12 mixed": dict(steps=342, decodes=7.3, prompt_tokens=15340, step_ms=1023.41, worker_ms=1020.1,
                                worker_cpu_ms=1018.2, model_ms=1021.3, token_ms=11.15)}
    simulated = {"c12 mixed": dict(steps=3400, decodes=7.4, prompt_tokens=15340, step_ms=1008.01, token_ms=10.09)}
    console = Console(width=80, record=True)
    print_steps(served, simulated, console)
    text = console.export_text()
    assert "…" not in text
    for figure in ("342", "3400", "15340", "1023.41", "1008.01", "1020.10", "1018.20", "1021.30", "11.15", "10.09"):
        assert figure in text
