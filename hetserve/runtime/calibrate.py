"""Calibrate the cost model (and the serving overheads) to the machine the engine runs on.

The cost model prices work with datasheet peaks times ``Efficiency`` fractions. On a machine
whose workers are not the GPUs the cluster file names (the CPU demo, or a new GPU), those
fractions are unknown; this module measures them. It serves a single-stage colocated replica of
the checkpoint on one device (the real engine behind the real HTTP server) and measures

* TTFT of single prompts of several lengths on the engine (prefill: achieved FLOP/s),
* TPOT of decode batches of several sizes on the engine (memory streaming and the fixed
  per-iteration cost: the coordinator's step, the process hop, sampling), and
* the same prompts through HTTP with the ``openai`` client (tokenisation, HTTP and SSE: what a
  served request spends outside the engine, ``request_overhead_s``),

and fits ``Efficiency(compute, memory, step_overhead_s)`` minimising the squared log error of the
cost model over the engine measurements. The fit's error per point is reported: it is the cost
model's error on this machine. The result is one JSON file (``Calibration.save``) that the planner
(``--efficiency``) and the simulator (``--efficiency``: efficiency and request overhead) read,
stamped with the device, the date and the load average during the measurement.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
from scipy.optimize import least_squares

from hetserve.cost.analytic import CostModel, Efficiency
from hetserve.cost.layout import ReplicaLayout, StageLayout
from hetserve.planner.plan import Plan
from hetserve.specs.cluster import Cluster, cluster_from_dict
from hetserve.specs.model import load_model


@dataclass(frozen=True)
class CalibrationPoint:
    phase: str  # "prefill" or "decode"
    size: int  # prompt tokens (prefill) or batch size (decode)
    measured_s: float
    predicted_s: float

    @property
    def error(self) -> float:
        return (self.predicted_s - self.measured_s) / self.measured_s


@dataclass(frozen=True)
class Calibration:
    gpu: str  # the GPU type whose datasheet the efficiency is relative to
    efficiency: Efficiency
    points: tuple[CalibrationPoint, ...]
    request_overhead_s: float = 0.0  # HTTP + tokenisation + SSE per request, outside the engine
    contention_slowdown: float = 1.0  # decode step time with one more busy CPU process / alone
    measured_on: dict = field(default_factory=dict)  # device, cores, date, load average

    @property
    def mean_abs_error(self) -> float:
        return float(np.mean([abs(p.error) for p in self.points]))

    @property
    def max_abs_error(self) -> float:
        return float(max(abs(p.error) for p in self.points))

    def save(self, path: str | Path) -> None:
        """JSON that ``cost.analytic.load_efficiency`` (``plan/simulate --efficiency``) reads; the
        simulator also reads ``runtime.request_overhead_s`` from it (``load_request_overhead``)."""
        Path(path).write_text(json.dumps({
            "gpu": self.gpu, "efficiency": asdict(self.efficiency), "mean_abs_error": self.mean_abs_error,
            "max_abs_error": self.max_abs_error, "runtime": {"request_overhead_s": self.request_overhead_s,
                                                           "contention_slowdown": self.contention_slowdown},
            "measured_on": self.measured_on, "points": [asdict(p) for p in self.points]}, indent=2) + "\n")


def load_request_overhead(path: str | Path) -> float:
    """``runtime.request_overhead_s`` of a calibration file (0 when it has none)."""
    return float(_runtime(path).get("request_overhead_s", 0.0))


def load_contention(path: str | Path) -> float:
    """``runtime.contention_slowdown`` of a calibration file (1 when it has none)."""
    return max(1.0, float(_runtime(path).get("contention_slowdown", 1.0)))


def _runtime(path: str | Path) -> dict:
    data = json.loads(Path(path).read_text())
    return data.get("runtime", {}) if isinstance(data, dict) else {}


def _burn(stop) -> None:  # pragma: no cover - runs in a child process
    """Keep one core busy (pure Python, one thread), as one more worker process computing would."""
    x = 0
    while not stop.is_set():
        for i in range(20000):
            x += i * i


def machine_info() -> dict:
    """Where a measurement was taken: CPU model, cores, date (UTC), load average now."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return {"device": cpu, "cores": os.cpu_count(), "date": datetime.datetime.now(datetime.timezone.utc)
            .strftime("%Y-%m-%d %H:%M UTC"), "load_avg_1m": round(load[0], 2)}


