"""How steady calibration's request overhead is: the paired estimate against the unpaired one (issue 13).

    .venv/bin/python bench/bench_overhead.py [--runs 4] [--gpu RTX-4090] [--reps 5]

``hetserve calibrate`` prices what a served request spends outside the engine before its first
token (HTTP, tokenisation, the stream's set-up) as ``request_overhead_s``. This bench runs the
calibration's measurement (``runtime.calibration_probes.measure``, the TTFT and HTTP probes only:
no pipeline, TP, hand-off, long-decode or speed probes) ``--runs`` times in a row on
``bench_predict``'s tiny Llama and prints both estimates per run:

- *paired* (what calibration uses): per probe request, its TTFT less the span of its own prompt step
  as the coordinator timed it, through HTTP and on the engine; the difference of the medians;
- *unpaired* (the baseline, what calibration used before): the median HTTP TTFT less the median
  engine TTFT of the same prompt length, measured seconds apart, median over the lengths.

The ratio row is the spread (largest − smallest) of each over the runs, paired ÷ unpaired. A
shared machine's speed drifts between probes; the paired estimate should not move with it.
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=4, help="measurements in a row (default 4)")
    ap.add_argument("--gpu", default="RTX-4090", help="the GPU row the worker slots are named after")
    ap.add_argument("--reps", type=int, default=5, help="rounds per measurement (calibrate's default 5)")
    args = ap.parse_args()
    if args.runs < 2:
        ap.error("--runs must be at least 2 (the spread needs two)")

    from rich.console import Console
    from rich.table import Table

    from bench.bench_predict import tiny_model
    from hetserve.runtime.calibrate import request_overhead
    from hetserve.runtime.calibration_probes import measure

    console = Console()
    model_dir = tiny_model(scratch_dir("bench-overhead-"))
    t = Table("run", "unpaired (ms)", "paired (ms)", "HTTP TTFT − its step, median (ms)",
              "engine TTFT − its step, median (ms)", "1-min load", "s",
              title="request overhead per calibration measurement (measured on this machine)")
    unpaired, paired = [], []
    for i in range(args.runs):
        t0 = time.monotonic()
        m = measure(str(model_dir), args.gpu, reps=args.reps, pipeline=False, tp=False, handoff=False,
                    long_decode=False, speed=False)
        unpaired.append(request_overhead(m.http_ttft, m.ttft))
        paired.append(request_overhead(m.http_ttft, m.ttft, (m.http_outside, m.engine_outside)))
        t.add_row(str(i + 1), f"{unpaired[-1] * 1e3:.2f}", f"{paired[-1] * 1e3:.2f}",
                  f"{statistics.median(m.http_outside) * 1e3:.2f}", f"{statistics.median(m.engine_outside) * 1e3:.2f}",
                  f"{os.getloadavg()[0]:.2f}", f"{time.monotonic() - t0:.0f}")
    spread = lambda xs: max(xs) - min(xs)  # noqa: E731
    t.add_row("spread", f"{spread(unpaired) * 1e3:.2f}", f"{spread(paired) * 1e3:.2f}", "", "", "", "")
    console.print(t)
    ratio = spread(paired) / spread(unpaired) if spread(unpaired) > 0 else float("nan")
    console.print(f"spread of the paired estimate ÷ spread of the unpaired one: {ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
