"""Experiment 3: Aladdin Figures 11 and 12 — GPUs needed to meet the SLOs against arrival rate.

    python experiments/aladdin_figures.py [--rates 5,10,15,20,25] [--requests 1500] [--modes colocated,decode]

Setting (Aladdin §6.1, §6.4): Llama2-13B on A100-80GB workers joined by PCIe inside 4-GPU boxes,
TTFT 600 ms and ATGT 30 ms (Table 2), ShareGPT prompt and output lengths (the bundled ShareGPT
length file; no request longer than 2048 + 2048 tokens) with Poisson arrivals.

For each rate and policy the fewest workers whose simulation has ≥ ``--target`` of the requests
within the SLOs is found by bisection (``hetserve.capacity.simulated.workers_needed``):

* Figure 11 (colocated, vLLM-style continuous batching): Aladdin (Eq. 6 worker size + best-fit
  placement), JSQ and power-of-two on the same worker size, and "vLLM default" (all 4 GPUs of a
  box in one worker, JSQ). Attainment: TTFT and ATGT.
* Figure 12 (split-phase, decode instances only): decode workers behind a fixed prefill pool
  sized generously so it never limits; the decode replica of each request is chosen by the policy.
  Only decode GPUs are counted. Attainment: TPOT (which, unlike ATGT, charges waiting for a
  decode worker's KV).

JSQ, power-of-two and vLLM: the fewest workers meeting the target (bisection). Aladdin is a bin
packer — it fills the fullest feasible worker and opens another only when none fits — so extra
workers in the pool stay idle and do not raise its attainment. It runs once per point in an ample
pool (2× the fluid bound + 4 workers); the table gives the GPUs of the workers it opened and, in
brackets, the share of requests within the SLOs it reached with them. It runs with the paper's
defaults (γ = 0.5, θ = 1) and a stricter setting (γ = 1, θ = 0.8) that leaves room for model
error and for the prefill stalls the linear models do not see. Output lengths are the true ones
(oracle prediction) for every policy.
"""

from __future__ import annotations

import argparse
import sys
import time

from hetserve.capacity.config import best_worker_config, homogeneous_cluster, worker_options
from hetserve.capacity.simulated import attainment, run_pool, workers_needed
from hetserve.capacity.workers import fit_worker_law, fluid_workers
from hetserve.policies.aladdin import AladdinPlacement, models_from_cost
from hetserve.specs.model import load_model
from hetserve.specs.workload import SLO, load_workload

MODEL, GPU = "llama-2-13b", "A100-SXM-80G"
PCIE = {"bandwidth_gbps": 200, "latency_ms": 0.01}  # the aladdin-a100 preset's in-box link
SLO_13B = SLO(ttft_s=0.6, tpot_s=0.03)  # Aladdin Table 2, A100
PAPER = {
    "colocated": "Figure 11: Aladdin needs up to 71% fewer GPUs than default vLLM and up to 40% fewer than "
                 "JSQ with Aladdin's worker size (numbers read off a plot; no table in the paper)",
    "decode": "Figure 12: Aladdin needs up to 60% fewer decode GPUs than JSQ and up to 49% fewer than "
              "power-of-two",
}


