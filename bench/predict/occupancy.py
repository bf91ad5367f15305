"""Where a plan's TTFT miss sits: saved runs' requests split by what the served deployment held when each arrived.

    .venv/bin/python -m bench.predict.occupancy RUN.json [RUN.json ...] [--plans asym-colocated,...] [--jobs 2]
        [--refit] [--by-run]

Each file is a ``bench_predict --json`` run, re-simulated by the code of now (``--replay``; ``--refit``:
each calibration fitted again by today's fit). A request is *idle* when no earlier request of its
cell was still in flight on the served side at its arrival (arrival offset + served E2E), else
*1 in flight* or *2+*. Per plan, load and class: the requests, the served TTFT mean, and the
simulated / served TTFT mean (the geometric mean over the runs' cells; ``--by-run``: every cell).

The *idle* ratio is the cell's level (its calibration and machine speed: it moves ±15 % from run to
run); the *1 in flight* ratio over the *idle* one is the model's shape — how much one running
request adds to a new prompt's first token, simulated against served — and holds still from run
to run where the level does not. About 2 s a saved run; the latest figures are in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")

CLASSES = ("idle", "1 in flight", "2+ in flight")


def in_flight_at_arrival(arrival: np.ndarray, e2e: np.ndarray) -> np.ndarray:
    """Per request, the earlier requests still in flight (served: arrival + E2E later) when it arrived."""
    finish = arrival + e2e
    return np.array([int(((arrival[:i] < arrival[i]) & (finish[:i] > arrival[i])).sum()) for i in range(len(arrival))])


def split_cell(cell: dict) -> dict[str, tuple[int, float, float]]:
    """A replayed cell's requests by ``CLASSES``: (requests, served TTFT mean, simulated TTFT mean)."""
    served = cell["served"]["per_request"]
    ttft, sim = np.asarray(served["ttft_s"], float), np.asarray(cell["simulated_ttft_s"], float)
    busy = in_flight_at_arrival(np.asarray(cell["arrival_s"], float), np.asarray(served["e2e_s"], float))
    out = {}
    for name, sel in zip(CLASSES, (busy == 0, busy == 1, busy >= 2)):
        if sel.any():
            out[name] = (int(sel.sum()), float(ttft[sel].mean()), float(sim[sel].mean()))
    return out


def shape(splits: list[dict]) -> float | None:
    """Over cells' ``split_cell``: the geometric mean of each cell's simulated / served TTFT with one
    request in flight over that with none (the cell's level divided out); None without both."""
    from statistics import geometric_mean

    per_cell = [(s["1 in flight"][2] / s["1 in flight"][1]) / (s["idle"][2] / s["idle"][1])
                for s in splits if "idle" in s and "1 in flight" in s]
    return geometric_mean(per_cell) if per_cell else None


def replay_split(path: str, refit: bool) -> list[dict]:
    """``path`` replayed: per cell its plan, load fraction and ``split_cell``."""
    from bench.predict.run import read_run, replay_quietly

    cells = replay_quietly(read_run(path), path, refit=refit)
    return [{"plan": c["plan"], "fraction": c["fraction"], "split": split_cell(c)}
            for c in cells if c.get("served")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="bench_predict --json files (written with per-request served figures)")
    ap.add_argument("--plans", default="", help="comma-separated plan names (default: all)")
    ap.add_argument("--jobs", type=int, default=2, help="replays at once (default 2: this VM's cores)")
    ap.add_argument("--refit", action="store_true", help="fit each calibration again from its saved points")
    ap.add_argument("--by-run", action="store_true", help="also print every cell, not only the means over runs")
    args = ap.parse_args()
    plans = {p for p in args.plans.split(",") if p}

    from statistics import geometric_mean

    from bench.lib.console import wide_console
    from rich.progress import Progress
    from rich.table import Table

    console = wide_console()
    with Progress(console=console, transient=True) as bar, ProcessPoolExecutor(args.jobs) as pool:
        task = bar.add_task("replaying", total=len(args.runs))
        futures = [(run, pool.submit(replay_split, run, args.refit)) for run in args.runs]
        results = []
        for run, fut in futures:
            results.append((run, fut.result()))
            bar.advance(task)
    groups: dict[tuple[str, float], list[tuple[str, dict]]] = {}
    for run, cells in results:
        for c in cells:
            if not plans or c["plan"] in plans:
                groups.setdefault((c["plan"], c["fraction"]), []).append((Path(run).stem, c["split"]))

    t = Table(title="TTFT by what the served deployment held at each arrival: simulated / served, "
                    "the geometric mean over the runs' cells (shape = 1 in flight over idle)")
    for col in ("plan", "load", "cells", *(f"{c}: requests, served ms, sim/served" for c in CLASSES), "shape"):
        t.add_column(col, justify="left" if col in ("plan", "load") else "right")
    for (plan, fraction), cells in sorted(groups.items()):
        row, ratio = [], {}
        for name in CLASSES:
            have = [s[name] for _, s in cells if name in s]
            if not have:
                row.append("-")
                continue
            ratio[name] = geometric_mean([sim / served for _, served, sim in have])
            row.append(f"{sum(n for n, _, _ in have)}, {1e3 * np.mean([s for _, s, _ in have]):.0f}, {ratio[name]:.2f}")
        sh = shape([s for _, s in cells])
        t.add_row(plan, f"{fraction:.0%}", str(len(cells)), *row, "-" if sh is None else f"{sh:.2f}")
        if args.by_run:
            for run, s in cells:
                t.add_row(f"  {run}", "", "", *(f"{s[c][0]}, {1e3 * s[c][1]:.0f}, {s[c][2] / s[c][1]:.2f}"
                                                 if c in s else "-" for c in CLASSES), "")
    console.print(t)
    return 0


if __name__ == "__main__":
    sys.exit(main())
