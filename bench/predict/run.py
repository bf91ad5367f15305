"""How well the simulator predicts the served runtime: three plans x two request rates on this machine.

    .venv/bin/python -m bench.predict.run [--requests 48] [--calibration cal.json] [--json out.json]
        [--plans asym-colocated,prefill-decode,pipeline-2] [--fractions 0.2,0.8] [--no-shared-cores]
    .venv/bin/python -m bench.predict.run --replay out.json [--refit] [--frontend-from cal.json]   # no serving

Plans (a tiny random-weight Llama, 8 layers, hidden 256, 4 heads, 2 KV heads; CPU worker slots named RTX 4090):

- ``asym-colocated``  one colocated replica, TP 2 on layers 0-2, then TP 1 on layers 2-8
- ``prefill-decode``  prefill replica on one slot -> decode replica on another (KV hand-off)
- ``pipeline-2``      one colocated replica, two pipeline stages of TP 1 (layers 0-4, 4-8)

The cost model is calibrated again before each plan (``--calibrate-once``: only at the start), so the
calibration sees the load its served cells see. Rates per plan: *light* = 20 % and *near saturation* = 80 % of the plan's capacity, the capacity
being the simulator's throughput in requests/s for a burst of the same requests (calibrated cost
model). Each cell serves the plan, replays the requests (Azure conversation, LPLD class, prompts
<= 128 tokens, outputs <= 32 tokens, ``ignore_eos``) through the ``openai`` client, and simulates
the same requests with the server's policies, batching knobs and KV pools
(``hetserve.calibration.compare``). Reported: served (measured), simulated (calibrated cost model, the
default options; the cluster file says the pool's 4 slots share the 2 cores, so the simulator
counts the busy workers and the front end on them, ``sim.hosts``; ``--no-shared-cores``: each
slot as if alone) and *baseline*
simulated (a naive simulator: prefill pauses decoding, 4,096-token prefill
budget, no request overhead, no shared cores) — each metric's sim / served
ratio and whether it is within +-15 %. The 1-minute load average before and after each cell is
printed: the machine is shared, so the served side is noisy.

The machine's own speed drifts by tens of percent within minutes on a shared VM, so each cell's simulation is priced at the speed the machine's speed probe read just
before and after that cell was served, relative to the calibration's reading
(``runtime.speed_probe``, as ``hetserve compare`` does; the slow-down column, and the hits *as
calibrated* beside; ``--no-speed-correction``: as calibrated).

``--json`` keeps each cell's served figures per request, its served engine steps and its calibration
file's content, so ``--replay FILE`` re-simulates every cell with the code (and options) of now
against the *same* served measurement, step tables included: compare model variants without serving
again (the served side is the noise).

Beside the table it prints the calibration target: how many points of the plans' calibrations
(fitted again by the code of now with ``--replay --refit``) lie within ±10 % (``bench.predict.report``).

``--serve-twice`` replays each cell's requests a second time on the same server, after the first
run's measurements: the second run against the first is how far two served runs of one cell lie
apart, the noise floor of the ±15 % target (a prediction cannot be held closer than that).

``python -m bench.predict.oracle RUN.json ...`` replays saved runs with each cell's slow-down scaled after the
fact: how many of the misses a better reading of each cell's machine speed would remove;
``python -m bench.predict.occupancy RUN.json ...`` splits each cell's TTFT by what was in flight at each
arrival: the cell's level (idle arrivals) apart from the model's shape; ``python -m bench.predict.steps
RUN.json ...`` splits each cell's served engine steps (decode steps by batch, prompt steps by what
ran beside them) against the cost model and the simulator.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.predict.report import fmt_others, print_cells
from bench.lib.workdir import workdir

CLUSTER = """\
name: bench-predict
machines:
  - {name: m0, gpu: RTX-4090, count: 4}