def aladdin(gamma: float, theta: float, slo: SLO):
    def make(pool):
        layouts = {r.id: r.layout(pool.cluster) for r in pool.plan.replicas if r.id in pool.worker_ids}
        return AladdinPlacement(models_from_cost(pool.cost, layouts, slo), slo, gamma=gamma, theta=theta)
    return make


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", default="5,10,15,20,25")
    ap.add_argument("--requests", type=int, default=1500, help="requests simulated per rate")
    ap.add_argument("--modes", default="colocated,decode")
    ap.add_argument("--target", type=float, default=0.99)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-admission", choices=["reserve", "paged"], default="reserve",
                    help="simulator KV admission: whole footprint at admission, or vLLM-style paged growth "
                         "with recompute pre-emption")
    args = ap.parse_args(argv)
    rates = [float(x) for x in args.rates.split(",")]
    model = load_model(MODEL)
    base = load_workload("sharegpt", seed=args.seed).filter_lengths(2048, 2048)
    mi, mo = base.mean_input, base.mean_output
    pool8 = homogeneous_cluster(GPU, 8, 4, PCIE)
    opt = best_worker_config(pool8, model, SLO_13B, mi, mo, gpu_name=GPU)
    g = opt.gpus
    t0 = time.perf_counter()
    print(f"# Aladdin Figures 11/12: {MODEL} on {GPU} (PCIe boxes of 4), SLO TTFT {SLO_13B.ttft_s}s / "
          f"ATGT {SLO_13B.tpot_s}s, ShareGPT lengths (mean in {mi:.0f}, out {mo:.0f}), Poisson arrivals, "
          f"{args.requests} requests per point, target {args.target:.0%} of requests within the SLOs, "
          f"KV admission {args.kv_admission!r}\n")
    print("Worker size by Eq. 6 (per-GPU decode throughput at the SLO-bounded batch):\n")
    print("| GPUs/worker | limit | batch | tok/s/GPU |\n|---|---|---|---|")
    for o in worker_options(pool8, model, SLO_13B, mi, mo, gpu_name=GPU):
        print(f"| {o.gpus} | {o.limit} | {o.batch} | {o.tokens_per_s_per_gpu:,.0f} |")
    print(f"\nchosen: {g} GPU(s) per worker (paper, Table 3: 1 for Llama2-13B on A100)\n")

    for mode in [m.strip() for m in args.modes.split(",")]:
        slo = SLO_13B if mode == "colocated" else SLO(ttft_s=None, tpot_s=SLO_13B.tpot_s)
        policies = {
            "Aladdin (γ=0.5, θ=1)": (aladdin(0.5, 1.0, slo), g),
            "Aladdin (γ=1, θ=0.8)": (aladdin(1.0, 0.8, slo), g),
            "JSQ": ("jsq", g),
            "power-of-two": ("po2", g),
        }
        if mode == "colocated":
            policies["vLLM default (4 GPUs/worker, JSQ)"] = ("jsq", 4)
        results: dict[str, list[str]] = {k: [] for k in policies}
        counts: dict[str, list[tuple[float, int]]] = {k: [] for k in policies}
        for rate in rates:
            wl = base.with_poisson_arrivals(rate, args.seed).head(args.requests)
            for name, (pol, gpw) in policies.items():
                o = next(x for x in worker_options(pool8, model, SLO_13B, mi, mo, degrees=(gpw,), gpu_name=GPU))
                fluid = fluid_workers(rate, o, mi, mo, colocated=mode == "colocated")
                prefill = max(2, fluid) if mode == "decode" else 0
                if name.startswith("Aladdin"):
                    ample = 2 * fluid + 4
                    res = run_pool(model, GPU, wl, slo, pol, ample, gpw, mode, prefill, intra=PCIE,
                                   kv_admission=args.kv_admission)
                    used = len({x for x in (res.prefill_replica if mode == "colocated" else res.decode_replica)
                                if x.startswith("w")})
                    att = attainment(res, slo, "atgt" if mode == "colocated" else "tpot")
                    results[name].append(f"{used * gpw} ({100 * att:.1f}%)")
                    counts[name].append((rate, used))
                    continue
                try:
                    n = workers_needed(model, GPU, wl, slo, pol, gpw, mode, args.target, prefill_workers=prefill,
                                       intra=PCIE, hint=fluid, max_workers=4 * fluid + 8,
                                       kv_admission=args.kv_admission)
                    results[name].append(str(n * gpw))
                    counts[name].append((rate, n))
                except ValueError:
                    results[name].append(f"> {(4 * fluid + 8) * gpw}")
            print(f"  [{mode}] rate {rate:g} done ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
        title = "Figure 11 (colocated)" if mode == "colocated" else "Figure 12 (decode instances of split-phase)"
        print(f"### {title}: GPUs needed\n")
        print("| policy | " + " | ".join(f"{r:g} req/s" for r in rates) + " | N_w law |")
        print("|---|" + "---|" * (len(rates) + 1))
        for name, cells in results.items():
            law = ""
            if len(counts[name]) >= 2:
                fit = fit_worker_law([r for r, _ in counts[name]], [n for _, n in counts[name]])
                law = f"⌈{fit.k5:.3f}·r + {fit.c5:.2f}⌉"
            print(f"| {name} | " + " | ".join(cells) + f" | {law} |")
        ref = "JSQ"
        best = "Aladdin (γ=1, θ=0.8)"
        saves = []
        for r, a, j in zip(rates, results[best], results[ref]):
            a = a.split(" ")[0]
            if a.isdigit() and j.isdigit():
                saves.append(f"{r:g}: {100 * (1 - int(a) / int(j)):+.0f}%")
        print(f"\nGPU saving of {best} against {ref} (positive = fewer GPUs): " + ", ".join(saves))
        print(f"\npaper — {PAPER[mode]}\n")
    print(f"(wall time {time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
