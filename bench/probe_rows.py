"""What a decode step costs per sequence at small batches, and why (issue 13).

    .venv/bin/python bench/probe_rows.py [--rounds 15] [--batches 1,2,3,4,5,6,8,10,12,16]

``hetserve calibrate`` probes decode batches of 1, 4 and 16 sequences; the served batches of the
CPU demo hold 1-5. This probe measures (a) the engine's decode TPOT (one-device plan of the tiny
Llama bench_predict serves, engine only, no HTTP) at every batch size given, in interleaved rounds,
with the calibrated cost model's price beside it when ``--calibration`` names a file, and (b) torch's
``linear`` alone on one thread (as each worker runs it) for matrices of the tiny Llama's shapes and
larger, rows 1-16: the cost of going from one row (a matrix-vector product) to two or more (a
GEMM), per megabyte of weights. ``Efficiency.multi_row_s_per_byte`` prices (b); (a) shows the
curve it bends the cost model's decode step to.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.scratch import scratch_dir  # noqa: E402  (after the path: run as a script)

ROWS = (1, 2, 4, 8, 16)
SHAPES = ((256, 256), (768, 256), (3072, 1024))  # (out, in): the tiny Llama's q/o, gate/up, and a larger one


def linear_us(out_f: int, in_f: int, rows: int, reps: int = 200) -> float:
    """Best of five timings of torch's fp32 ``linear`` (one thread), microseconds per call."""
    import torch

    w, x = torch.randn(out_f, in_f), torch.randn(rows, in_f)
    for _ in range(20):
        torch.nn.functional.linear(x, w)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(reps):
            torch.nn.functional.linear(x, w)
        best = min(best, (time.perf_counter() - t) / reps)
    return best * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--batches", default="1,2,3,4,5,6,8,10,12,16")
    ap.add_argument("--calibration", help="a `hetserve calibrate -o` file: its cost model's price per batch beside")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]

    import numpy as np
    import torch
    from bench.console import wide_console
    from rich.table import Table

    from bench.bench_predict import tiny_model
    from hetserve.cost.analytic import CostModel, load_efficiency
    from hetserve.runtime.calibration_probes import DECODE_PROMPT
    from hetserve.runtime.engine import Engine, EngineConfig
    from hetserve.runtime.probe_shapes import one_device_cluster, one_device_plan, probe_layout
    from hetserve.runtime.sampling import SamplingParams
    from hetserve.specs.model import load_model

    console = wide_console()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each worker (runtime/worker.py)
    t = Table("out x in", "MB", *[f"{r} µs" for r in ROWS], "(2 − 1) µs/MB",
              title="torch fp32 linear on one thread, µs per call by rows (measured)")
    for out_f, in_f in SHAPES:
        us = [linear_us(out_f, in_f, r) for r in ROWS]
        mb = out_f * in_f * 4 / 1e6
        t.add_row(f"{out_f}x{in_f}", f"{mb:.2f}", *[f"{u:.0f}" for u in us], f"{(us[1] - us[0]) / mb:.1f}")
    torch.set_num_threads(threads)
    console.print(t)

    tmp, rng = scratch_dir("probe-rows-"), np.random.default_rng(0)
    model_dir = tiny_model(tmp)
    spec = load_model(model_dir)
    cluster = one_device_cluster("RTX-4090")
    tokens = 24
    eng = Engine.from_plan(one_device_plan(spec, cluster), cluster, model_dir,
                           EngineConfig(max_num_seqs=max(batches), kv_capacity_tokens=4 * max(batches) * 64))
    try:
        eng.generate([[65] * 8], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        tpot: dict[int, list[float]] = {b: [] for b in batches}
        for _ in range(args.rounds):  # rounds over every batch: the load of a shared machine drifts
            for b in batches:
                hs = [eng.submit(rng.integers(32, 127, DECODE_PROMPT).tolist(),
                                 SamplingParams(max_tokens=tokens, ignore_eos=True)) for _ in range(b)]
                for h in hs:
                    h.result(timeout=120)
                tpot[b].append(statistics.median(h.tpot for h in hs))
    finally:
        eng.shutdown()
    cm = CostModel(cluster, spec, load_efficiency(args.calibration)) if args.calibration else None
    t = Table("seqs", "TPOT ms", "min-max ms", "ms per added seq", *(["cost model ms", "error"] if cm else []),
              title=f"engine decode step, one device, tiny Llama ({args.rounds} rounds, measured)")
    prev = None
    for b in batches:
        med = statistics.median(tpot[b]) * 1e3
        extra = "-" if prev is None else f"{(med - prev[1]) / (b - prev[0]):.2f}"
        row = [str(b), f"{med:.2f}", f"{min(tpot[b]) * 1e3:.2f}-{max(tpot[b]) * 1e3:.2f}", extra]
        if cm:
            model = cm.decode_step_time(probe_layout(spec), b, b * (DECODE_PROMPT + tokens / 2)) * 1e3
            row += [f"{model:.2f}", f"{(model - med) / med:+.0%}"]
        t.add_row(*row)
        prev = (b, med)
    console.print(t)
    return 0


if __name__ == "__main__":
    sys.exit(main())
