"""``hetserve calibrate``: fit the cost model's efficiency factors to the engine on this machine."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("calibrate", help="measure the engine here and fit the cost model's efficiency",
                       description="Run the engine on one device, measure prefill and decode times, and fit "
                                   "the cost model's compute efficiency and per-iteration overhead to them.")
    p.add_argument("--model", required=True, help="checkpoint folder (see `hetserve make-model`)")
    p.add_argument("--gpu", default="RTX-4090", help="GPU type the efficiency is relative to (default RTX-4090)")
    p.add_argument("-o", "--output", help="write the calibration JSON here (for `simulate --efficiency`)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from hetserve.runtime.calibrate import calibrate
    from hetserve.specs.gpus import gpu

    gpu(args.gpu, "--gpu")  # a clear error before any process starts
    cal = calibrate(args.model, args.gpu)
    t = Table("phase", "size", "measured ms", "cost model ms", "error", title=f"calibration against {args.gpu}")
    for p in cal.points:
        t.add_row(p.phase, str(p.size), f"{p.measured_s * 1e3:.2f}", f"{p.predicted_s * 1e3:.2f}", f"{p.error:+.0%}")
    console = Console()
    console.print(t)
    console.print(f"compute efficiency {cal.efficiency.compute:.3g}, overhead {cal.efficiency.step_overhead_s * 1e3:.2f} "
                  f"ms per iteration, mean |error| {cal.mean_abs_error:.0%}")
    if args.output:
        cal.save(args.output)
        console.print(f"wrote {args.output}")
    return 0
