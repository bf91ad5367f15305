"""How steady calibration's request and stream overheads are: paired estimates against unpaired ones.

    .venv/bin/python -m bench.bench_overhead [--runs 4] [--gpu RTX-4090] [--reps 5] [--batch-sizes 1,4,16]

``hetserve calibrate`` prices what a served request spends outside the engine before its first
token (HTTP, tokenisation, the stream's set-up) as ``request_overhead_s``. This bench runs the
calibration's measurement (``runtime.calibration_probes.measure``, the TTFT and HTTP probes only:
no pipeline, TP, hand-off, long-decode or speed probes) ``--runs`` times in a row on
``predict/run``'s tiny Llama and prints both estimates per run:

- *paired* (what calibration uses): per probe request, its TTFT less the span of its own prompt step
  as the coordinator timed it, through HTTP and on the engine; the difference of the medians;
- *unpaired* (the baseline, what calibration used before): the median HTTP TTFT less the median
  engine TTFT of the same prompt length, measured seconds apart, median over the lengths.

and, in a second table, the stream overheads (``stream_step_overhead_s`` per step +
``stream_overhead_s`` per sequence: the line through HTTP − engine TPOT over the batch sizes,
``runtime.calibrate.stream_overheads``) fitted from

- *paired* (what calibration uses): per batch size, the median over the rounds of that round's
  HTTP TPOT less its engine TPOT (``speed_probe.paired_round_median``);
- *unpaired* (the baseline, what calibration used before): the median HTTP TPOT less the median
  engine TPOT, each median over all rounds.

The ratio rows are the spread (largest − smallest) of each over the runs, paired ÷ unpaired. A
shared machine's speed drifts between probes; the paired estimates should not move with it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.lib.workdir import workdir


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=4, help="measurements in a row (default 4)")
    ap.add_argument("--batch-sizes", default="1,4,16", help="decode probes' batch sizes (calibrate's default 1,4,16)")
    ap.add_argument("--gpu", default="RTX-4090", help="the GPU row the worker slots are named after")
    ap.add_argument("--reps", type=int, default=5, help="rounds per measurement (default 5; calibrate's default is 7)")
    args = ap.parse_args()
    if args.runs < 2:
        ap.error("--runs must be at least 2 (the spread needs two)")
    try:
        batch_sizes = sorted({int(b) for b in args.batch_sizes.split(",")})
    except ValueError:
        ap.error(f"--batch-sizes takes whole numbers separated by commas, not {args.batch_sizes!r}")
    if len(batch_sizes) < 2 or min(batch_sizes) < 1:
        ap.error("--batch-sizes needs two or more sizes of at least 1 (a line through one point has no intercept)")

    from bench.lib.console import wide_console
    from rich.table import Table

    from bench.predict.run import tiny_model
    from hetserve.calibration.overhead_fit import request_overhead, stream_overheads
    from hetserve.calibration.probes import measure
    from hetserve.calibration.speed_probe import round_median

    console = wide_console()
    model_dir = tiny_model(workdir("bench-overhead-"))
    t = Table("run", "unpaired (ms)", "paired (ms)", "HTTP TTFT − its step, median (ms)",
              "engine TTFT − its step, median (ms)", "1-min load", "s",
              title="request overhead per calibration measurement (measured on this machine)")
    unpaired, paired = [], []
    streams = Table("run", *(f"batch {b}: unpaired / paired (ms)" for b in batch_sizes),
              "unpaired line (ms/step + ms/seq)", "paired line (ms/step + ms/seq)",
              title="stream overheads per calibration measurement: HTTP − engine TPOT by batch size, and the line "
                    "through it (measured on this machine)")
    lines: dict[str, list[tuple[float, float]]] = {"unpaired": [], "paired": []}
    for i in range(args.runs):
        t0 = time.monotonic()
        m = measure(str(model_dir), args.gpu, batch_sizes=batch_sizes, reps=args.reps, pipeline=False, tp=False,
                    handoff=False, long_decode=False, speed=False)
        unpaired.append(request_overhead(m.http_ttft, m.ttft))
        paired.append(request_overhead(m.http_ttft, m.ttft, (m.http_outside, m.engine_outside)))
        t.add_row(str(i + 1), f"{unpaired[-1] * 1e3:.2f}", f"{paired[-1] * 1e3:.2f}",
                  f"{statistics.median(m.http_outside) * 1e3:.2f}", f"{statistics.median(m.engine_outside) * 1e3:.2f}",
                  f"{os.getloadavg()[0]:.2f}", f"{time.monotonic() - t0:.0f}")
        # the same rounds both ways (no speed readings here: each median is the plain one)
        diffs = {"unpaired": {b: round_median(m.http_tpot_rounds[b], []) - round_median(m.tpot_rounds[b], [])
                              for b in batch_sizes},
                 "paired": {b: m.http_tpot[b] - m.tpot[b] for b in batch_sizes}}
        for kind, d in diffs.items():
            lines[kind].append(stream_overheads({b: m.tpot[b] + d[b] for b in batch_sizes}, m.tpot))
        streams.add_row(str(i + 1), *(f"{diffs['unpaired'][b] * 1e3:.2f} / {diffs['paired'][b] * 1e3:.2f}" for b in batch_sizes),
                  *(f"{lines[kind][-1][0] * 1e3:.2f} + {lines[kind][-1][1] * 1e3:.3f}" for kind in lines))
    spread = lambda xs: max(xs) - min(xs)  # noqa: E731
    ratio = lambda p, u: spread(p) / spread(u) if spread(u) > 0 else float("nan")  # noqa: E731
    t.add_row("spread", f"{spread(unpaired) * 1e3:.2f}", f"{spread(paired) * 1e3:.2f}", "", "", "", "")
    console.print(t)
    console.print(f"request overhead: spread of the paired estimate ÷ spread of the unpaired one: {ratio(paired, unpaired):.2f}")
    steps = {kind: [a for a, _ in v] for kind, v in lines.items()}
    per_seq = {kind: [b for _, b in v] for kind, v in lines.items()}
    streams.add_row("spread", *([""] * len(batch_sizes)),
              *(f"{spread(steps[k]) * 1e3:.2f} + {spread(per_seq[k]) * 1e3:.3f}" for k in lines))
    console.print(streams)
    console.print(f"stream overhead per step: spread paired ÷ unpaired {ratio(steps['paired'], steps['unpaired']):.2f}; "
                  f"per sequence {ratio(per_seq['paired'], per_seq['unpaired']):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
