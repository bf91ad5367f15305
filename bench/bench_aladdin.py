"""Aladdin placement under overload: simulation wall time at 1× and 10× the Azure rate.

    .venv/bin/python -m bench.bench_aladdin [--requests 4000] [--scales 1,10] [--workers 8]

Target: ``aladdin`` placement stays linear in requests under overload — the
same requests at 10× the Azure conversation trace's rate (the pool is then far too small, queues
grow without bound) finish in about the wall time of 1×. Baseline measured in the same run: JSQ
on the same pool and trace. Pools (Aladdin's §6 setting): Llama2-13B on 1-GPU A100 workers,
colocated (TTFT 0.6 s, ATGT 30 ms), and split-phase decode workers behind prefill workers with
Aladdin choosing the decode worker. Prints a table; not a timed test.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

from rich.console import Console
from rich.table import Table

from hetserve.capacity.simulated import run_pool
from hetserve.specs.model import load_model
from hetserve.specs.workload import SLO, load_workload

PCIE = {"bandwidth_gbps": 200, "latency_ms": 0.01}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=4000, help="first N requests of the Azure trace")
    ap.add_argument("--scales", default="1,10", help="arrival-rate multipliers")
    ap.add_argument("--workers", type=int, default=8)
    args = ap.parse_args()
    model = load_model("llama-2-13b")
    trace = load_workload("azure-conv").filter_lengths(2048, 2048).head(args.requests)
    slo = SLO(ttft_s=0.6, tpot_s=0.03)
    console = Console(width=150)
    table = Table(title=f"aladdin under overload: azure-conv (first {len(trace):,} requests, "
                        f"{trace.rate:.1f} req/s at 1x), llama-2-13b, {args.workers} x 1-GPU A100 workers",
                  title_justify="left")
    for col in ("pool", "policy", "rate", "req/s", "wall (s)", "us / request", "vs 1x", "vs jsq", "SLO met",
                "overflows"):
        table.add_column(col, justify="right")
    for mode in ("colocated", "decode"):
        first: dict[str, float] = {}
        for k in (float(x) for x in args.scales.split(",")):
            wl = trace.scale_rate(k) if k != 1 else trace
            walls = {}
            for policy in ("jsq", "aladdin"):
                t0 = time.perf_counter()
                res = run_pool(model, "A100-SXM-80G", wl, slo if mode == "colocated" else SLO(None, slo.tpot_s),
                               policy, args.workers, 1, mode, prefill_workers=args.workers if mode == "decode" else 0,
                               intra=PCIE)
                wall = time.perf_counter() - t0
                walls[policy] = wall
                first.setdefault(policy, wall)
                stats = res.info["policy_stats"].get("placement" if mode == "colocated" else "route", {})
                table.add_row(mode, policy, f"{k:g}x", f"{wl.rate:.1f}", f"{wall:.2f}", f"{1e6 * wall / len(wl):.0f}",
                              f"{wall / first[policy]:.2f}", f"{wall / walls['jsq']:.2f}",
                              f"{100 * res.slo_met.mean():.1f}%", str(stats.get("overflow", "")))
    console.print(table)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    console.print(f"python {platform.python_version()} on {platform.machine()}, {os.cpu_count()} CPUs, "
                  f"load average {load:.1f}; 'vs 1x': wall relative to the same policy at 1x; "
                  f"'vs jsq': relative to JSQ at the same rate")


if __name__ == "__main__":
    main()
