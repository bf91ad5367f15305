"""Experiment 2: MoLink Tables 2, 3 and 5 — serial vs fair vs MoLink transmission on a slow pipeline.

    python experiments/molink_tables.py [--minutes 30] [--tables 2,3,5]

Setting (MoLink §5): Qwen-7B in three pipeline stages on three RTX 4090 servers (the
``molink-3x4090`` preset: every pair 100 Mbps / 30 ms), the Azure conversation trace without
requests over 2048 input or 1024 output tokens, rescaled to each arrival rate, 1 minute of warm-up
then ``--minutes`` measured (requests arriving in the warm-up are left out of the means).

Baselines as the paper names them: "vLLM" = fair-share concurrent sends (``fair``), "Helix" =
one ordered queue (``serial``), "MoLink" = ``molink`` transmission (decode first, anti-starvation
weight N = 30, just-in-time chunks) plus the micro-batch count chosen in N..2N by
``choose_micro_batches`` for the batch Little's law gives (rate × mean E2E of the fair run).
Every run uses the simulator's detailed pipeline (one event per stage per micro-batch, activations
on the shared links).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

import numpy as np

from hetserve.cost.analytic import CostModel
from hetserve.planner.plan import Plan, PlanReplica, PlanStage
from hetserve.policies.transmission import choose_micro_batches
from hetserve.sim.simulator import SimOptions, simulate
from hetserve.specs.cluster import cluster_from_dict, load_cluster
from hetserve.specs.model import load_model
from hetserve.specs.workload import load_workload

MODEL = "qwen-7b"
STAGES = ((0, 11), (11, 22), (22, 32))
WARMUP_S = 60.0

# MoLink's numbers: (TTFT s, TPOT s, E2E s) for vLLM, Helix, MoLink.
PAPER_T2 = {  # by rate, 100 Mbps, 30 ms
    0.1: ((3.39, 0.28, 74), (3.27, 0.29, 75), (3.23, 0.26, 69)),
    0.2: ((3.74, 0.50, 111), (3.42, 0.47, 106), (3.30, 0.41, 93)),
    0.3: ((6.20, 1.69, 306), (5.66, 1.65, 299), (5.23, 1.30, 256)),
    0.7: ((17.3, 3.49, 509), (14.2, 3.42, 497), (9.29, 3.01, 449)),
}
PAPER_T3 = {  # by bandwidth (Mbps), 0.3 req/s, 30 ms
    60: ((8.07, 1.24, 229), (7.34, 1.21, 223), (7.32, 1.07, 213)),
    100: ((3.74, 0.50, 111), (3.42, 0.47, 106), (3.30, 0.41, 93)),
    200: ((2.02, 0.29, 68), (1.86, 0.28, 64), (1.83, 0.25, 58)),
    400: ((1.45, 0.25, 56), (1.35, 0.23, 53), (1.26, 0.21, 47)),
}
PAPER_T5 = {  # ablation, 0.3 req/s, 100 Mbps, 30 ms: (TTFT, TPOT, latency)
    "all optimisations": (3.30, 0.41, 93.07),
    "chunk transmission only": (3.37, 0.44, 99.25),
    "micro-batch extending only": (3.60, 0.43, 97.23),
    "no optimisations": (3.56, 0.48, 107.45),
}


@dataclass
class Row:
    ttft: float
    tpot: float
    e2e: float
    micro_batches: int
    wall_s: float


def make_cluster(bandwidth_mbps: float, latency_ms: float = 30.0):
    if bandwidth_mbps == 100 and latency_ms == 30:
        return load_cluster("molink-3x4090")
    return cluster_from_dict({
        "name": f"molink-3x4090-{bandwidth_mbps:g}mbps",
        "machines": [{"name": f"pc{i}", "gpu": "RTX-4090", "count": 1, "site": f"home-{'abc'[i]}"} for i in range(3)],
        "network": {"inter_site": {"bandwidth_gbps": bandwidth_mbps / 1000.0, "latency_ms": latency_ms}}},
        f"<molink {bandwidth_mbps} Mbps>")


def make_plan(cluster, model) -> Plan:
    stages = tuple(PlanStage((f"pc{i}:0",), s) for i, s in enumerate(STAGES))
    return Plan(model.name, cluster.name, "molink-pp3", (PlanReplica("r0", "colocated", stages),))


def extended_micro_batches(cluster, model, plan, batch: int, avg_context: float) -> int:
    """MoLink §4.3: the micro-batch count in N..2N with the best emulated decode throughput."""
    cost = CostModel(cluster, model)
    layout = plan.replicas[0].layout(cluster)
    n = len(layout.stages)
    fns = [lambda b, s=s, last=(i == n - 1): cost.stage_decode_time(s, b, b * avg_context, last)
           for i, s in enumerate(layout.stages)]
    lat, bw = [], []
    for i, s in enumerate(layout.stages):
        nxt = layout.stages[(i + 1) % n]
        la, b = cluster.link(s.devices[0], nxt.devices[0])
        lat.append(la), bw.append(b)
    return choose_micro_batches(max(batch, n), fns, lat, bw, model.hidden * model.dtype_bytes, 4).micro_batches


def run(cluster, model, wl, transmission: str, micro_batches: int) -> Row:
    plan = make_plan(cluster, model)
    t0 = time.perf_counter()
    res = simulate(plan, cluster, model, wl, SimOptions(transmission=transmission, pipeline="detailed",
                                                        micro_batches=micro_batches))
    keep = res.arrival >= WARMUP_S
    return Row(float(np.mean(res.ttft[keep])), float(np.mean(res.tpot[keep])), float(np.mean(res.e2e[keep])),
               micro_batches, time.perf_counter() - t0)


def workload(rate: float, minutes: float):
    base = load_workload("azure-conv").filter_lengths(max_input=2048, max_output=1024)
    return base.with_rate(rate).window(0.0, WARMUP_S + 60.0 * minutes)


def three_way(cluster, model, wl, rate: float) -> tuple[Row, Row, Row]:
    fair = run(cluster, model, wl, "fair", 3)
    serial = run(cluster, model, wl, "serial", 3)
    batch = int(round(rate * fair.e2e))
    avg_ctx = float(wl.mean_input + wl.mean_output / 2)
    mb = extended_micro_batches(cluster, model, make_plan(cluster, model), batch, avg_ctx)
    molink = run(cluster, model, wl, "molink", mb)
    return fair, serial, molink


def pct(x: float, ref: float) -> str:
    return f"{100 * x / ref:.0f}%" if ref > 0 else "-"


def table_three_way(title: str, key_name: str, rows: dict, paper: dict) -> str:
    out = [f"### {title}", "",
           f"| {key_name} | metric | vLLM (fair) | Helix (serial) | MoLink | paper vLLM | paper Helix | paper MoLink |",
           "|---|---|---|---|---|---|---|---|"]
    for key, (fair, serial, molink) in rows.items():
        pv, ph, pm = paper.get(key, ((None,) * 3,) * 3)
        for j, (name, fmt) in enumerate((("TTFT s", "{:.2f}"), ("TPOT s", "{:.3f}"), ("E2E s", "{:.1f}"))):
            ours = [getattr(r, ("ttft", "tpot", "e2e")[j]) for r in (fair, serial, molink)]
            ref = ours[0]
            cells = [fmt.format(ours[0]), f"{fmt.format(ours[1])} ({pct(ours[1], ref)})",
                     f"{fmt.format(ours[2])} ({pct(ours[2], ref)})"]
            if pv[j] is not None:
                cells += [f"{pv[j]:g}", f"{ph[j]:g} ({pct(ph[j], pv[j])})", f"{pm[j]:g} ({pct(pm[j], pv[j])})"]
            else:
                cells += ["-"] * 3
            out.append(f"| {key if j == 0 else ''} | {name} | " + " | ".join(cells) + " |")
        out.append(f"| | micro-batches (MoLink) | 3 | 3 | {molink.micro_batches} | | | |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0, help="measured minutes after 1 minute of warm-up")
    ap.add_argument("--tables", default="2,3,5")
    args = ap.parse_args(argv)
    tables = {t.strip() for t in args.tables.split(",")}
    model = load_model(MODEL)
    t0 = time.perf_counter()
    print(f"# MoLink tables: {MODEL}, 3 x RTX-4090 pipeline, Azure conversation (in <= 2048, out <= 1024), "
          f"{args.minutes:g} min measured after {WARMUP_S:.0f} s warm-up\n")
    if "2" in tables:
        cluster = make_cluster(100)
        rows = {}
        for rate in (0.1, 0.2, 0.3, 0.7):
            rows[rate] = three_way(cluster, model, workload(rate, args.minutes), rate)
        print(table_three_way("Table 2: arrival rate (100 Mbps, 30 ms)", "rate req/s", rows, PAPER_T2), "\n")
    if "3" in tables:
        rows = {}
        wl = workload(0.3, args.minutes)
        for bw in (60, 100, 200, 400):
            rows[bw] = three_way(make_cluster(bw), model, wl, 0.3)
        print(table_three_way("Table 3: bandwidth (0.3 req/s, 30 ms)", "Mbps", rows, PAPER_T3), "\n")
    if "5" in tables:
        cluster, wl = make_cluster(100), workload(0.3, args.minutes)
        fair = run(cluster, model, wl, "fair", 3)
        mb = extended_micro_batches(cluster, model, make_plan(cluster, model), int(round(0.3 * fair.e2e)),
                                    float(wl.mean_input + wl.mean_output / 2))
        ablation = {
            "all optimisations": run(cluster, model, wl, "molink", mb),
            "chunk transmission only": run(cluster, model, wl, "molink", 3),
            "micro-batch extending only": run(cluster, model, wl, "fair", mb),
            "no optimisations": fair,
        }
        print("### Table 5: ablation (0.3 req/s, 100 Mbps, 30 ms)\n")
        print("| configuration | micro-batches | TTFT s | TPOT s | E2E s | paper TTFT | paper TPOT | paper latency |")
        print("|---|---|---|---|---|---|---|---|")
        for name, r in ablation.items():
            p = PAPER_T5[name]
            print(f"| {name} | {r.micro_batches} | {r.ttft:.2f} | {r.tpot:.3f} | {r.e2e:.1f} | "
                  f"{p[0]:g} | {p[1]:g} | {p[2]:g} |")
        print()
    print(f"(wall time {time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
