"""Experiment 2: MoLink Tables 2, 3 and 5 — serial vs fair vs MoLink transmission on a slow pipeline.

    python experiments/molink_tables.py [--quick] [--minutes 30] [--tables eq,2,3,5] [--model qwen2-7b]
        [--plot docs/experiments/molink_tables.png]

Setting (MoLink §5): Qwen2-7B (28 layers, GQA; ``--model qwen-7b`` for Qwen-1) in three pipeline
stages on three RTX 4090 servers (the ``molink-3x4090`` preset: every pair 100 Mbps / 30 ms), the
Azure conversation trace without requests over 2048 input or 1024 output tokens, rescaled to each
arrival rate, 1 minute of warm-up then ``--minutes`` measured (requests arriving in the warm-up
are left out of the means).

Table ``eq`` compares like with like first: fair sharing and MoLink's transmission at the *same*
micro-batch count (3 and 6), so the transmission policy alone is measured; then each with its own
best count (of 3..6, by measured mean E2E) and MoLink with the count its §4.3 emulation picks.
Beside each run: the extra delay of decode messages on the links (delivery − start − latency −
bytes/bandwidth), the problem MoLink's scheduling addresses.

Baselines as the paper names them: "vLLM" = fair-share concurrent sends (``fair``), "Helix" =
one ordered queue (``serial``), "MoLink" = ``molink`` transmission (decode first, anti-starvation
weight N = 30, just-in-time chunks) plus the micro-batch count chosen in N..2N by
``choose_micro_batches`` for the batch Little's law gives (rate × mean E2E of the fair run).
Every run uses the simulator's detailed pipeline (one event per stage per micro-batch, activations
on the shared links).

The testbed and one run on it (``make_cluster``, ``make_plan``, ``workload``, ``run``) live in
``molink_setting.py`` beside this script.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from molink_setting import (MODEL, WARMUP_S, Row, extended_micro_batches, make_cluster, make_plan, run, stages_of,
                            workload)
from hetserve.specs.model import load_model

EQ_RATES = (0.1, 0.2, 0.3, 0.7)
COUNTS = (3, 4, 5, 6)


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


def calibrate_links(bandwidth_mbps: float = 100.0, latency_ms: float = 30.0, repeats: int = 3) -> tuple[float, float, str]:
    """Fit the link model's ``overhead_s`` and ``competing_penalty`` to the runtime's emulated link
    (``runtime.links.ShapedLink``: the wall-clock driver, its thread and the monotonic clock).

    Single messages of 10–400 kB, one at a time: overhead = mean(delivery − send − α − bytes/β).
    Then n = 2, 4, 8 messages of 100 kB sent at once under fair sharing: the last delivery at
    α + overhead + n·S/β·(1 + p·(n − 1)) gives the penalty p (least squares, ≥ 0).
    Returns (overhead_s, penalty, a markdown table of the measurements)."""
    import threading

    from hetserve.policies.transmission import FairTransmission
    from hetserve.runtime.links.network import ShapedLink

    bw, lat = bandwidth_mbps * 1e6 / 8, latency_ms / 1e3
    link = ShapedLink("a", "b", lat, bw, FairTransmission())
    lines = ["| messages at once | bytes each | model (ms) | emulated link (ms) | excess (ms) |", "|---|---|---|---|---|"]

    def burst(n, nbytes):
        done, ev, t0 = [], threading.Event(), time.monotonic()

        def deliver():
            done.append(time.monotonic())
            if len(done) == n:
                ev.set()
        for _ in range(n):
            link.send(nbytes, "prefill", deliver)
        ev.wait(30)
        return max(done) - t0

    singles = []
    for nbytes in (10e3, 100e3, 400e3):
        for _ in range(repeats):
            got = burst(1, nbytes)
            singles.append(got - lat - nbytes / bw)
        lines.append(f"| 1 | {nbytes / 1e3:.0f} kB | {1e3 * (lat + nbytes / bw):.1f} | {1e3 * (got):.1f} | "
                     f"{1e3 * (got - lat - nbytes / bw):.2f} |")
    overhead = max(0.0, float(np.mean(singles)))
    xs, ys = [], []
    for n in (2, 4, 8):
        nbytes = 100e3
        got = float(np.mean([burst(n, nbytes) for _ in range(repeats)]))
        base = n * nbytes / bw
        xs.append(base * (n - 1))
        ys.append(got - lat - overhead - base)
        lines.append(f"| {n} | {nbytes / 1e3:.0f} kB | {1e3 * (lat + base):.1f} | {1e3 * got:.1f} | "
                     f"{1e3 * (got - lat - base):.2f} |")
    link.close()
    penalty = max(0.0, float(np.dot(xs, ys) / np.dot(xs, xs)))
    return overhead, penalty, "\n".join(lines)


def table_calibrated(cluster, model, rates, minutes: float, settings: dict) -> str:
    """Fair vs MoLink at 3 and 6 micro-batches under each named (overhead_s, penalty) link setting."""
    lines = ["| link model | rate req/s | micro-batches | TTFT fair → MoLink | TPOT fair → MoLink | "
             "decode msg delay p99 fair / MoLink (ms) |", "|---|---|---|---|---|---|"]
    for name, (ov, pen) in settings.items():
        for rate in rates:
            wl = workload(rate, minutes)
            for m in (3, 6):
                f = run(cluster, model, wl, "fair", m, ov, pen)
                k = run(cluster, model, wl, "molink", m, ov, pen)
                lines.append(f"| {name} | {rate:g} | {m} | {f.ttft:.2f} → {k.ttft:.2f} ({delta(k.ttft, f.ttft)}) | "
                             f"{f.tpot:.3f} → {k.tpot:.3f} ({delta(k.tpot, f.tpot)}) | "
                             f"{f.decode_delay_p99_ms:.1f} / {k.decode_delay_p99_ms:.1f} |")
    return "\n".join(lines)


def delta(x: float, ref: float) -> str:
    return f"{100 * (x / ref - 1):+.1f}%" if ref > 0 else "-"


def equal_counts(cluster, model, rates, minutes: float, counts=COUNTS) -> dict:
    """Fair and MoLink at every count in ``counts`` for every rate: {rate: {(policy, m): Row}}."""
    out = {}
    for rate in rates:
        wl = workload(rate, minutes)
        out[rate] = {(p, m): run(cluster, model, wl, p, m) for m in counts for p in ("fair", "molink")}
        fair3 = out[rate][("fair", counts[0])]
        emu = extended_micro_batches(cluster, model, make_plan(cluster, model), int(round(rate * fair3.e2e)),
                                     float(wl.mean_input + wl.mean_output / 2))
        if ("molink", emu) not in out[rate]:
            out[rate][("molink", emu)] = run(cluster, model, wl, "molink", emu)
        out[rate]["emulated"] = emu
    return out


def table_equal(res: dict, shown=(3, 6)) -> str:
    lines = ["### Same micro-batch count: the transmission policy alone (100 Mbps, 30 ms)", "",
             "| rate req/s | micro-batches | TTFT fair | TTFT MoLink | TPOT fair | TPOT MoLink | E2E fair | E2E MoLink "
             "| decode msg delay fair (mean / p99 ms) | MoLink (mean / p99 ms) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for rate, runs in res.items():
        for m in shown:
            f, k = runs[("fair", m)], runs[("molink", m)]
            lines.append(f"| {rate:g} | {m} | {f.ttft:.2f} | {k.ttft:.2f} ({delta(k.ttft, f.ttft)}) | {f.tpot:.3f} | "
                         f"{k.tpot:.3f} ({delta(k.tpot, f.tpot)}) | {f.e2e:.1f} | {k.e2e:.1f} ({delta(k.e2e, f.e2e)}) | "
                         f"{f.decode_delay_mean_ms:.1f} / {f.decode_delay_p99_ms:.1f} | "
                         f"{k.decode_delay_mean_ms:.1f} / {k.decode_delay_p99_ms:.1f} |")
    lines += ["", "### Each with its own best count (of 3..6 by mean E2E), and MoLink's §4.3 choice", "",
              "| rate req/s | fair: m, TTFT / TPOT / E2E | MoLink best: m, TTFT / TPOT / E2E | MoLink §4.3: m, TTFT / "
              "TPOT / E2E | paper vLLM → MoLink TTFT / TPOT / E2E |", "|---|---|---|---|---|"]
    for rate, runs in res.items():
        def best(p):
            return min((r for (q, _), r in ((k, v) for k, v in runs.items() if k != "emulated") if q == p),
                       key=lambda r: r.e2e)
        f, k, e = best("fair"), best("molink"), runs[("molink", runs["emulated"])]

        def cells(r, ref):
            return (f"{r.micro_batches}, {r.ttft:.2f} ({delta(r.ttft, ref.ttft)}) / {r.tpot:.3f} "
                    f"({delta(r.tpot, ref.tpot)}) / {r.e2e:.1f} ({delta(r.e2e, ref.e2e)})")
        pv = PAPER_T2.get(rate)
        paper = (f"{delta(pv[2][0], pv[0][0])} / {delta(pv[2][1], pv[0][1])} / {delta(pv[2][2], pv[0][2])}"
                 if pv else "-")
        lines.append(f"| {rate:g} | {f.micro_batches}, {f.ttft:.2f} / {f.tpot:.3f} / {f.e2e:.1f} | {cells(k, f)} | "
                     f"{cells(e, f)} | {paper} |")
    return "\n".join(lines)


def plot_equal(res: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rates = list(res)
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, (attr, label) in zip(axes, (("ttft", "mean TTFT (s)"), ("tpot", "mean TPOT (s)"),
                                        ("decode_delay_p99_ms", "decode message delay p99 (ms)"))):
        for p, style in (("fair", "--"), ("molink", "-")):
            for m in (3, 6):
                ax.plot(rates, [getattr(res[r][(p, m)], attr) for r in rates], style, marker="o", label=f"{p}, m={m}")
        ax.set_xlabel("arrival rate (req/s)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"(plot: {path})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one rate, 3 minutes, equal-count table only")
    ap.add_argument("--minutes", type=float, default=30.0, help="measured minutes after 1 minute of warm-up")
    ap.add_argument("--tables", default="eq,cal,2,3,5",
                    help="eq: equal micro-batch counts; cal: link model calibrated against the runtime's emulated "
                         "link, then fair vs MoLink with it; 2, 3, 5: the paper's tables")
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--plot", help="write the equal-count comparison as a PNG here")
    args = ap.parse_args(argv)
    tables = {t.strip() for t in args.tables.split(",")}
    rates = EQ_RATES
    if args.quick:
        tables, args.minutes, rates = {"eq"}, min(args.minutes, 3.0), (0.3,)
    model = load_model(args.model)
    t0 = time.perf_counter()
    print(f"# MoLink tables: {model.name} (stages {stages_of(model)}), 3 x RTX-4090 pipeline, Azure conversation "
          f"(in <= 2048, out <= 1024), {args.minutes:g} min measured after {WARMUP_S:.0f} s warm-up\n")
    if "cal" in tables:
        ov, pen, meas = calibrate_links()
        print("### Link model calibrated against the runtime's emulated link (100 Mbps, 30 ms)\n")
        print(meas, "\n")
        print(f"fitted: overhead_s = {1e3 * ov:.2f} ms per message, competing_penalty = {pen:.3f}\n")
        settings = {f"calibrated ({1e3 * ov:.2f} ms, {pen:.3f})": (ov, pen),
                    "sensitivity: 5 ms, penalty 0.5": (0.005, 0.5)}
        print(table_calibrated(make_cluster(100), model, (0.3, 0.7) if not args.quick else (0.3,),
                               args.minutes, settings), "\n")
    if "eq" in tables:
        res = equal_counts(make_cluster(100), model, rates, args.minutes, COUNTS if not args.quick else (3, 6))
        print(table_equal(res), "\n")
        if args.plot:
            plot_equal(res, args.plot)
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
