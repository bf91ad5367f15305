"""How much of the prediction error is the served cell's own machine speed? Saved runs replayed at scaled speeds.

    .venv/bin/python -m bench.predict.oracle RUN.json [RUN.json ...] [--factors 0.88,0.92,...] [--jobs 2] [--by-figure]

Each file is a ``bench_predict --json`` run. Every cell is re-simulated by the code of now (``--replay
--refit``) with its slow-down (the speed probe's, ``compare``) multiplied by each factor in turn, and
scored against its own served figures (the 7 metrics of ``predict/run`` within ±15 %). Printed per run: the
figures within ±15 % at factor 1 (what ``--replay`` gives) and with the best factor chosen per cell
after the fact, an *oracle*: the speed each cell's workers ran at, had it been known. The gap
between the two columns is the error a better reading of the machine's speed could remove; what
the oracle still misses is the model's shape (its batching, contention and tails) plus the noise
of one served run's percentiles. No factor here is a prediction: the oracle looks at the answer.
``--by-figure`` splits that remainder per plan, load and metric: a figure whose mean ratio stays off 1
at the oracle's factors is the model's shape (e.g. the asymmetric plan's TTFT). About 5 s a saved run with two jobs; the latest figures are in
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.predict.report import METRICS

DEFAULT_FACTORS = (0.88, 0.92, 0.96, 1.0, 1.04, 1.08, 1.12)


def hits(ratios: dict[str, float]) -> int:
    from hetserve.calibration.compare import in_band

    return sum(in_band(ratios[m]) for m in METRICS)


def replay_scaled(path: str, factor: float) -> list[dict]:
    """``path`` replayed (refitted) with every slow-down times ``factor``: per cell its plan, load
    fraction and the 7 ratios (simulated / served)."""
    from bench.predict.run import read_run, replay_quietly

    data = read_run(path)
    for cell in data["cells"]:
        speed = cell.get("speed") or {"slowdown": 1.0}
        cell["speed"] = {**speed, "slowdown": speed["slowdown"] * factor}
    cells = replay_quietly(data, path, refit=True)
    return [{"plan": c["plan"], "fraction": c["fraction"], "ratios": {m: c["table"][m]["ratio"] for m in METRICS}}
            for c in cells]


def oracle(per_factor: dict[float, list[int]]) -> tuple[int, int, list[float]]:
    """``per_factor``: factor -> figures within ±15 % per cell (1.0 among the factors). Returns the
    figures at factor 1, with each cell's best factor, and those factors (a tie keeps 1, then the
    factor nearest to it: the oracle moves a cell only where that gains a figure)."""
    cells = len(per_factor[1.0])
    chosen = [max(per_factor, key=lambda f: (per_factor[f][i], -abs(f - 1.0))) for i in range(cells)]
    return sum(per_factor[1.0]), sum(per_factor[f][i] for i, f in enumerate(chosen)), chosen


def figure_bias(picked: list[tuple[dict, dict]]) -> list[dict]:
    """Per plan, load and metric over the runs' cells: the geometric mean of simulated / served and
    the figures within ±15 %, as predicted and at each cell's oracle factor. ``picked``: per cell, its
    replay at factor 1 and at the factor the oracle chose. What stays off 1 at the oracle's factor
    is not the cell's machine speed (the oracle has taken that out): the model's shape."""
    from statistics import geometric_mean

    from hetserve.calibration.compare import in_band

    groups: dict[tuple[str, float, str], list[tuple[float, float]]] = {}
    for one, best in picked:
        for m in METRICS:
            groups.setdefault((one["plan"], one["fraction"], m), []).append((one["ratios"][m], best["ratios"][m]))
    return [{"plan": plan, "fraction": fraction, "metric": m, "cells": len(pairs),
             "ratio": geometric_mean([a for a, _ in pairs]), "ratio_oracle": geometric_mean([b for _, b in pairs]),
             "hits": sum(in_band(a) for a, _ in pairs), "hits_oracle": sum(in_band(b) for _, b in pairs)}
            for (plan, fraction, m), pairs in groups.items()]


def print_by_figure(rows: list[dict], console) -> None:
    """``figure_bias``'s rows as a table, by plan, load and ``predict/run``'s order of the metrics."""
    from rich.table import Table

    t = Table(title="per figure: ratio = sim/served (geometric mean over the cells) and the cells within ±15 %, "
                    "as predicted and at each cell's oracle factor (what stays off 1 there is the model's shape)")
    for col in ("plan", "load", "metric"):
        t.add_column(col, no_wrap=True)
    for col in ("cells", "ratio", "±15 %", "oracle", "±15 %"):
        t.add_column(col, justify="right")
    for r in sorted(rows, key=lambda r: (r["plan"], r["fraction"], METRICS.index(r["metric"]))):
        t.add_row(r["plan"], f"{r['fraction']:.0%}", r["metric"].replace("_tokens_per_s", "").replace("_s.", " "),
                  str(r["cells"]), f"{r['ratio']:.2f}", str(r["hits"]), f"{r['ratio_oracle']:.2f}",
                  str(r["hits_oracle"]))
    console.print(t)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="bench_predict --json files")
    ap.add_argument("--factors", default=",".join(map(str, DEFAULT_FACTORS)),
                    help="slow-down multipliers tried per cell (1.0 is always among them)")
    ap.add_argument("--jobs", type=int, default=2, help="replays at once (default 2: this VM's cores)")
    ap.add_argument("--by-figure", action="store_true",
                    help="also print, per plan, load and metric, the mean ratio and hits as predicted and at "
                         "each cell's oracle factor (what stays off is the model's shape, not the speed)")
    args = ap.parse_args()
    factors = sorted({1.0, *(float(f) for f in args.factors.split(","))})

    from bench.lib.console import wide_console
    from rich.progress import Progress
    from rich.table import Table

    console = wide_console()
    jobs = [(run, f) for run in args.runs for f in factors]
    scores: dict[tuple[str, float], list[dict]] = {}
    with Progress(console=console) as bar, ProcessPoolExecutor(args.jobs) as pool:
        task = bar.add_task("replaying", total=len(jobs))
        futures = {pool.submit(replay_scaled, run, f): (run, f) for run, f in jobs}
        for fut, key in futures.items():
            scores[key] = fut.result()
            bar.advance(task)
    t = Table("run", "cells", "figures", "within ±15 % (factor 1)", "oracle: best factor per cell",
              title="saved runs replayed with each cell's slow-down scaled (the oracle looks at the answer)")
    total = at_one = best = 0
    chosen: dict[float, int] = {}
    picked = []
    for run in args.runs:
        one, top, picks = oracle({f: [hits(c["ratios"]) for c in scores[run, f]] for f in factors})
        for i, f in enumerate(picks):
            chosen[f] = chosen.get(f, 0) + 1
            picked.append((scores[run, 1.0][i], scores[run, f][i]))
        n = len(picks)
        t.add_row(Path(run).stem, str(n), str(7 * n), str(one), str(top))
        total, at_one, best = total + 7 * n, at_one + one, best + top
    t.add_row("all", "", str(total), str(at_one), str(best))
    console.print(t)
    console.print("best factor per cell: " + ", ".join(f"x{f:.2f} {chosen.get(f, 0)}" for f in factors))
    if args.by_figure:
        print_by_figure(figure_bias(picked), console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
