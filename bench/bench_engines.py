"""What each engine's rules cost: hexgen2 plans under vLLM's and SGLang's rules beside unrestricted ones.

    .venv/bin/python -m bench.bench_engines                      # het1–het5 + the 48-GPU pool, 20 s per plan
    .venv/bin/python -m bench.bench_engines --time-limit 8 --pools hexgen2-het1 --json out.json

For each pool: llama-2-70b on the azure-conv trace, hexgen2 with the same seed and time limit under
``--engine hetserve`` (unrestricted), ``vllm`` and ``sglang``. Printed: each plan's estimated
tokens/s (cost model), its share of the unrestricted plan's, the bound (the tightest of the three
plans' upper bounds: all bound the same pool), and what exporting does: every engine plan's bundle
is written and its devices checked (``Bundle.check``), and the unrestricted plan is exported to
each engine, which refuses it when it breaks a rule (the first replica and rule shown).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parent.parent
POOLS = ["hexgen2-het1", "hexgen2-het2", "hexgen2-het3", "hexgen2-het4", "hexgen2-het5",
         str(ROOT / "experiments" / "pools" / "placement-3site-48.yaml")]
ENGINES = ("hetserve", "vllm", "sglang")


def run_pool(pool: str, time_limit: float, seed: int) -> dict:
    from hetserve.errors import PlanError
    from hetserve.export import build_bundle
    from hetserve.export.rules import violations
    from hetserve.planner import ALGORITHMS, PlanOptions
    from hetserve.planner.objectives import plan_for
    from hetserve.specs.cluster import load_cluster
    from hetserve.specs.model import load_model
    from hetserve.specs.workload import load_workload

    cluster, model, workload = load_cluster(pool), load_model("llama-2-70b"), load_workload("azure-conv")
    row: dict = {"pool": cluster.name, "devices": len(cluster)}
    bounds = []
    for engine in ENGINES:
        t = time.perf_counter()
        plan = plan_for(ALGORITHMS["hexgen2"], cluster, model, workload,
                        PlanOptions(seed=seed, time_limit_s=time_limit, engine=engine))
        e = plan.estimate
        row[engine] = {"tokens_per_s": round(e["throughput_tokens_per_s"], 1), "wall_s": round(time.perf_counter() - t, 1),
                       "replicas": len(plan.replicas), "disaggregated": plan.is_disaggregated}
        if e.get("upper_bound_tokens_per_s"):
            bounds.append(e["upper_bound_tokens_per_s"])
        if engine == "hetserve":
            free = plan
            continue
        assert violations(plan, engine) == [], (engine, violations(plan, engine))
        build_bundle(plan, cluster, engine, "/models/llama-2-70b", model.num_layers)  # checks every device
        row[engine]["bundle"] = "ok"
        try:
            build_bundle(free, cluster, engine, "/models/llama-2-70b", model.num_layers)
            row[engine]["unrestricted_plan"] = "runs"
        except PlanError:
            first = violations(free, engine)[0]
            row[engine]["unrestricted_plan"] = f"refused ({len(violations(free, engine))} rules; first: {first})"
    row["bound_tokens_per_s"] = round(min(bounds), 1) if bounds else None
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time-limit", type=float, default=20.0, help="seconds per plan (default 20)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pools", default=",".join(POOLS), help="comma-separated presets or cluster files")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    rows = []
    print(f"llama-2-70b, azure-conv, hexgen2, --time-limit {args.time_limit:g} s per plan, seed {args.seed}")
    print(f"{'pool':<22}{'GPUs':>5}{'unrestricted':>14}{'vllm':>18}{'sglang':>18}{'bound':>10}")
    for pool in args.pools.split(","):
        r = run_pool(pool, args.time_limit, args.seed)
        rows.append(r)
        base = r["hetserve"]["tokens_per_s"] or 1.0
        cell = lambda e: f"{r[e]['tokens_per_s']:,.0f} ({r[e]['tokens_per_s'] / base:.0%})"  # noqa: E731
        print(f"{r['pool']:<22}{r['devices']:>5}{r['hetserve']['tokens_per_s']:>14,.0f}{cell('vllm'):>18}"
              f"{cell('sglang'):>18}{r['bound_tokens_per_s'] or 0:>10,.0f}", flush=True)
        for e in ("vllm", "sglang"):
            print(f"    {e}: bundle {r[e]['bundle']}; the unrestricted plan: {r[e]['unrestricted_plan']}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