def _one_device_cluster(gpu_name: str) -> Cluster:
    # Memory is left at the GPU's: calibration measures speed, not capacity.
    return cluster_from_dict({"name": "calibration", "machines": [{"name": "cal", "gpu": gpu_name, "count": 1}]})


def _one_device_plan(spec, cluster: Cluster) -> Plan:
    return Plan.from_dict({"model": spec.name, "cluster": cluster.name, "algorithm": "calibration",
                           "replicas": [{"id": "c0", "role": "colocated",
                                         "stages": [{"devices": ["cal:0"], "layers": [0, spec.num_layers]}]}]})


@dataclass
class Measurements:
    ttft: dict[int, float]  # prompt length -> median TTFT on the engine (s)
    tpot: dict[int, float]  # batch size -> median TPOT on the engine (s)
    http_ttft: dict[int, float] = field(default_factory=dict)  # prompt length -> median TTFT through HTTP
    contention: float = 1.0  # TPOT of the largest decode probe beside one busy process / alone
    load_avg: list[float] = field(default_factory=list)  # 1-minute load average during the run


def measure(model_dir: str, gpu_name: str, prompt_lengths=(32, 128, 256, 512), batch_sizes=(1, 4, 16),
            decode_tokens: int = 24, reps: int = 3, serving: bool = True) -> Measurements:
    """Median TTFT per prompt length and median TPOT per batch size on the engine, and (``serving``)
    median TTFT of the same prompts through the HTTP server and the ``openai`` client."""
    from hetserve.runtime.engine import Engine, EngineConfig
    from hetserve.runtime.sampling import SamplingParams

    spec = load_model(model_dir)
    cluster = _one_device_cluster(gpu_name)
    plan = _one_device_plan(spec, cluster)
    rng = np.random.default_rng(0)
    prompt_lengths = [L for L in prompt_lengths if L + decode_tokens < spec.max_context]
    m = Measurements({}, {})
    server = None
    if serving:
        from hetserve.serve.launch import ServeOptions, start_server

        server = start_server(ServeOptions(plan=plan, cluster=cluster, model_dir=str(model_dir),
                                           max_num_seqs=max(batch_sizes)))
        engine = server.deployment.engine
    else:
        engine = Engine.from_plan(plan, cluster, model_dir, EngineConfig(max_num_seqs=max(batch_sizes)))
    try:
        engine.generate([[65] * 8], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        # Rounds over every probe (not every probe's repetitions in a row): on a shared machine the
        # load drifts, and interleaving spreads it over all points instead of biasing some.
        ttft_s: dict[int, list[float]] = {L: [] for L in prompt_lengths}
        tpot_s: dict[int, list[float]] = {b: [] for b in batch_sizes}
        http_s: dict[int, list[float]] = {L: [] for L in prompt_lengths}
        for _ in range(reps):
            for L in prompt_lengths:
                h = engine.submit(rng.integers(32, 127, L).tolist(), SamplingParams(max_tokens=1, ignore_eos=True))
                h.result(timeout=120)
                ttft_s[L].append(h.ttft)
            for b in batch_sizes:
                handles = [engine.submit(rng.integers(32, 127, 16).tolist(),
                                         SamplingParams(max_tokens=decode_tokens, ignore_eos=True)) for _ in range(b)]
                for h in handles:
                    h.result(timeout=120)
                tpot_s[b].append(statistics.median(h.tpot for h in handles))
            m.load_avg.append(os.getloadavg()[0])
            if server is not None:
                from hetserve.serve.loadgen import LoadRequest, replay

                # one client, requests spaced out (each alone on the server), as a replayed trace sends them
                gap = 1.5 * max(ttft_s[L][-1] for L in prompt_lengths) + 0.05
                reqs = [LoadRequest(i * gap, rng.integers(32, 127, L).tolist(), 1) for i, L in enumerate(prompt_lengths)]
                for L, r in zip(prompt_lengths, replay(server.url, Path(model_dir).resolve().name, reqs,
                                                       ignore_eos=True)):
                    http_s[L].append(r.ttft_s)
        # Contention: the largest decode probe again while one more process keeps a core busy (as a
        # second worker slot of the same host would); the ratio to the probe alone is the slow-down.
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        stop = ctx.Event()
        burner = ctx.Process(target=_burn, args=(stop,), daemon=True)
        burner.start()
        try:
            b = max(batch_sizes)
            alone = statistics.median(tpot_s[b])
            busy = []
            for _ in range(reps):
                handles = [engine.submit(rng.integers(32, 127, 16).tolist(),
                                         SamplingParams(max_tokens=decode_tokens, ignore_eos=True)) for _ in range(b)]
                for h in handles:
                    h.result(timeout=120)
                busy.append(statistics.median(h.tpot for h in handles))
            m.contention = max(1.0, statistics.median(busy) / alone)
        finally:
            stop.set()
            burner.join(timeout=5)
            if burner.is_alive():
                burner.kill()
        m.ttft = {L: statistics.median(v) for L, v in ttft_s.items()}
        m.tpot = {b: statistics.median(v) for b, v in tpot_s.items()}
        m.http_ttft = {L: statistics.median(v) for L, v in http_s.items() if v}
    finally:
        if server is not None:
            server.close()
        else:
            engine.shutdown()
    return m


def fit(model_dir: str, gpu_name: str, ttft: dict[int, float], tpot: dict[int, float],
        base: Efficiency | None = None, decode_prompt_tokens: int = 16, decode_tokens: int = 24,
        http_ttft: dict[int, float] | None = None, measured_on: dict | None = None,
        contention: float = 1.0) -> Calibration:
    """Solve for compute and memory efficiency and the per-iteration overhead (least squares on
    the log of predicted / measured over every point); the request overhead is the median of
    HTTP TTFT − engine TTFT over the prompt lengths measured both ways."""
    spec = load_model(model_dir)
    cluster = _one_device_cluster(gpu_name)
    layout = ReplicaLayout((StageLayout((0,), (0, spec.num_layers)),))
    base = replace(base or Efficiency(), step_overhead_s=0.0)

    def predict(eff: Efficiency):
        cm = CostModel(cluster, spec, eff)
        ctx = decode_prompt_tokens + decode_tokens / 2
        return np.array([*(cm.ttft(layout, L) for L in ttft), *(cm.decode_step_time(layout, b, b * ctx) for b in tpot)])

    measured = np.array([*ttft.values(), *tpot.values()])

    def eff_of(x) -> Efficiency:
        return replace(base, compute=float(10 ** x[0]), memory=float(10 ** x[1]), step_overhead_s=float(x[2]))

    def residuals(x):
        return np.log(predict(eff_of(x)) / measured)

    best = None
    for c0 in (-5.0, -3.0, -1.0):  # a few starts: the roofline's max() makes the surface piecewise
        x0 = np.array([c0, c0, 0.5 * float(min(measured))])
        r = least_squares(residuals, x0, bounds=([-9, -9, 0.0], [0, 0, float(max(measured))]))
        if best is None or r.cost < best.cost:
            best = r
    eff = eff_of(best.x)
    pred = predict(eff)
    points = tuple([CalibrationPoint("prefill", L, ttft[L], p) for L, p in zip(ttft, pred)]
                   + [CalibrationPoint("decode", b, tpot[b], p) for b, p in zip(tpot, pred[len(ttft):])])
    common = [L for L in (http_ttft or {}) if L in ttft]
    overhead = max(0.0, statistics.median(http_ttft[L] - ttft[L] for L in common)) if common else 0.0
    return Calibration(gpu_name, eff, points, overhead, contention, measured_on or {})


def calibrate(model_dir: str, gpu_name: str, **kwargs) -> Calibration:
    """Measure the engine (and the server) on this machine and fit the cost model to it."""
    m = measure(model_dir, gpu_name, **kwargs)
    info = machine_info()
    info["load_avg_1m"] = round(float(np.mean(m.load_avg)), 2) if m.load_avg else info["load_avg_1m"]
    return fit(model_dir, gpu_name, m.ttft, m.tpot, decode_tokens=kwargs.get("decode_tokens", 24),
               http_ttft=m.http_ttft, measured_on=info, contention=m.contention)
