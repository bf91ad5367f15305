"""Run the quick variant of every benchmark in turn and print each one's output (`make bench`).

    .venv/bin/python -m bench.run_all [--only planner,sim,aladdin,engine,attention,step,serve,multinode,frontend,overhead,
                                     pipeline-round]

Each benchmark runs as its own subprocess from the repository root, with this interpreter; its
output streams through as it is produced. The quick settings here are for a smoke run of about
5 minutes on 2 cores; the figures in docs/benchmarks.md come from the full commands listed there.
Exits non-zero if any benchmark failed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# name -> argv after the interpreter: each benchmark runs as a module of the `bench` package
BENCHES = {
    "planner": ["-m", "bench.bench_planner", "all", "--quick"],
    "sim": ["-m", "bench.bench_sim"],
    "aladdin": ["-m", "bench.bench_aladdin", "--requests", "1000"],  # 1x vs 10x the Azure rate
    "engine": ["-m", "bench.bench_engine", "--max-tokens", "16"],  # 32 requests, as the target
    "attention": ["-m", "bench.bench_attention", "--reps", "50"],  # a mixed step: one padded grid vs grouped
    "step": ["-m", "bench.bench_step", "--model", "demo", "--dtypes", "float32", "--rounds", "1"],  # host memory, spins
    "serve": ["-m", "bench.bench_serve", "--rates", "0.5", "--window", "6", "--max-output", "16"],
    "multinode": ["-m", "bench.bench_multinode", "--requests", "8", "--max-tokens", "16", "--repeats", "1"],
    "frontend": ["-m", "bench.bench_frontend", "--requests", "24"],  # engine alone vs served over HTTP
    "overhead": ["-m", "bench.bench_overhead", "--runs", "2", "--reps", "2"],  # calibration's request and stream overheads, paired vs not
    "pipeline-round": ["-m", "bench.bench_pipeline_round", "--rounds", "3"],  # two micro-batches vs one, calibrated vs held
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="comma-separated subset of: " + ", ".join(BENCHES))
    args = ap.parse_args()
    names = args.only.split(",") if args.only else list(BENCHES)
    unknown = [n for n in names if n not in BENCHES]
    if unknown:
        ap.error(f"unknown benchmark(s): {', '.join(unknown)}")
    results = []
    for name in names:
        cmd = [sys.executable, *BENCHES[name]]
        print(f"\n=== {name}: {' '.join(['python', *BENCHES[name]])}", flush=True)
        t0 = time.perf_counter()
        rc = subprocess.call(cmd, cwd=ROOT)
        results.append((name, rc, time.perf_counter() - t0))
    print("\n=== summary")
    for name, rc, wall in results:
        print(f"{name:8s} {'ok' if rc == 0 else f'FAILED (exit {rc})':16s} {wall:7.1f} s")
    return 0 if all(rc == 0 for _, rc, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
