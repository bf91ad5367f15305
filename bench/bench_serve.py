"""Serving on shaped links: MoLink vs fair vs serial transmission, measured and simulated.

    .venv/bin/python -m bench.bench_serve [--rates 0.1,0.3,0.5,0.7] [--window 15] \
        [--policies serial,fair,molink] [--json out.json]

A three-stage pipeline (one colocated replica, one layer per stage) of a random-weight Llama
(hidden 512, float32: 2 KB of activations per token) on the ``molink-3x4090`` pool, every
stage-to-stage link shaped to the preset's 100 Mbit/s and 30 ms. For each arrival rate, a slice
of the Azure conversation trace (consecutive requests from ``--start``, arrivals rescaled to the
rate, prompts capped at ``--max-input`` and outputs at ``--max-output`` tokens) is replayed through
the official ``openai`` client against the same server, once per transmission policy; TTFT, TPOT
and E2E are measured at the client. Beside each measurement: the simulator's prediction for the
same plan, policy and requests (``pipeline="detailed"``, activations on the links), whose gap to
the measurement is the simulator's fidelity on this machine (its compute times are an RTX 4090's,
the workers here are CPU processes).

Prints markdown tables; ``--json`` saves everything. A few minutes with the defaults.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

PLAN = {"model": "mid", "cluster": "molink-3x4090", "algorithm": "manual", "replicas": [
    {"id": "c0", "role": "colocated", "stages": [{"devices": ["pc0:0"], "layers": [0, 1]},
                                                 {"devices": ["pc1:0"], "layers": [1, 2]},
                                                 {"devices": ["pc2:0"], "layers": [2, 3]}]}]}


def trace_slice(rate: float, window_s: float, start: int, max_input: int, max_output: int):
    """(Workload, [LoadRequest]) of ``max(3, rate * window)`` consecutive Azure requests at mean ``rate``."""
    from hetserve.serve.loadgen import LoadRequest
    from hetserve.specs.workload import Workload, load_workload

    full = load_workload("azure-conv")
    n = max(3, int(round(rate * window_s)))
    arr = full.arrival_s[start:start + n] - full.arrival_s[start]
    span = arr[-1] if arr[-1] > 0 else 1.0
    arr = arr * ((n - 1) / rate) / span  # mean rate over the slice = rate
    inp = np.minimum(full.input_tokens[start:start + n], max_input)
    out = np.minimum(full.output_tokens[start:start + n], max_output)
    rng = np.random.default_rng(start)
    reqs = [LoadRequest(float(a), rng.integers(32, 127, size=int(i)).tolist(), int(o))
            for a, i, o in zip(arr, inp, out)]
    return Workload(f"azure-conv[{start}:{start + n}]@{rate}", arr.astype(float), inp.astype(np.int64),
                    out.astype(np.int64)), reqs


def simulated(plan, cluster, model_dir: str, workload, policy: str) -> dict:
    from hetserve.sim import SimOptions, simulate
    from hetserve.specs.model import load_model

    res = simulate(plan, cluster, load_model(model_dir), workload,
                   SimOptions(placement="jsq", transmission=policy, pipeline="detailed"))
    return res.summary()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="0.1,0.3,0.5,0.7", help="arrival rates, req/s")
    ap.add_argument("--window", type=float, default=15.0, help="seconds of arrivals per rate (>= 3 requests)")
    ap.add_argument("--policies", default="serial,fair,molink")
    ap.add_argument("--start", type=int, default=100, help="first request of the trace slice")
    ap.add_argument("--max-input", type=int, default=700)
    ap.add_argument("--max-output", type=int, default=48)
    ap.add_argument("--micro-batches", type=int, help="steps in flight per pipeline (default: 3 stages = 3)")
    ap.add_argument("--json", help="write all results here")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from hetserve.planner.plan import Plan
    from hetserve.runtime.model.make import make_model
    from hetserve.serve.launch import ServeOptions, start_server
    from hetserve.serve.loadgen import replay, summarize
    from hetserve.specs.cluster import load_cluster

    rates = [float(r) for r in args.rates.split(",")]
    policies = args.policies.split(",")
    plan, cluster = Plan.from_dict(PLAN), load_cluster("molink-3x4090")
    slices = {r: trace_slice(r, args.window, args.start, args.max_input, args.max_output) for r in rates}
    results: dict = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
                     "rates": rates, "policies": policies, "runs": []}
    t_all = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(make_model(Path(tmp) / "mid", "llama", layers=3, hidden=512, heads=8, max_positions=2048))
        for policy in policies:
            opts = ServeOptions(plan=plan, cluster=cluster, model_dir=model_dir, model_name="mid", shape_links=True,
                                transmission=policy, micro_batches=args.micro_batches)
            with start_server(opts) as srv:
                replay(srv.url, "mid", slices[rates[0]][1][:1])  # warm-up: first-use costs out of the figures
                for rate in rates:
                    workload, reqs = slices[rate]
                    t0 = time.time()
                    measured = summarize(replay(srv.url, "mid", reqs))
                    sim = simulated(plan, cluster, model_dir, workload, policy)
                    results["runs"].append({"policy": policy, "rate": rate, "requests": len(reqs),
                                            "measured": measured, "simulated": sim})
                    print(f"{policy:>6} @ {rate:.1f} req/s: {len(reqs)} requests in {time.time() - t0:.1f} s; "
                          f"TTFT {_f(measured['ttft_s']['mean'], '.3f')} s, "
                          f"TPOT {_f(measured['tpot_s']['mean'], '.1f', 1e3)} ms",
                          file=sys.stderr)
    results["wall_s"] = time.time() - t_all
    print_tables(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


def _f(v: float | None, spec: str, scale: float = 1.0) -> str:
    """A summary figure, or "–" where no request had it (the summary's null)."""
    return "–" if v is None else format(v * scale, spec)


def print_tables(results: dict) -> None:
    runs = results["runs"]
    print(f"\nMeasured (client side), {results['machine']}; mean over each slice\n")
    print("| rate (req/s) | requests | policy | TTFT (s) | TPOT (ms) | E2E (s) |")
    print("|---:|---:|---|---:|---:|---:|")
    for r in runs:
        m = r["measured"]
        print(f"| {r['rate']:.1f} | {r['requests']} | {r['policy']} | {_f(m['ttft_s']['mean'], '.3f')} | "
              f"{_f(m['tpot_s']['mean'], '.1f', 1e3)} | {_f(m['e2e_s']['mean'], '.2f')} |")
    print("\nMoLink against the others (negative: MoLink lower)\n")
    print("| rate (req/s) | vs | TTFT | TPOT | E2E |")
    print("|---:|---|---:|---:|---:|")
    by = {(r["policy"], r["rate"]): r["measured"] for r in runs}
    for rate in results["rates"]:
        mo = by.get(("molink", rate))
        for other in ("serial", "fair"):
            o = by.get((other, rate))
            if mo is None or o is None:
                continue
            cells = [f"{(mo[k]['mean'] / o[k]['mean'] - 1) * 100:+.1f}%" if mo[k]['mean'] and o[k]['mean'] else "–"
                     for k in ("ttft_s", "tpot_s", "e2e_s")]
            print(f"| {rate:.1f} | {other} | " + " | ".join(cells) + " |")
    print("\nMeasured vs simulated (same plan, policy and requests)\n")
    print("| rate (req/s) | policy | TTFT meas. (s) | TTFT sim. (s) | TPOT meas. (ms) | TPOT sim. (ms) |")
    print("|---:|---|---:|---:|---:|---:|")
    for r in runs:
        m, s = r["measured"], r["simulated"]
        print(f"| {r['rate']:.1f} | {r['policy']} | {_f(m['ttft_s']['mean'], '.3f')} | {_f(s['ttft_s']['mean'], '.3f')} | "
              f"{_f(m['tpot_s']['mean'], '.1f', 1e3)} | {_f(s['tpot_s']['mean'], '.1f', 1e3)} |")
    print(f"\nwall time {results['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
