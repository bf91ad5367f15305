"""What a second pipeline stage adds to a prompt, by its length, and how far one sample strays (issue 13).

    .venv/bin/python bench/probe_stage_prompt.py [--rounds 20] [--lengths 1,32,128,256,512] [--calibration cal.json]

``hetserve calibrate`` takes one two-stage prompt (128 tokens) beside the one-device prompts to tell
the per-stage fixed cost from the per-iteration one; in the bench's calibrations it was the point
fitted worst (twenty-fifth session, docs/benchmarks.md). This probe serves the tiny Llama
``bench_predict`` serves on one device and on two stages of one device each (engine only, no HTTP),
and times single prompts of every length on both, interleaved round by round (the load of a shared
machine drifts): the median TTFT of each, the two-stage extra, and the interquartile range of each
— how far apart samples of one probe lie. With ``--calibration`` the calibrated cost model's price of
each beside it.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.scratch import scratch_dir  # noqa: E402  (after the path: run as a script)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--lengths", default="1,32,128,256,512", help="prompt lengths, comma-separated")
    ap.add_argument("--calibration", help="a `hetserve calibrate -o` file: its cost model's price beside")
    args = ap.parse_args()
    try:
        lengths = sorted({int(x) for x in args.lengths.split(",")})
    except ValueError:
        ap.error(f"--lengths takes whole numbers separated by commas, not {args.lengths!r}")
    if min(lengths) < 1 or args.rounds < 1:
        ap.error("--lengths must be at least 1 and --rounds at least 1")

    import numpy as np
    from bench.console import wide_console
    from rich.progress import track
    from rich.table import Table

    from bench.bench_predict import tiny_model
    from hetserve.cost.analytic import CostModel, load_efficiency
    from hetserve.runtime.engine import Engine, EngineConfig
    from hetserve.runtime.probe_shapes import one_device_cluster, one_device_plan, probe_layout
    from hetserve.runtime.sampling import SamplingParams
    from hetserve.specs.model import load_model

    tmp, rng = scratch_dir("probe-stage-prompt-"), np.random.default_rng(0)
    model_dir = tiny_model(tmp)
    spec = load_model(model_dir)
    if max(lengths) + 1 >= spec.max_context:
        ap.error(f"--lengths: the bench's model holds {spec.max_context} tokens")
    cluster = one_device_cluster("RTX-4090", 2)
    config = EngineConfig(max_num_seqs=1, kv_capacity_tokens=4 * max(lengths) + 64)
    engines = {stages: Engine.from_plan(one_device_plan(spec, cluster, stages), cluster, model_dir, config)
               for stages in (1, 2)}
    ttft: dict[tuple[int, int], list[float]] = {(s, L): [] for s in engines for L in lengths}
    try:
        for eng in engines.values():
            eng.generate([[65] * 8], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
        for _ in track(range(args.rounds), description="rounds"):
            for L in lengths:
                for stages, eng in engines.items():
                    h = eng.submit(rng.integers(32, 127, L).tolist(), SamplingParams(max_tokens=1, ignore_eos=True))
                    h.result(timeout=120)
                    ttft[stages, L].append(h.ttft)
    finally:
        for eng in engines.values():
            eng.shutdown()
    cm = CostModel(cluster, spec, load_efficiency(args.calibration)) if args.calibration else None
    cols = ["tokens", "1 stage ms", "2 stages ms", "extra ms", "2 / 1", "IQR 1 stage", "IQR 2 stages"] + (
        ["model 1 / 2 ms"] if cm else [])
    t = Table(*cols, title=f"TTFT on the engine, tiny Llama, median of {args.rounds} interleaved rounds (measured)")
    for L in lengths:
        one, two = (np.median(ttft[s, L]) * 1e3 for s in (1, 2))
        iqr = [np.percentile(ttft[s, L], [25, 75]) * 1e3 for s in (1, 2)]
        row = [str(L), f"{one:.1f}", f"{two:.1f}", f"{two - one:+.1f}", f"{two / one:.2f}",
               *(f"{a:.0f}-{b:.0f}" for a, b in iqr)]
        if cm:
            row.append(f"{cm.ttft(probe_layout(spec), L) * 1e3:.0f} / {cm.ttft(probe_layout(spec, 2), L) * 1e3:.0f}")
        t.add_row(*row)
    wide_console().print(t)
    return 0


if __name__ == "__main__":
    sys.exit(main())
