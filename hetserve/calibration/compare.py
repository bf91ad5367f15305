"""``hetserve compare``: the same requests against the live server and the simulator, side by side.

The served side starts the plan's engine behind the OpenAI-compatible server, warms it with one
short request per replica, replays a slice of a trace through the ``openai`` client (every request
generates exactly its trace output length: ``ignore_eos``) and times every request at the client.
The simulated side plays the same requests
(same arrival offsets, prompt and output lengths) against the same plan with the same policies and
batching knobs the server ran with (placement, KV route, token budget, sequence cap, each replica's
actual KV pool in blocks) and the cost model calibrated to this machine (``--efficiency``: the
efficiency factors and the per-request HTTP/tokenisation/SSE overhead of ``hetserve calibrate``).

Output: a table of mean / p50 / p90 / p99 of TTFT, TPOT and E2E and the output throughput, served
vs simulated with their ratio; one figure with both CDFs per metric; the table as JSON. Beside it,
where the time goes (``hetserve.calibration.step_compare``): the engine steps of both sides per replica (their
batches, spans and token intervals, and the cost model's time for the served batches) and the cores
each served process kept busy.

The machine's speed drifts on a shared VM (tens of percent within minutes), so the calibration's
machine is not the served run's: with a calibration that holds a speed reading, ``compare`` reads
the speed probe again just before and after serving and scales the calibrated times by the ratio
to the power ``speed_weight`` (``runtime.speed_probe.SPEED_WEIGHT``: the part of the ratio that
carries to the workers; ``speed_correction=False`` / ``--no-speed-correction``: as calibrated). A
calibration of a GPU engine is taken as calibrated: the probe is a CPU engine's speed index
(``runtime.calibration_file.speed_reference``).
The table as calibrated is kept beside it (``info["speed"]``).

``serve_twice`` / ``--serve-twice`` replays the same requests a second time on the same server once
the first run is measured, and keeps the second run against the first (``info["served_again"]``):
the machine's own spread between two runs, which bounds how close any prediction can be held.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hetserve.calibration.probes import PROBE_THREADS
from hetserve.calibration.speed_probe import SPEED_WEIGHT
from hetserve.policies.placement import DEFAULT_PLACEMENT
from hetserve.sim.metrics import latency_stats

METRICS = ("ttft_s", "tpot_s", "e2e_s")
STATS = ("mean", "p50", "p90", "p99")
# Cores other processes may keep busy before a served figure is called disturbed: a quiet machine's
# daemons and the shell stay well under it, one CPU-bound neighbour (a test run, a build) is far over.
OTHERS_DISTURB = 0.15
# the prediction target: a simulated figure within ±15 % of the served one
BAND = 0.15
# the speed probe before and after serving (runtime.speed_probe): readings of SPEED_READING_S each,
# SPEED_READINGS a side; the slow-down is from the median of them all, so a blip of the machine's
# speed on one side (seen: a 2 s slow spell before a cell, 1.4x) does not price the whole cell
SPEED_READINGS, SPEED_READING_S = 5, 0.5


@dataclass(frozen=True)
class CompareOptions:
    plan: Any  # Plan or path
    model_dir: str
    cluster: Any = None  # Cluster, preset or path; None: the plan's
    workload: str = "azure-conv"
    workload_class: str | None = None
    rate: float | None = None  # requests/s (None: the trace's own)
    num_requests: int = 24
    start: int = 0  # first request of the trace
    max_input: int | None = 256
    max_output: int | None = 32
    efficiency: str | None = None  # calibration file (hetserve calibrate -o)
    placement: str = DEFAULT_PLACEMENT
    route: str = "flow"
    seed: int = 0
    prefill_mode: str = "mixed"  # the engine's and the simulator's: "mixed" | "chunked"
    chunk_tokens: int = 512  # chunked prefill: tokens per step, decode tokens included
    kv_admission: str = "reserve"  # both sides: "reserve" | "paged" (policies.kv_admission)
    # read the machine's speed just before and after serving and scale the calibrated times by its
    # ratio to the calibration's reading, to the power speed_weight (runtime.speed_probe; a
    # calibration without one: no change)
    speed_correction: bool = True
    speed_weight: float = SPEED_WEIGHT  # how much of the probe's ratio the times take, as a power
    # replay the same requests a second time on the same server (after the first run's measurements):
    # how far two served runs of one cell lie apart is the noise any prediction of them meets
    serve_twice: bool = False
    progress: Any = None  # told each phase, progress(phase): serving, replaying, simulating


@dataclass
class Comparison:
    table: dict[str, dict[str, float]]  # "ttft_s.mean" -> {"served", "simulated", "ratio"}
    served: dict[str, np.ndarray]  # per request, seconds
    simulated: dict[str, np.ndarray]
    info: dict[str, Any]
    # (plan, cluster, model spec, requests, engine config, KV pools, efficiency, request overhead,
    # served summary): what a benchmark needs to simulate the same run again with other options
    context: tuple = ()
    served_steps: list = field(default_factory=list)  # the served run's engine steps (step_compare.StepRow)

    def to_json(self) -> dict[str, Any]:
        """The table, the run's facts and the per-request figures the table and the CDFs are of
        (``served``: measured, ``simulated``: predicted; each metric in request order, TPOT of the
        requests of two or more tokens), so every figure can be computed again from the file."""
        return {"table": self.table, "info": self.info,
                "per_request": {"served": per_request_json(self.served), "simulated": per_request_json(self.simulated)}}

    def save(self, out_dir: str | Path) -> list[Path]:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        path = out / "compare.json"
        path.write_text(json.dumps(_null_for_nan(self.to_json()), indent=2) + "\n")
        return [path, plot_cdfs(self, out / "compare_cdf.png")]


def _null_for_nan(x: Any) -> Any:
    """``x`` with every NaN (a figure no request had, a ratio of none) and infinity (a simulated
    request that never finished) as None: JSON's null, where ``json`` would write NaN or Infinity,
    which JSON does not have."""
    if isinstance(x, dict):
        return {k: _null_for_nan(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_null_for_nan(v) for v in x]
    return None if isinstance(x, float) and not np.isfinite(x) else x


def _stats(x: np.ndarray) -> dict[str, float]:
    """``latency_stats`` of the finite values, NaN where there are none (a ratio of NaN reads as none)."""
    return {k: float("nan") if v is None else v for k, v in latency_stats(x[np.isfinite(x)]).items()}


def table_of(served: dict[str, np.ndarray], simulated: dict[str, np.ndarray], served_tps: float,
             simulated_tps: float) -> dict[str, dict[str, float]]:
    """Served vs simulated per statistic, with the ratio simulated / served."""
    rows = {"throughput_tokens_per_s": (served_tps, simulated_tps)}
    for m in METRICS:
        a, b = _stats(served[m]), _stats(simulated[m])
        for s in STATS:
            rows[f"{m}.{s}"] = (a[s], b[s])
    return {k: {"served": v, "simulated": w, "ratio": (w / v) if v else float("nan")} for k, (v, w) in rows.items()}


def compare(opts: CompareOptions) -> Comparison:
    """Serve, replay, simulate; see the module docstring."""
    from hetserve.planner.plan import Plan, load_plan_cluster
    from hetserve.calibration.probes import machine_info
    from hetserve.calibration.file import calibration_warnings, speed_reference
    from hetserve.calibration.speed_probe import SpeedProbe, combine, slowdown, weighted
    from hetserve.serve.launch import ServeOptions, start_server
    from hetserve.serve.loadgen import LoadRequest, replay, requests_from_workload, summarize
    from hetserve.specs.cluster import Cluster
    from hetserve.planner.validate import check_runnable
    from hetserve.specs.model import load_model, load_model_as
    from hetserve.specs.workload import load_workload
    from hetserve.calibration.step_compare import (cpu_utilisation, machine_busy_cpu_s, other_cores_busy, process_cpu_s,
                                       served_rows)

    plan = opts.plan if isinstance(opts.plan, Plan) else Plan.load(opts.plan)
    cluster = opts.cluster if isinstance(opts.cluster, Cluster) else load_plan_cluster(
        plan, "<plan>" if isinstance(opts.plan, Plan) else str(opts.plan), opts.cluster)
    spec = load_model_as(opts.model_dir, plan.model)
    trace = load_workload(opts.workload)
    if opts.workload_class:
        trace = trace.of_class(opts.workload_class)
    if opts.rate:
        trace = trace.with_rate(opts.rate, source=opts.workload)
    requests = requests_from_workload(trace, opts.num_requests, max_input=opts.max_input,
                                      max_output=opts.max_output, seed=opts.seed, start=opts.start)
    at_calibration, speed_note = speed_reference(opts.efficiency, opts.speed_correction, spec)
    warnings = calibration_warnings(opts.efficiency, map(cluster.device, plan.devices), spec)
    # the plan against the cluster and the checkpoint before anything is served, in serve's words
    named = f"{opts.plan} (planned for {plan.model})" if isinstance(opts.plan, (str, Path)) else f"the plan for {plan.model}"
    check_runnable(plan, cluster, load_model(str(opts.model_dir)), f"{named} with --model {opts.model_dir}")
    say = opts.progress or (lambda phase: None)
    probe = SpeedProbe(opts.model_dir) if at_calibration else None  # loaded before serving starts
    load_before = os.getloadavg()[0]
    serve_opts = ServeOptions(plan=plan, cluster=cluster, model_dir=str(opts.model_dir), placement=opts.placement,
                              route=opts.route, seed=opts.seed,
                              engine_options={"prefill_mode": opts.prefill_mode, "chunk_tokens": opts.chunk_tokens,
                                              "kv_admission": opts.kv_admission,
                                              "threads_per_worker": PROBE_THREADS})
    say(f"starting the server ({len(plan.replicas)} replicas)")
    with start_server(serve_opts) as server:
        engine = server.deployment.engine
        pools = {rid: s.blocks.capacity_tokens for rid, s in engine.schedulers.items()}
        cfg = engine.config
        model_name = server.deployment.coordinator.model_name
        # The timed replay meets a warm server: one short request per replica goes first. A fresh
        # server's first request pays once for what the simulator never prices (the client's
        # connection, the workers' first kernels): on one H200 it was each 48-request replay's p99
        # TTFT, 250-380 ms against 20-40 ms simulated (examples/calibrations/README.md).
        replay(server.url, model_name, [LoadRequest(0.0, [65] * 16, 2) for _ in plan.replicas], ignore_eos=True)
        engine.loop.step_times = []  # appended by the coordinator thread, read once it is done
        speed_before = probe.readings(SPEED_READINGS, SPEED_READING_S) if probe else []  # the workers idle, started
        pids = {"front end": os.getpid(), **engine.workers.pids}
        cpu0, t0 = {k: process_cpu_s(p) for k, p in pids.items()}, time.monotonic()
        machine0 = machine_busy_cpu_s()
        say(f"serving {len(requests)} requests")
        results = replay(server.url, model_name, requests, ignore_eos=True)
        wall = time.monotonic() - t0
        cpu = cpu_utilisation(cpu0, {k: process_cpu_s(p) for k, p in pids.items()}, wall)
        others = other_cores_busy(cpu, machine0, machine_busy_cpu_s(), wall)
        served_steps = served_rows(engine.loop.step_times)
        # after the CPU readings: the probe's own CPU is not the served run's
        speed = (speed_before, probe.readings(SPEED_READINGS, SPEED_READING_S)) if probe else ()
        again = replay(server.url, model_name, requests, ignore_eos=True) if opts.serve_twice else None
    load_after = os.getloadavg()[0]
    summary = summarize(results)
    served = _served_of(results, summary)

    measured = slowdown(combine(speed[0] + speed[1]), at_calibration) if speed else 1.0
    slow = weighted(measured, opts.speed_weight)
    efficiency, overhead, sim_kw = calibrated_inputs(opts.efficiency, slow)
    contention, handoff = sim_kw.get("contention_slowdown", 1.0), sim_kw.get("link_overhead_s", 0.0)
    say(f"simulating the same {len(requests)} requests")
    res, steps_info = simulate_with_steps(plan, cluster, spec, requests, opts, cfg, pools, efficiency, overhead,
                                          served_steps, **sim_kw)
    table = table_against(served, summary["throughput_tokens_per_s"], res)
    served_again = None
    if again is not None:
        summary_again = summarize(again)
        per_request = _served_of(again, summary_again)
        served_again = {"table": table_of(served, per_request, summary["throughput_tokens_per_s"],
                                          summary_again["throughput_tokens_per_s"]),
                        "per_request": per_request_json(per_request),
                        "throughput_tokens_per_s": summary_again["throughput_tokens_per_s"]}
    speed_info = None
    if speed:
        # the same simulation at the calibration's speed: what the correction changed
        res0 = simulate_calibrated(plan, cluster, spec, requests, opts, cfg, pools, opts.efficiency)
        # "slowdown": the probe's ratio as measured (replays weight it again, bench_predict --replay)
        speed_info = {"slowdown": round(measured, 4), "applied": round(slow, 4), "weight": opts.speed_weight,
                      "at_calibration": at_calibration.to_dict(),
                      "before": combine(speed[0]).to_dict(), "after": combine(speed[1]).to_dict(),
                      "readings": [r.to_dict() for r in speed[0] + speed[1]],
                      "table_as_calibrated": table_against(served, summary["throughput_tokens_per_s"], res0)}
    info = {"plan": str(getattr(opts.plan, "name", opts.plan)) if not isinstance(opts.plan, Plan) else plan.algorithm,
            "replicas": {r.id: r.role for r in plan.replicas}, "requests": len(requests),
            "workload": opts.workload, "workload_class": opts.workload_class, "rate": opts.rate,
            "placement": opts.placement, "route": opts.route, "efficiency": opts.efficiency,
            "request_overhead_s": overhead, "kv_handoff_overhead_s": handoff, "contention_slowdown": contention,
            "frontend_cpu_s": {k: sim_kw.get(f"frontend_{k}_cpu_s", 0.0) for k in ("request", "step", "token")},
            "prompt_tokens": [len(r.prompt) for r in requests], "steps": steps_info, "cores_busy": cpu,
            "other_cores_busy": None if others is None else round(others, 3),
            "speed": speed_info, "served_again": served_again, "kv_pools": pools, "token_budget": cfg.max_batched_tokens,
            "prefill_mode": cfg.prefill_mode, "chunk_tokens": cfg.chunk_tokens,
            "kv_admission": {"served": cfg.kv_admission, "simulated": res.info["kv_admission"]},
            "max_num_seqs": cfg.max_num_seqs, "load_avg_1m": [round(load_before, 2), round(load_after, 2)],
            "machine": machine_info(),
            "calibration_warnings": warnings, "served_source": "measured at the openai client on this machine",
            "simulated_source": _simulated_source(opts.efficiency, res.info["pricing"], slow if speed else None,
                                                  speed_note, opts.speed_weight)}
    return Comparison(table, served, simulated_of(res), info,
                      (plan, cluster, spec, requests, cfg, pools, efficiency, overhead, summary, contention),
                      served_steps)


def simulate_with_steps(plan, cluster, spec, requests, opts: CompareOptions, cfg, pools: dict[str, int], efficiency,
                        overhead: float, served_steps: list, rows_out: dict | None = None, **overrides):
    """``simulate_side`` with its replicas' steps traced: (result, the step tables of both sides:
    ``step_compare.summarise`` of ``served_steps`` with the cost model's time for each served
    batch, and of the simulated steps). ``rows_out``: also filled with the rows themselves
    (``served``, ``model_s``: the cost model's time for each served row, ``simulated``), for a
    breakdown finer than the tables (``bench/predict/steps.py``)."""
    from hetserve.calibration.step_compare import simulated_rows, step_model, summarise

    sim = simulator_for(plan, cluster, spec, requests, opts, cfg, pools, efficiency, overhead, **overrides)
    for rep in sim.replicas:
        rep.trace = []
    res = sim.run()
    model_time = step_model(sim.cost, {r.id: r.layout for r in sim.replicas})
    simulated = simulated_rows(sim.replicas, lambda i: len(requests[i].prompt))
    if rows_out is not None:
        rows_out.update(served=served_steps, model_s=[model_time(r) for r in served_steps], simulated=simulated)
    return res, {"served": summarise(served_steps, model_time), "simulated": summarise(simulated)}


def _served_of(results, summary: dict) -> dict[str, np.ndarray]:
    """The replay's per-request TTFT, TPOT (requests of two or more tokens) and E2E; a failed request
    fails the comparison (a served run that lost requests is no measurement of the plan)."""
    if summary["errors"]:
        raise RuntimeError(f"served requests failed: {summary['errors']}")
    return {"ttft_s": np.array([r.ttft_s for r in results]), "e2e_s": np.array([r.e2e_s for r in results]),
            "tpot_s": np.array([r.tpot_s for r in results if r.tpot_s is not None])}


def simulated_of(res) -> dict[str, np.ndarray]:
    """A simulation's per-request TTFT, TPOT (requests of two or more tokens) and E2E."""
    return {"ttft_s": res.ttft, "e2e_s": res.e2e, "tpot_s": res.tpot[res.output_tokens > 1]}


def table_against(served: dict[str, np.ndarray], served_tps: float, res) -> dict[str, dict[str, float]]:
    """``table_of`` the served figures against a simulation's result."""
    return table_of(served, simulated_of(res), served_tps, res.summary()["throughput_tokens_per_s"])


def calibrated_inputs(calibration, slowdown: float = 1.0):
    """What a calibration file sets for simulating a served deployment, its times scaled by
    ``slowdown``: (served efficiency, request overhead, the other ``SimOptions`` fields). ``None``:
    no calibration (default efficiency, no overhead, every field at its default)."""
    from hetserve.calibration.file import served_efficiency, served_sim_options

    kw = served_sim_options(calibration, slowdown)
    overhead = kw.pop("request_overhead_s", 0.0)
    return (served_efficiency(calibration, slowdown) if calibration else None), overhead, kw


def simulate_calibrated(plan, cluster, spec, requests, opts: CompareOptions, cfg, pools: dict[str, int],
                        calibration, slowdown: float = 1.0):
    """``simulate_side`` priced by a calibration file (``calibrated_inputs``) on a machine
    ``slowdown`` times slower than at calibration."""
    efficiency, overhead, kw = calibrated_inputs(calibration, slowdown)
    return simulate_side(plan, cluster, spec, requests, opts, cfg, pools, efficiency, overhead, **kw)


def _simulated_source(efficiency: str | None, pricing: dict[str, str], slow: float | None, note: str | None,
                      weight: float) -> str:
    from hetserve.calibration.file import timings_source

    if not efficiency or slow is None:
        return timings_source(efficiency, pricing) + (f", {note}" if note and efficiency else "")
    return (f"{timings_source(efficiency, pricing)}, its times x{slow:.2f}: the machine's speed probe "
            f"before and after serving vs at calibration, to the power {weight:g}")


def simulate_side(plan, cluster, spec, requests, opts: CompareOptions, cfg, pools: dict[str, int], efficiency,
                  overhead: float, **overrides):
    """The simulator on the replayed requests with the server's policies, batching knobs and KV pools
    (``overrides``: other ``SimOptions`` fields, e.g. bench_predict's naive baseline)."""
    return simulator_for(plan, cluster, spec, requests, opts, cfg, pools, efficiency, overhead, **overrides).run()


def simulator_for(plan, cluster, spec, requests, opts: CompareOptions, cfg, pools: dict[str, int], efficiency,
                  overhead: float, **overrides):
    """``simulate_side``'s ``Simulator``, not run yet (to trace its replicas' steps first)."""
    from hetserve.cost.analytic import CostModel
    from hetserve.sim import SimOptions
    from hetserve.sim.simulator import Simulator
    from hetserve.specs.workload import Workload

    workload = Workload.from_lists("replay", [r.arrival_s for r in requests], [len(r.prompt) for r in requests],
                                   [r.max_tokens for r in requests])
    kw = dict(placement=opts.placement, route=opts.route, seed=opts.seed, token_budget=cfg.max_batched_tokens,
              max_batch=cfg.max_num_seqs, kv_block_tokens=cfg.block_size, kv_capacity_tokens=pools,
              micro_batches=cfg.micro_batches, request_overhead_s=overhead,
              chunked_prefill=cfg.prefill_mode == "chunked", chunk_tokens=cfg.chunk_tokens,
              kv_admission=cfg.kv_admission)
    kw.update(overrides)
    return Simulator(plan, cluster, spec, workload, SimOptions(**kw), CostModel(cluster, spec, efficiency))


def plot_cdfs(c: Comparison, path: str | Path) -> Path:
    """One figure: served and simulated CDFs of TTFT, TPOT and E2E (one panel each)."""
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hetserve.sim.plots import cdf_points

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, m, title in zip(axes, METRICS, ("TTFT", "TPOT", "E2E")):
        for data, label, style in ((c.served[m], "served (measured)", "-"),
                                   (c.simulated[m], "simulated (predicted)", "--")):
            x, y = cdf_points(data[np.isfinite(data)])
            if len(x):
                ax.step(x * 1e3, y, style, where="post", label=label)
        ax.set_xlabel(f"{title} (ms)")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of requests")
    axes[0].legend(loc="lower right")
    fig.suptitle(textwrap.fill(f"served vs simulated ({c.info['requests']} requests; {c.info['simulated_source']})",
                               150), fontsize=9)  # wrapped: a calibration's source runs past the figure's width
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def in_band(ratio: float, band: float = BAND) -> bool:
    """Whether a ratio (simulated / served, or one served run / another) lies within ±``band`` of 1."""
    return abs(ratio - 1) <= band


def within_band(table: dict[str, dict[str, float]], band: float = BAND) -> int:
    """Figures of a ``table_of`` table whose ratio lies within ±``band`` of 1."""
    return sum(in_band(row["ratio"], band) for row in table.values())


def per_request_json(figures: dict[str, np.ndarray]) -> dict[str, list[float]]:
    """Per-request figures (``served`` / ``simulated``) as plain lists, for a JSON file."""
    return {k: [float(x) for x in v] for k, v in figures.items()}
