"""``make demo``: the main job on the bundled examples, end to end.

Part 1 — predict: plan Llama-2-70B on HexGen-2's heterogeneous setting 1 (20 GPUs of four
types) and simulate the whole Azure conversation trace against the plan.

Part 2 — run it for real, on this machine: calibrate the cost model to this CPU, plan a tiny
model on the ``demo-tiny`` pool (worker slots small enough that one replica needs two of them),
and end with ``hetserve compare``: serve the plan (prefill and decode replicas as local worker
processes behind the OpenAI-compatible endpoint), replay a slice of the Azure trace through the
official ``openai`` client, simulate the same requests with the same policies, batching knobs and
KV pools, and print served vs simulated TTFT / TPOT / E2E (mean, p50, p90, p99) and throughput,
with both CDFs in ``demo-out/compare/compare_cdf.png`` and the table in ``compare.json``. The
requests are served a second time on the same server (``--serve-twice``), so the table also says how
far two served runs lie apart: the closest any prediction of one run can be held.

Everything lands in ``demo-out/``.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from rich.console import Console

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


HERE_POOL = "demo-tiny-here"


def usable_cores() -> int:
    """The cores this process may run on: its affinity mask where the OS has one (a container given 2
    of a host's 16 CPUs has 2), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def this_machines_pool(out: Path = OUT) -> Path:
    """``demo-tiny`` as it runs here: its two boxes' four worker slots are processes of this one
    computer, sharing its cores (``cpu_cores``, ``cpu_host``), which the simulator then counts
    (``sim.hosts``) and the cost model prices as CPU slots: under a calibration every slot at this
    CPU's measured speed, its GPU type setting its price alone. Left as bundled (GPUs in two boxes),
    the simulator would give each slot hardware of its own, and a decode step beside a prompt,
    which waits for a core here, would come out at half its served time."""
    import yaml

    from hetserve.specs.cluster import preset_path

    cores = usable_cores()
    pool = yaml.safe_load(preset_path("demo-tiny").read_text())
    # its own name, no preset's: a plan made on it records this file, which a later `serve` / `compare`
    # without --cluster runs on (the file gone, they stop naming it); a plan without that record stops
    # on the name. Neither ever quietly takes the bundled GPU preset
    pool["name"] = HERE_POOL
    for m in pool["machines"]:
        m.update(cpu_cores=cores, cpu_host="this-computer")
    pool["assumptions"] += (f" Here: the slots are processes of this computer, sharing its {cores} cores; a"
                            " calibration prices every slot at this CPU's speed, its GPU type at its price alone.")
    path = out / f"{HERE_POOL}.yaml"
    path.write_text(yaml.safe_dump(pool, sort_keys=False))
    return path


def serve_tiny_model(n_requests: int = 24, max_input: int = 256, max_output: int = 32, rate: float = 2.0) -> None:
    model_dir, plan_path = OUT / "tiny-llama", OUT / "tiny-plan.json"
    pool = str(this_machines_pool())
    step("3. the small pool: 4 worker slots, two GPU types, two boxes, all on this computer's cores",
         ["describe", "cluster", pool])
    if (model_dir / "config.json").is_file():  # a rerun: the checkpoint this demo made before is made afresh
        shutil.rmtree(model_dir)
    step("4. a tiny random-weight Llama (GQA) checkpoint",
         ["make-model", "--arch", "llama", "--layers", "8", "--hidden", "256", "--heads", "4", "--kv-heads", "1",
          "--ffn", "768", "-o", str(model_dir)])
    calibration = OUT / "calibration.json"
    step("5. calibrate the cost model to this CPU (efficiency relative to the RTX 4090 datasheet)",
         ["calibrate", "--model", str(model_dir), "--gpu", "RTX-4090", "-o", str(calibration)])
    step("6. plan the pool for this machine (short requests: the tiny model's context is 1,024 tokens)",
         ["plan", "--cluster", pool, "--model", str(model_dir), "--workload", "azure-conv",
          "--workload-class", "LPLD", "--efficiency", str(calibration), "--disaggregated", "-o", str(plan_path)])
    step(f"7. serve the plan, replay {n_requests} Azure requests through the openai client (twice: how far two "
         "served runs lie apart), simulate the same requests: served vs simulated",
         ["compare", "--plan", str(plan_path), "--model", str(model_dir), "--cluster", pool,
          "--workload", "azure-conv", "--workload-class", "LPLD", "--rate", str(rate), "-n", str(n_requests),
          "--max-input", str(max_input), "--max-output", str(max_output), "--efficiency", str(calibration),
          "--serve-twice", "-o", str(OUT / "compare")])


def main(argv: list[str] | None = None) -> None:
    import argparse

    # no options: --help says what it runs and where it writes, rather than starting a run of minutes
    argparse.ArgumentParser(prog="python examples/demo.py", description=__doc__.split("\n\n")[0].replace("``", ""),
                            epilog="HETSERVE_DEMO_OUT sets the output folder (default demo-out).").parse_args(argv)
    OUT.mkdir(exist_ok=True)
    predict_large_pool()
    serve_tiny_model()
    console.rule("[bold green]demo done[/] — outputs in " + str(OUT))


if __name__ == "__main__":
    main()
