"""Engine vs transformers ``generate``: output tokens/s, TTFT and TPOT on one tiny model and request set.

    .venv/bin/python -m bench.bench_engine                       # 32 requests x 64 tokens, Llama GQA
    .venv/bin/python -m bench.bench_engine --arch opt --requests 16 --json out.json

Systems, all on the same checkpoint (built in a temp dir) and the same requests, all arriving at
t = 0 (prompt lengths 8..120 bytes, every request generating exactly ``--max-tokens`` tokens):

- ``hf-sequential``  transformers ``generate``, one request after the other (greedy)
- ``hf-batched``     transformers ``generate`` on the whole set, left-padded into one batch
- ``engine:<plan>``  hetserve's Engine: worker processes, continuous batching over a KV pool; plans
  ``tp1`` (one worker), ``asym`` (TP 2 on the first layer, TP 1 on the rest), ``disagg`` (prefill TP 2
  -> decode TP 1 + TP 1, KV handed off and re-sharded)

Every engine worker runs one torch thread; the transformers baselines run ``--hf-threads`` (default 1).
TTFT is measured from the common arrival time; TPOT is (last - first token time) / (tokens - 1) per
request; tokens/s is all output tokens over the makespan. Engine start-up is excluded. The
target: continuous batching >= 4x the tokens/s of one-at-a-time ``generate`` at 32 concurrent requests.

Beside every engine row, the simulator's prediction for the same plan and requests (``--no-sim`` to
skip): the cost model's efficiency is first fitted to this machine
(``hetserve.calibration.calibrate.calibrate``: the engine on one worker, prompts of 32..512 tokens and
decode batches of 1..32, relative to the cluster's RTX 4090 datasheet), then ``hetserve.sim.simulate``
plays the same arrivals, prompt lengths and output lengths against the plan with the engine's
limits (``max_num_seqs`` 64, 2,048 prompt tokens per step, KV reserved at admission).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.lib.workdir import workdir

CLUSTER = """\
name: bench-cpu
machines:
  - {name: m0, gpu: RTX-4090, count: 4}
"""


def plans(layers: int) -> dict[str, dict]:
    def plan(replicas, routes=()):
        return {"model": "tiny", "cluster": "bench-cpu", "replicas": replicas,
                "kv_routes": [{"from": a, "to": b, "weight": 1.0} for a, b in routes]}

    return {
        "tp1": plan([{"id": "c0", "role": "colocated", "stages": [{"devices": ["m0:0"], "layers": [0, layers]}]}]),
        "asym": plan([{"id": "c0", "role": "colocated",
                       "stages": [{"devices": ["m0:0", "m0:1"], "layers": [0, 1]},
                                  {"devices": ["m0:2"], "layers": [1, layers]}]}]),
        "disagg": plan([{"id": "p0", "role": "prefill", "stages": [{"devices": ["m0:0", "m0:1"], "layers": [0, layers]}]},
                        {"id": "d0", "role": "decode",
                         "stages": [{"devices": ["m0:2"], "layers": [0, layers // 2]},
                                    {"devices": ["m0:3"], "layers": [layers // 2, layers]}]}],
                       [("p0", "d0")]),
    }


def make_requests(n: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(32, 127) for _ in range(rng.randrange(8, 121))] for _ in range(n)]


def summarize(name: str, ttfts: list[float], tpots: list[float], tokens: int, makespan: float) -> dict:
    q = statistics.quantiles(ttfts, n=10) if len(ttfts) > 1 else [ttfts[0]] * 9
    return {"system": name, "requests": len(ttfts), "output_tokens": tokens, "makespan_s": makespan,
            "tokens_per_s": tokens / makespan, "ttft_mean_s": statistics.mean(ttfts), "ttft_p50_s": statistics.median(ttfts),
            "ttft_p90_s": q[8], "tpot_mean_s": statistics.mean(tpots) if tpots else float("nan")}


class _StepClock:
    """LogitsProcessor that records when each generation step's logits are ready (one call per token)."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


