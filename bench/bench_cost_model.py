"""The kernel cost model against the measured A100 80 GB / A40 profiles: every target's figure.

    .venv/bin/python -m bench.bench_cost_model [--profiles hetserve/data/gpu-profiles] [--json out.json]

- *fitted*: each GPU's own fit, whole layers (every model, TP, token count) within ±10 %
  (target ≥ 95 %);
- *transferred*: one GPU's fit on the other's datasheet peaks, ``linear_s`` within ±15 % (target
  ≥ 85 %, none off by more than 1.5x), and the default roofline on the same points beside it;
- *left-out model*: fit on all models but one, price the one left out, each in turn (pooled);
- *all-reduce*: the in-box fits from 64 KiB up within ±20 %, by size band; the NVSwitch box's
  two-GPU fit on the NVLink-pair box's measurements (a box it was not fitted on);
- *cost layer*: wall and CPU time of ``hetserve cost layer`` for a 20-point table, a fresh process
  each time (target < 1 s), with the machine's load beside it.

Every figure is computed from the profiles in this run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from hetserve.cost.collectives import MIN_FIT_BYTES
from hetserve.cost.kernel_fit import errors, fit_gpu, measured_layer, summary
from hetserve.cost.kernel_table import fit_table
from hetserve.cost.kernels import gemm_dims
from hetserve.cost.profiles import BUNDLED_PROFILES, read_allreduce, read_compute
from hetserve.specs.gpus import gpu

A100, A40 = "A100-SXM-80G", "A40"
ROOT = Path(__file__).resolve().parents[1]


def _roofline_linear(g, pt, compute: float = 0.5, memory: float = 0.8) -> float:
    """The default roofline's four projections: max(FLOPs / (0.5 peak), weight bytes / (0.8 peak))."""
    kn = sum(k * n for k, n in gemm_dims(pt.shape, pt.tp).values())
    return max(2 * pt.tokens * kn / (g.fp16_flops * compute), 2 * kn / (g.mem_bandwidth * memory))


def compute_figures(profiles: Path) -> dict:
    pts = read_compute(profiles)
    by = {g: [p for p in pts if p.gpu == g] for g in (A100, A40)}
    fits = {g: fit_gpu(p, gpu(g)) for g, p in by.items()}
    out: dict = {"fitted": {}, "transferred": {}, "left_out_model": {}, "roofline": {}}
    for g in by:
        e = errors(fits[g], gpu(g), by[g])
        out["fitted"][g] = {"layer": summary(e["layer"], 0.10), "linear": summary(e["linear"], 0.15)}
        roof = np.array([_roofline_linear(gpu(g), p) / measured_layer(p)[0] for p in by[g]])
        out["roofline"][g] = {"linear": summary(roof, 0.15)}
    for a, b in ((A100, A40), (A40, A100)):
        e = errors(fits[a], gpu(b), by[b])
        out["transferred"][f"{a}->{b}"] = {"linear": summary(e["linear"], 0.15), "layer": summary(e["layer"], 0.15)}
    for g, p in by.items():
        pooled, per = [], {}
        for m in sorted({x.model for x in p}):
            r = errors(fit_gpu([x for x in p if x.model != m], gpu(g)), gpu(g), [x for x in p if x.model == m])["layer"]
            per[m] = summary(r, 0.10)["share_within"]
            pooled.append(r)
        out["left_out_model"][g] = {"pooled_layer": summary(np.concatenate(pooled), 0.10), "per_model": per}
    table = fit_table(profiles)
    ar = read_allreduce(profiles)
    bands = ((65536, 2e6), (2e6, 8e6), (8e6, 1e12))
    out["allreduce"] = {}
    for w in sorted(table.allreduce):
        sel = [p for p in ar if p.setting == "a100_dgx" and p.workers == w == p.per_node and p.size >= MIN_FIT_BYTES]
        r = np.array([table.allreduce_time(w, p.size, table.link_bytes_per_s) / p.seconds for p in sel])
        s = np.array([p.size for p in sel])
        out["allreduce"][w] = {"from_64KiB": summary(r, 0.20), **{
            f"{int(lo)}-{int(hi) if hi < 1e12 else 'up'}": summary(r[(s >= lo) & (s < hi)], 0.20) for lo, hi in bands}}
    pair = [p for p in ar if p.setting == "a100_pairwise_nvlink" and p.workers == 2 == p.per_node
            and p.size >= MIN_FIT_BYTES]
    if pair and 2 in table.allreduce:
        r = np.array([table.allreduce_time(2, p.size, table.link_bytes_per_s) / p.seconds for p in pair])
        big = np.array([p.size >= 2e6 for p in pair])
        out["allreduce_other_box"] = {"from_64KiB": summary(r, 0.20), "from_2MB": summary(r[big], 0.20)}
    return out


def time_cost_layer(runs: int = 5) -> dict:
    exe = Path(sys.executable).parent / "hetserve"
    cmd = [str(exe), "cost", "layer", "--gpu", "H100-SXM-80G", "--model", "llama-2-70b", "--tp", "1,2,4,8",
           "--tokens", "1,16,64,512,4096", "--json"]
    walls, cpus = [], []
    for _ in range(runs):
        t0, r0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT)
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        walls.append(time.perf_counter() - t0)
        cpus.append(r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime)
    return {"command": " ".join(cmd[1:]), "runs": runs, "median_s": statistics.median(walls), "max_s": max(walls),
            "median_cpu_s": statistics.median(cpus), "load_1min": os.getloadavg()[0]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profiles", default=str(BUNDLED_PROFILES))
    ap.add_argument("--json", help="write the figures here too")
    args = ap.parse_args()
    figs = compute_figures(Path(args.profiles))
    figs["cost_layer"] = time_cost_layer()
    pct = lambda s: f"{s['share_within']:.1%} of {s['points']} (ratios {s['min_ratio']:.2f}–{s['max_ratio']:.2f})"  # noqa: E731
    for g, f in figs["fitted"].items():
        print(f"fitted {g}: layer within ±10 % {pct(f['layer'])}; linear within ±15 % {pct(f['linear'])}")
        print(f"  roofline (0.5 / 0.8) {g}: linear within ±15 % {pct(figs['roofline'][g]['linear'])}")
    for k, f in figs["transferred"].items():
        print(f"transferred {k}: linear within ±15 % {pct(f['linear'])}; layer within ±15 % {pct(f['layer'])}")
    for g, f in figs["left_out_model"].items():
        print(f"left-out model {g}: layer within ±10 % {pct(f['pooled_layer'])}; per model "
              + ", ".join(f"{m.split('/')[-1]} {v:.0%}" for m, v in f["per_model"].items()))
    for w, f in figs["allreduce"].items():
        print(f"all-reduce {w} GPUs: " + "; ".join(f"{k} {pct(v)}" for k, v in f.items()))
    if "allreduce_other_box" in figs:
        f = figs["allreduce_other_box"]
        print(f"all-reduce 2 GPUs, NVSwitch fit on the NVLink-pair box: from 64 KiB {pct(f['from_64KiB'])}; "
              f"from 2 MB {pct(f['from_2MB'])}")
    c = figs["cost_layer"]
    print(f"hetserve {c['command']}: median {c['median_s']:.3f} s wall ({c['median_cpu_s']:.3f} s CPU), "
          f"max {c['max_s']:.3f} s over {c['runs']} runs, load {c['load_1min']:.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(figs, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
