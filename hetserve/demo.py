"""``make demo``: the main job on the bundled examples, end to end.

Part 1 — predict: plan Llama-2-70B on HexGen-2's heterogeneous setting 1 (20 GPUs of four
types) and simulate the whole Azure conversation trace against the plan.

Part 2 — run it for real, on this machine: calibrate the cost model to this CPU, plan a tiny
model on the ``demo-tiny`` pool (worker slots small enough that one replica needs two of them),
serve the plan (prefill and decode replicas as local worker processes behind the OpenAI-
compatible endpoint), replay a slice of the Azure trace through the official ``openai`` client,
and print the served TTFT / TPOT / throughput beside the simulator's prediction for the same
plan and requests.

Everything lands in ``demo-out/``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from hetserve.cli.main import main as cli

OUT = Path(os.environ.get("HETSERVE_DEMO_OUT", "demo-out"))
console = Console()


def step(title: str, argv: list[str]) -> None:
    console.rule(f"[bold]{title}[/]")
    console.print(f"[dim]$ hetserve {' '.join(argv)}[/]")
    code = cli(argv)
    if code:
        console.print(f"[red]step failed with exit code {code}[/]")
        sys.exit(code)


def predict_large_pool() -> None:
    plan = OUT / "het1-llama70b-plan.json"
    step("1. plan Llama-2-70B on HexGen-2 heterogeneous setting 1",
         ["plan", "--cluster", "hexgen2-het1", "--model", "llama-2-70b", "--workload", "azure-conv",
          "--time-limit", "30", "-o", str(plan)])
    step("2. simulate the whole Azure conversation trace (19,366 requests, 58 min) against it",
         ["simulate", "--plan", str(plan), "--workload", "azure-conv", "--slo-ttft", "10", "--slo-tpot", "0.2",
          "-o", str(OUT / "het1-sim")])


def serve_tiny_model(n_requests: int = 24, max_input: int = 256, max_output: int = 32, rate: float = 2.0) -> None:
    from hetserve.cost.analytic import CostModel, load_efficiency
    from hetserve.planner.plan import Plan
    from hetserve.serve.launch import ServeOptions, start_server
    from hetserve.serve.loadgen import replay, requests_from_workload, summarize
    from hetserve.sim import SimOptions, simulate
    from hetserve.specs.cluster import load_cluster
    from hetserve.specs.model import load_model
    from hetserve.specs.workload import Workload, load_workload

    model_dir, plan_path = OUT / "tiny-llama", OUT / "tiny-plan.json"
    step("3. the small pool: 4 worker slots, two GPU types, two boxes", ["describe", "cluster", "demo-tiny"])
    step("4. a tiny random-weight Llama (GQA) checkpoint",
         ["make-model", "--arch", "llama", "--layers", "8", "--hidden", "256", "--heads", "4", "--kv-heads", "1",
          "--ffn", "768", "-o", str(model_dir)])
    calibration = OUT / "calibration.json"
    step("5. calibrate the cost model to this CPU (efficiency relative to the RTX 4090 datasheet)",
         ["calibrate", "--model", str(model_dir), "--gpu", "RTX-4090", "-o", str(calibration)])
    step("6. plan the pool for this machine (short requests: the tiny model's context is 1,024 tokens)",
         ["plan", "--cluster", "demo-tiny", "--model", str(model_dir), "--workload", "azure-conv",
          "--workload-class", "LPLD", "--efficiency", str(calibration), "--disaggregated", "-o", str(plan_path)])
    plan, cluster, spec = Plan.load(plan_path), load_cluster("demo-tiny"), load_model(model_dir)
    efficiency = load_efficiency(calibration)

    trace = load_workload("azure-conv").of_class("LPLD").with_rate(rate)
    requests = requests_from_workload(trace, n_requests, max_input=max_input, max_output=max_output)
    console.rule(f"[bold]7. serve the plan (prefill and decode replicas as worker processes) and replay {n_requests} Azure requests through the openai client[/]")
    with start_server(ServeOptions(plan=plan, cluster=cluster, model_dir=str(model_dir), router="jsq")) as server:
        console.print(f"serving on {server.url} — replaying at {rate} req/s …")
        results = replay(server.url, model_dir.name, requests)
    served = summarize(results)

    workload = Workload.from_lists("azure-slice", [r.arrival_s for r in requests],
                                   [len(r.prompt) for r in requests], [r.max_tokens for r in requests])
    predicted = simulate(plan, cluster, spec, workload, SimOptions(placement="jsq", progress=False),
                         cost=CostModel(cluster, spec, efficiency)).summary()

    console.rule("[bold]8. served vs simulated, same plan and requests[/]")
    t = Table("metric", "served", "simulated", "sim / served")
    rows = [("completed", served["completed"], predicted["completed"]),
            ("output tokens/s", served["throughput_tokens_per_s"], predicted["throughput_tokens_per_s"])]
    for key in ("ttft_s", "tpot_s", "e2e_s"):
        for stat in ("mean", "p50", "p90"):
            rows.append((f"{key[:-2].upper()} {stat} (ms)", served[key][stat] * 1e3, predicted[key][stat] * 1e3))
    for name, s, p in rows:
        ratio = f"{p / s:.2f}" if s else "-"
        t.add_row(name, f"{s:,.1f}" if isinstance(s, float) else str(s), f"{p:,.1f}" if isinstance(p, float) else str(p),
                  ratio)
    console.print(t)
    if served["errors"]:
        console.print(f"[red]errors: {served['errors']}[/]")
        sys.exit(1)


def main() -> None:
    OUT.mkdir(exist_ok=True)
    predict_large_pool()
    serve_tiny_model()
    console.rule("[bold green]demo done[/] — outputs in " + str(OUT))


if __name__ == "__main__":
    main()