def bench_hf(model_dir: Path, prompts: list[list[int]], max_tokens: int, batched: bool) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, LogitsProcessorList

    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    kw = dict(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, pad_token_id=258)
    with torch.no_grad():
        model.generate(torch.tensor([prompts[0]]), max_new_tokens=4, do_sample=False, pad_token_id=258)  # warm-up
        t0 = time.perf_counter()
        ttfts, tpots, tokens = [], [], 0
        if batched:
            width = max(len(p) for p in prompts)
            ids = torch.full((len(prompts), width), 258, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, p in enumerate(prompts):
                ids[i, width - len(p):] = torch.tensor(p)
                mask[i, width - len(p):] = 1
            clock = _StepClock()
            out = model.generate(ids, attention_mask=mask, logits_processor=LogitsProcessorList([clock]), **kw)
            n = out.shape[1] - width
            tokens = n * len(prompts)
            ttfts = [clock.times[0] - t0] * len(prompts)
            tpots = [(clock.times[-1] - clock.times[0]) / max(1, n - 1)] * len(prompts)
        else:
            for p in prompts:
                clock = _StepClock()
                out = model.generate(torch.tensor([p]), logits_processor=LogitsProcessorList([clock]), **kw)
                n = out.shape[1] - len(p)
                tokens += n
                ttfts.append(clock.times[0] - t0)
                tpots.append((clock.times[-1] - clock.times[0]) / max(1, n - 1))
        makespan = time.perf_counter() - t0
    return summarize("hf-batched" if batched else "hf-sequential", ttfts, tpots, tokens, makespan)


MAX_NUM_SEQS, MAX_BATCHED_TOKENS, KV_TOKENS = 64, 2048, 16384


def simulate_engine(plan_dict: dict, cluster_path: Path, model_dir: Path, prompts: list[list[int]], max_tokens: int,
                    efficiency) -> dict:
    """The simulator's summary for ``plan_dict`` and the bench's requests (all arriving at t = 0, each
    generating exactly ``max_tokens``), with the cost model's efficiency fitted to this machine."""
    from hetserve.cost.analytic import CostModel
    from hetserve.planner.plan import Plan
    from hetserve.sim import SimOptions, simulate
    from hetserve.specs.cluster import load_cluster
    from hetserve.specs.model import load_model
    from hetserve.specs.workload import Workload

    cluster, spec = load_cluster(cluster_path), load_model(model_dir)
    workload = Workload.from_lists("bench-engine", [0.0] * len(prompts), [len(p) for p in prompts],
                                   [max_tokens] * len(prompts))
    options = SimOptions(placement="jsq", max_batch=MAX_NUM_SEQS, token_budget=MAX_BATCHED_TOKENS,
                         kv_admission="reserve", progress=False)
    return simulate(Plan.from_dict(plan_dict), cluster, spec, workload, options,
                    cost=CostModel(cluster, spec, efficiency)).summary()


def bench_engine(name: str, plan_dict: dict, cluster_path: Path, model_dir: Path, prompts: list[list[int]],
                 max_tokens: int, start_method: str) -> dict:
    from hetserve.planner.plan import Plan
    from hetserve.runtime.engine import Engine
    from hetserve.runtime.engine_config import EngineConfig
    from hetserve.runtime.params import SamplingParams

    config = EngineConfig(kv_capacity_tokens=KV_TOKENS, max_num_seqs=MAX_NUM_SEQS,
                          max_batched_tokens=MAX_BATCHED_TOKENS, start_method=start_method, threads_per_worker=1)
    t_start = time.perf_counter()
    engine = Engine.from_plan(Plan.from_dict(plan_dict), cluster_path, model_dir, config)
    started = time.perf_counter() - t_start
    try:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        engine.generate(prompts[:4], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        t0 = time.perf_counter()
        handles = [engine.submit(p, params) for p in prompts]
        outs = [h.result(timeout=600) for h in handles]
        makespan = time.perf_counter() - t0
        # handle times are time.monotonic(); arrival of every request is within microseconds of t0
        ttfts = [h.ttft for h in handles]
        tpots = [h.tpot for h in handles if h.tpot is not None]
        stats = engine.stats()
    finally:
        engine.shutdown()
    row = summarize(f"engine:{name}", ttfts, tpots, sum(len(o) for o in outs), makespan)
    row["start_s"] = started
    row["steps"] = sum(r["steps"] for r in stats["replicas"].values())
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", choices=("llama", "opt"), default="llama")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=None, help="default: heads/2 for Llama (GQA)")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--plans", default="tp1,asym,disagg", help="comma-separated: tp1, asym, disagg")
    ap.add_argument("--no-hf-batched", action="store_true")
    ap.add_argument("--start-method", choices=("spawn", "forkserver"), default="spawn")
    ap.add_argument("--hf-threads", type=int, default=1,
                    help="torch threads for the transformers baselines (default 1, as each engine worker; "
                         "more threads on a shared 2-core box mostly spin)")
    ap.add_argument("--no-sim", action="store_true", help="skip the calibration and the simulator's prediction")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)

    import torch

    from hetserve.runtime.model.make import make_model

    torch.set_num_threads(args.hf_threads)

    kv_heads = args.kv_heads or (max(1, args.heads // 2) if args.arch == "llama" else None)
    tmp = workdir("hetserve-bench-")
    # the folder name is the model name the plans (and the simulator) expect
    model_dir = make_model(tmp / "tiny", args.arch, layers=args.layers, hidden=args.hidden, heads=args.heads,
                           kv_heads=kv_heads, seed=0)
    cluster_path = tmp / "cluster.yaml"
    cluster_path.write_text(CLUSTER)
    prompts = make_requests(args.requests)
    print(f"model: {args.arch}, {args.layers} layers, hidden {args.hidden}, heads {args.heads}/{kv_heads or args.heads}; "
          f"{args.requests} requests x {args.max_tokens} tokens, prompts {min(map(len, prompts))}-"
          f"{max(map(len, prompts))} tokens; {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}",
          flush=True)
    rows = [bench_hf(model_dir, prompts, args.max_tokens, batched=False)]
    print(f"  {rows[-1]['system']}: {rows[-1]['tokens_per_s']:.0f} tok/s", flush=True)
    if not args.no_hf_batched:
        rows.append(bench_hf(model_dir, prompts, args.max_tokens, batched=True))
        print(f"  {rows[-1]['system']}: {rows[-1]['tokens_per_s']:.0f} tok/s", flush=True)
    all_plans = plans(args.layers)
    engine_plans = [p for p in args.plans.split(",") if p]
    calibration = None
    if engine_plans and not args.no_sim:
        from hetserve.calibration.calibrate import calibrate

        # decode batches up to the bench's concurrency, so the fitted per-iteration cost covers batch 32
        calibration = calibrate(str(model_dir), "RTX-4090", batch_sizes=(1, 4, 16, 32))
        eff = calibration.efficiency
        print(f"  calibrated cost model: compute efficiency {eff.compute:.3g} of the RTX 4090 datasheet, "
              f"{1000 * eff.iteration_overhead_s:.2f} ms per iteration + {1000 * eff.step_overhead_s:.2f} ms per "
              f"stage + {1000 * eff.seq_overhead_s:.3f} ms per sequence + {1000 * eff.collective_overhead_s:.2f} ms "
              f"per TP collective + {1e9 * eff.collective_s_per_byte:.2f} ms per MB it carries, "
              f"{1e9 * eff.multi_row_s_per_byte:.3f} ms per MB of weights once a step has more than one row, "
              f"mean |error| {calibration.mean_abs_error:.0%}",
              flush=True)
    for name in engine_plans:
        rows.append(bench_engine(name, all_plans[name], cluster_path, model_dir, prompts, args.max_tokens,
                                 args.start_method))
        if calibration is not None:
            sim = simulate_engine(all_plans[name], cluster_path, model_dir, prompts, args.max_tokens,
                                  calibration.efficiency)
            rows[-1].update(sim_tokens_per_s=sim["throughput_tokens_per_s"], sim_ttft_mean_s=sim["ttft_s"]["mean"],
                            sim_tpot_mean_s=sim["tpot_s"]["mean"], sim_makespan_s=sim["duration_s"])
        print(f"  {rows[-1]['system']}: {rows[-1]['tokens_per_s']:.0f} tok/s", flush=True)
    base = rows[0]["tokens_per_s"]

    def sim_cell(r: dict, key: str, fmt: str, scale: float = 1.0) -> str:
        return format(scale * r[key], fmt) if key in r else "-"

    print()
    print("| system | output tokens | makespan (s) | tokens/s | tokens/s sim. | vs hf-sequential | TTFT mean (s) | "
          "TTFT sim. (s) | TTFT p90 (s) | TPOT mean (ms) | TPOT sim. (ms) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        r["speedup_vs_hf_sequential"] = r["tokens_per_s"] / base
        print(f"| {r['system']} | {r['output_tokens']} | {r['makespan_s']:.2f} | {r['tokens_per_s']:.0f} | "
              f"{sim_cell(r, 'sim_tokens_per_s', '.0f')} | {r['speedup_vs_hf_sequential']:.1f}x | "
              f"{r['ttft_mean_s']:.3f} | {sim_cell(r, 'sim_ttft_mean_s', '.3f')} | {r['ttft_p90_s']:.3f} | "
              f"{1000 * r['tpot_mean_s']:.1f} | {sim_cell(r, 'sim_tpot_mean_s', '.1f', 1000)} |")
    engines = [r for r in rows if r["system"].startswith("engine:")]
    if engines:
        best = max(engines, key=lambda r: r["tokens_per_s"])
        verdict = "met" if best["speedup_vs_hf_sequential"] >= 4 else "NOT met"
        print(f"\nbest engine plan {best['system']}: {best['speedup_vs_hf_sequential']:.1f}x one-at-a-time generate "
              f"(target >= 4x: {verdict})")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