"""
# --shared-cores: the pool says its slots share this machine's 2 cores (simulated contention)
CLUSTER_SHARED = CLUSTER.replace("count: 4}", "count: 4, cpu_cores: 2}")
# the baseline's slots: no cpu_cores, so (the cost model tells CPU slots from GPUs by it) a pipeline's
# turn-around is priced as on a GPU host here
CLUSTER_BASELINE = CLUSTER


def tiny_model(folder: Path) -> Path:
    """The checkpoint these benchmarks serve, in ``folder``/tiny (the plans' model name): a random-weight
    Llama of 8 layers, hidden 256, 4 heads (2 KV), FFN 768. A replay must make the very model the
    run served; ``bench_frontend``, ``bench_overhead`` and ``probe_rows`` measure on it too."""
    from hetserve.runtime.model.make import make_model

    return make_model(folder / "tiny", "llama", layers=8, hidden=256, heads=4, kv_heads=2, ffn=768)


def plans() -> dict:
    from hetserve.planner.plan import Plan

    def plan(replicas, routes=()):
        return Plan.from_dict({"model": "tiny", "cluster": "bench-predict", "replicas": replicas,
                               "kv_routes": [{"from": a, "to": b, "weight": 1.0} for a, b in routes]})

    st = lambda devs, lo, hi: {"devices": devs, "layers": [lo, hi]}  # noqa: E731
    return {
        "asym-colocated": plan([{"id": "c0", "role": "colocated",
                                 "stages": [st(["m0:0", "m0:1"], 0, 2), st(["m0:2"], 2, 8)]}]),
        "prefill-decode": plan([{"id": "p0", "role": "prefill", "stages": [st(["m0:0"], 0, 8)]},
                                {"id": "d0", "role": "decode", "stages": [st(["m0:1"], 0, 8)]}], [("p0", "d0")]),
        "pipeline-2": plan([{"id": "c0", "role": "colocated", "stages": [st(["m0:0"], 0, 4), st(["m0:1"], 4, 8)]}]),
    }


def capacity_rps(plan, cluster, spec, requests, efficiency, served_options: dict) -> float:
    """Requests/s the simulator gives the plan for a burst of ``requests`` (all at t = 0);
    ``served_options``: the calibration's ``SimOptions`` fields (``served_sim_options``)."""
    from hetserve.cost.analytic import CostModel
    from hetserve.sim import SimOptions, simulate
    from hetserve.specs.workload import Workload

    wl = Workload.from_lists("burst", [0.0] * len(requests), [len(r.prompt) for r in requests],
                             [r.max_tokens for r in requests])
    res = simulate(plan, cluster, spec, wl, SimOptions(kv_capacity_tokens=16384, **served_options),
                   cost=CostModel(cluster, spec, efficiency))
    return len(requests) / float(res.t_finish.max())


def refit_calibration(content: dict, model_dir) -> dict:
    """``content`` (a saved calibration) with its efficiency fitted again from its own measured points
    by today's ``runtime.calibrate.fit`` (the runtime terms kept): a replay then measures today's fit
    on the same measurements."""
    from dataclasses import asdict

    from hetserve.calibration.probes import DECODE_PROMPT, LONG_DECODE_PROMPT
    from hetserve.calibration.calibrate import fit

    by: dict[tuple, dict[int, float]] = {}
    for p in content.get("points", []):
        prompt = p.get("prompt", DECODE_PROMPT if p["phase"] == "decode" else 0)  # files before the long-context probe
        by.setdefault((p["phase"], p.get("stages", 1), p.get("tp", 1), prompt), {})[p["size"]] = p["measured_s"]

    def g(phase: str, stages: int, tp: int, prompt: int | None = None) -> dict[int, float]:
        short = DECODE_PROMPT if phase == "decode" else 0
        return by.get((phase, stages, tp, short if prompt is None else prompt), {})

    http = {int(b): t for b, t in (content.get("http_tpot") or {}).items()}
    cal = fit(str(model_dir), content.get("gpu", "RTX-4090"), g("prefill", 1, 1), g("decode", 1, 1),
              pp_ttft=g("prefill", 2, 1), pp_tpot=g("decode", 2, 1), tp_ttft=g("prefill", 1, 2), tp_tpot=g("decode", 1, 2),
              tpot_long=g("decode", 1, 1, LONG_DECODE_PROMPT), http_tpot=http)
    points = [asdict(p) for p in cal.points]
    runtime = dict(content.get("runtime", {}))
    if http:  # files since the stream's fixed part is measured: its line fitted again too
        runtime["stream_step_overhead_s"], runtime["stream_overhead_s"] = cal.stream_step_overhead_s, cal.stream_overhead_s
    return {**content, "efficiency": asdict(cal.efficiency), "points": points, "runtime": runtime, "refitted": True}


def replay_cells(path: str, shared_cores: bool, console, runtime_from: str | None = None,
                 refit: bool = False, speed_correction: bool = True) -> list[dict]:
    """Re-simulate the cells of a ``--json`` file with the code of now against their served figures
    (the calibration file each cell used: its saved content, or its path where it still exists;
    ``runtime_from``: a calibration file whose front-end terms the cells take instead, to try terms
    measured later on served runs saved before them; ``refit``: each calibration's efficiency fitted
    again from its saved points by today's fit; ``speed_correction``: each cell's calibrated times
    scaled by the slow-down its speed probe read while it was served, weighted as ``compare`` weights
    it now: ``speed_probe.weighted``)."""
    return replay_data(read_run(path), path, shared_cores, console, runtime_from, refit,
                       speed_correction)


def read_run(path: str) -> dict:
    """A ``--json`` file's content; ``.json.gz`` too (the runs kept in ``bench/runs/``)."""
    import gzip

    raw = gzip.decompress(Path(path).read_bytes()) if str(path).endswith(".gz") else Path(path).read_bytes()
    return json.loads(raw)


def replay_quietly(data: dict, source: str, refit: bool = False, keep_rows: bool = False) -> list[dict]:
    """``replay_data`` with the shared cores and nothing printed (the tools that replay saved runs by
    the dozen: ``predict/oracle``, ``predict/occupancy``, ``predict/steps``)."""
    from rich.console import Console

    with open(os.devnull, "w") as quiet:
        return replay_data(data, source, True, Console(file=quiet), refit=refit, keep_rows=keep_rows)


def replay_data(data: dict, source: str, shared_cores: bool, console, runtime_from: str | None = None,
                refit: bool = False, speed_correction: bool = True, keep_rows: bool = False) -> list[dict]:
    """``replay_cells`` of a ``--json`` file's content already read (``source`` names it in messages).
    ``keep_rows``: each cell also gets ``step_rows``, its served and simulated engine steps as
    replayed (``compare.simulate_with_steps``'s ``rows_out``)."""
    # the checkpoint (25 MB) and the calibrations are made again in a folder that goes with the replay:
    # replays run by the hundred while a model is tried, and each once left its folder behind
    with tempfile.TemporaryDirectory(prefix="bench-predict-replay-") as d:
        return _replay_cells(Path(d), data, source, shared_cores, console, runtime_from, refit, speed_correction,
                             keep_rows)


def _replay_cells(tmp: Path, data: dict, source: str, shared_cores: bool, console, runtime_from: str | None,
                  refit: bool, speed_correction: bool, keep_rows: bool = False) -> list[dict]:
    """``replay_data`` in the folder ``tmp``."""

    import numpy as np

    from hetserve.calibration.compare import (CompareOptions, calibrated_inputs, simulate_calibrated, simulate_with_steps,
                                  simulated_of, table_against, table_of)
    from hetserve.runtime.engine_config import EngineConfig
    from hetserve.calibration.speed_probe import weighted
    from hetserve.serve.loadgen import requests_from_workload
    from hetserve.specs.cluster import load_cluster
    from hetserve.specs.model import load_model_as
    from hetserve.specs.workload import load_workload
    from hetserve.calibration.step_compare import rows_from_json

    (tmp / "cluster.yaml").write_text(CLUSTER_SHARED if shared_cores else CLUSTER)
    cluster = load_cluster(str(tmp / "cluster.yaml"))
    model_dir = tiny_model(tmp)
    spec = load_model_as(model_dir, "tiny")
    trace = load_workload("azure-conv").of_class("LPLD")
    cells = []
    for i, cell in enumerate(data["cells"]):
        cal = tmp / f"calibration-{i}.json"
        if cell.get("calibration_data"):
            cal.write_text(json.dumps(cell["calibration_data"]))
        elif Path(cell["calibration"]).exists():
            cal.write_text(Path(cell["calibration"]).read_text())
        else:
            raise SystemExit(f"--replay {source}: cell {i} ({cell['plan']}): its calibration {cell['calibration']} "
                             "is gone and the file does not hold its content")
        if refit:
            cal.write_text(json.dumps(refit_calibration(json.loads(cal.read_text()), model_dir)))
        if runtime_from:
            content, other = json.loads(cal.read_text()), json.loads(Path(runtime_from).read_text())
            content.setdefault("runtime", {}).update({k: v for k, v in other.get("runtime", {}).items()
                                                      if k.startswith("frontend_")})
            cal.write_text(json.dumps(content))
        plan = plans()[cell["plan"]]
        n = int(cell.get("requests", 48))
        requests = requests_from_workload(trace.with_rate(cell["rate"]), n, max_input=128, max_output=32)
        opts = CompareOptions(plan=plan, model_dir=str(model_dir), cluster=cluster, workload_class="LPLD",
                              rate=cell["rate"], num_requests=n, max_input=128, max_output=32, efficiency=str(cal))
        cfg = EngineConfig(**cell.get("engine", {}))
        pools = cell.get("kv_pools") or {r.id: 16384 for r in plan.replicas}
        served = cell.get("served")  # per request (files written since --replay exists)
        # the served engine steps (files written since they are kept): the step tables are made again
        rows = rows_from_json(cell["served_steps"]) if cell.get("served_steps") else None
        kept: dict = {}  # the last simulation's step rows (keep_rows)

        def table_at(slow: float) -> tuple[dict, dict | None, list[float]]:
            """The cell simulated at ``slow``: its table, its step tables, each request's TTFT."""
            steps = None
            if rows is not None:
                eff, overhead, kw = calibrated_inputs(str(cal), slow)
                res, steps = simulate_with_steps(plan, cluster, spec, requests, opts, cfg, pools, eff, overhead,
                                                 rows, kept if keep_rows else None, **kw)
            else:
                res = simulate_calibrated(plan, cluster, spec, requests, opts, cfg, pools, cal, slow)
            ttft = [float(x) for x in res.ttft]
            if served:
                return table_against({k: np.asarray(v, float) for k, v in served["per_request"].items()},
                                     served["throughput_tokens_per_s"], res), steps, ttft
            sim = simulated_of(res)
            fake = table_of(sim, sim, 1.0, res.summary()["throughput_tokens_per_s"])  # an older file: its served column
            return {k: {"served": cell["table"][k]["served"], "simulated": v["simulated"],
                        "ratio": v["simulated"] / cell["table"][k]["served"]} for k, v in fake.items()}, steps, ttft

        speed = cell.get("speed")
        if speed:
            speed = {**speed, "table_as_calibrated": table_at(1.0)[0]}
        # the probe's measured ratio weighted as compare weights it now (runtime.speed_probe.weighted)
        table, steps, ttft = table_at(weighted(speed["slowdown"]) if speed and speed_correction else 1.0)
        # as replayed (the calibration refitted with --refit); each request's arrival and simulated
        # TTFT for the split by what the replica held at its arrival (bench/predict/occupancy.py)
        cells.append({**cell, "table": table, "speed": speed, "steps": steps or cell.get("steps"),
                      "calibration_data": json.loads(cal.read_text()),
                      "arrival_s": [r.arrival_s for r in requests], "simulated_ttft_s": ttft,
                      **({"step_rows": kept} if kept else {})})
    console.print(f"replayed {len(cells)} cells of {source} against their served figures "
                  f"({'shared' if shared_cores else 'separate'} cores)")
    return cells


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=48,
                    help="requests per cell (default 48: 24 left the p90s to two or three requests)")
    ap.add_argument("--calibration", help="calibration file (default: run `hetserve calibrate` first)")
    ap.add_argument("--plans", default="asym-colocated,prefill-decode,pipeline-2")
    ap.add_argument("--fractions", default="0.2,0.8", help="rates as fractions of the simulated capacity")
    ap.add_argument("--json", help="write every cell here")
    ap.add_argument("--shared-cores", action=argparse.BooleanOptionalAction, default=True,
                    help="the pool's slots share 2 cores (cpu_cores: 2, the truth on this machine): the simulator "
                         "counts the busy workers and the front end on them (sim.hosts; default). "
                         "--no-shared-cores: every slot as if it had its own cores, which "
                         "under-predicts every served latency on a machine whose slots share cores")
    ap.add_argument("--replay", metavar="JSON",
                    help="serve nothing: re-simulate the cells of a --json file against their served figures")
    ap.add_argument("--frontend-from", metavar="CAL",
                    help="with --replay: the front end's CPU terms from this calibration file instead of each "
                         "cell's (served runs saved before calibrate measured them)")
    ap.add_argument("--refit", action="store_true",
                    help="with --replay: fit each cell's calibration again from its saved points with today's fit")
    ap.add_argument("--no-speed-correction", dest="speed_correction", action="store_false",
                    help="simulate at the calibration's machine speed (default: scaled by the slow-down the speed "
                         "probe reads before and after each cell, as `hetserve compare` does; a replay uses the "
                         "slow-down its file recorded)")
    ap.add_argument("--serve-twice", action="store_true",
                    help="replay each cell's requests a second time on the same server: the second run against "
                         "the first is the served side's own spread (the noise floor of the ±15 %% target)")
    ap.add_argument("--calibrate-once", action="store_true",
                    help="one calibration at the start (default: calibrate again before each plan, so the "
                         "calibration sees the load the served cells see on a shared machine)")
    args = ap.parse_args()

    from bench.lib.console import wide_console

    console = wide_console()
    if args.replay:
        cells = replay_cells(args.replay, args.shared_cores, console, args.frontend_from, args.refit,
                             args.speed_correction)
        from hetserve.calibration.step_compare import print_steps

        for cell in cells:
            if cell.get("served_steps"):  # the step tables made again by the simulator of now
                console.rule(f"{cell['plan']} at {cell['rate']:.2f} req/s")
                print_steps(cell["steps"]["served"], cell["steps"]["simulated"], console)
        print_cells(cells, f"simulator (now) vs the served figures of {args.replay}", console)
        if args.json:
            Path(args.json).write_text(json.dumps({"cells": cells, "replayed": args.replay}, indent=2) + "\n")
        return 0

    from hetserve.calibration.compare import CompareOptions, compare, per_request_json, simulate_side, table_against
    from hetserve.calibration.file import served_efficiency, served_sim_options
    from hetserve.serve.loadgen import requests_from_workload
    from hetserve.specs.cluster import load_cluster
    from hetserve.specs.model import load_model_as
    from hetserve.specs.workload import load_workload
    from hetserve.calibration.step_compare import rows_to_json

    tmp = workdir("bench-predict-")
    (tmp / "cluster.yaml").write_text(CLUSTER_SHARED if args.shared_cores else CLUSTER)
    cluster = load_cluster(str(tmp / "cluster.yaml"))
    (tmp / "cluster-baseline.yaml").write_text(CLUSTER_BASELINE)
    cluster_baseline = load_cluster(str(tmp / "cluster-baseline.yaml"))
    model_dir = tiny_model(tmp)
    from hetserve.cli.main import main as cli

    def calibrate(name: str) -> str:
        path = str(tmp / f"calibration-{name}.json")
        console.print(f"calibrating: hetserve calibrate --model {model_dir} -o {path}")
        if cli(["calibrate", "--model", str(model_dir), "-o", path]):
            raise SystemExit(1)
        return path

    cal = args.calibration or calibrate("start")
    spec = load_model_as(model_dir, "tiny")
    trace = load_workload("azure-conv").of_class("LPLD")
    base_requests = requests_from_workload(trace, args.requests, max_input=128, max_output=32)
    cells = []
    for name in args.plans.split(","):
        plan = plans()[name]
        if not args.calibration and not args.calibrate_once and name != args.plans.split(",")[0]:
            cal = calibrate(name)
        cap = capacity_rps(plan, cluster, spec, base_requests, served_efficiency(cal), served_sim_options(cal))
        for frac in (float(f) for f in args.fractions.split(",")):
            rate = frac * cap
            opts = CompareOptions(plan=plan, model_dir=str(model_dir), cluster=cluster, workload_class="LPLD",
                                  rate=rate, num_requests=args.requests, max_input=128, max_output=32,
                                  efficiency=cal, speed_correction=args.speed_correction,
                                  serve_twice=args.serve_twice)
            console.rule(f"{name} at {rate:.2f} req/s ({frac:.0%} of the simulated capacity {cap:.2f} req/s)")
            c = compare(opts)
            if c.info.get("steps"):
                from hetserve.calibration.step_compare import print_steps

                print_steps(c.info["steps"]["served"], c.info["steps"]["simulated"], console)
                console.print("cores busy (served): " + ", ".join(f"{k} {v:.2f}" for k, v in c.info["cores_busy"].items())
                              + f"; other processes {fmt_others(c.info.get('other_cores_busy'))}")
            plan_, cluster_, spec_, requests, cfg, pools, eff, ovh, served_summary, _ = c.context
            base = simulate_side(plan_, cluster_baseline, spec_, requests, opts, cfg, pools, eff, 0.0,
                                 prefill_mode="prefill_first", token_budget=4096)
            base_table = table_against(c.served, served_summary["throughput_tokens_per_s"], base)
            cells.append({"plan": name, "rate": rate, "fraction": frac, "load_avg_1m": c.info["load_avg_1m"],
                          "requests": args.requests, "calibration": cal,
                          "calibration_data": json.loads(Path(cal).read_text()),
                          "engine": {"max_num_seqs": cfg.max_num_seqs, "max_batched_tokens": cfg.max_batched_tokens,
                                     "block_size": cfg.block_size, "micro_batches": cfg.micro_batches,
                                     "prefill_mode": cfg.prefill_mode, "chunk_tokens": cfg.chunk_tokens},
                          "kv_pools": pools,
                          "served": {"per_request": per_request_json(c.served),
                                     "throughput_tokens_per_s": served_summary["throughput_tokens_per_s"]},
                          "table": c.table, "baseline_table": base_table, "steps": c.info.get("steps"),
                          "cores_busy": c.info.get("cores_busy"), "other_cores_busy": c.info.get("other_cores_busy"),
                          "speed": c.info.get("speed"), "served_again": c.info.get("served_again"),
                          "served_steps": rows_to_json(c.served_steps)})
    print_cells(cells, f"simulator vs served on this machine ({args.requests} requests per cell; calibrated "
                       f"{'once' if args.calibration or args.calibrate_once else 'before each plan'})", console)
    if args.json:
        Path(args.json).write_text(json.dumps({"cells": cells, "calibration": cal}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
