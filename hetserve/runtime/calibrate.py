"""Calibrate the cost model (and the serving overheads) to the machine the engine runs on.

The cost model prices work with datasheet peaks times ``Efficiency`` fractions. On a machine
whose workers are not the GPUs the cluster file names (the CPU demo, or a new GPU), those
fractions are unknown; this module measures them. It serves a single-stage colocated replica of
the checkpoint on one device (the real engine behind the real HTTP server) and measures

* TTFT of single prompts of several lengths on the engine (prefill: achieved FLOP/s),
* TPOT of decode batches of several sizes on the engine (memory streaming, the fixed cost of an
  iteration, and what each sequence of the batch adds beyond its FLOPs),
* the same prompts through HTTP with the ``openai`` client (tokenisation, HTTP and SSE: what a
  served request spends outside the engine, ``request_overhead_s``), and the same decode batches
  streamed through HTTP: each token of each sequence is one SSE event the server encodes and the
  client parses, on the cores and under the GIL the coordinator needs for the next step, so a
  served iteration is slower per sequence than the engine's (``stream_overhead_s``, per sequence
  per iteration: the slope of served − engine TPOT over the batch size), and
* (``pipeline``) a prompt and a single-sequence decode on a two-stage pipeline of the same
  checkpoint (two devices): what a second stage adds tells the per-stage fixed cost apart from the
  once-per-iteration one, and (``tp``) the same on one stage of TP 2: what it adds beyond half
  the compute is the fixed cost of its collectives,

and fits ``Efficiency(compute, memory, step_overhead_s, iteration_overhead_s, seq_overhead_s,
collective_overhead_s)``
minimising the squared log error of the cost model over the engine measurements. Where the fixed
costs come from, read from the runtime (``worker.py``, ``coordinator.py``):

* ``iteration_overhead_s`` — once per iteration of a replica: the coordinator's turn-around
  (result message in, bookkeeping, the next step scheduled and pickled to the first stage),
  embedding lookup, sampling and the token message on the last stage;
* ``step_overhead_s`` — once per stage: a stage leader takes the step message (unpickles it),
  builds the attention metadata, runs the layer stack's fixed dispatch and sends its activations on;
* ``seq_overhead_s`` — once per sequence in the step: its entry in the step message, its block
  table in the attention metadata, its own attention over its KV, its token streamed to its
  request (on this CPU demo ~0.1-0.3 ms per sequence, beyond the FLOPs the roofline prices);
* ``collective_overhead_s`` — once per collective of a TP group (two all-reduces per layer, the
  leader's broadcasts of the step and its activations): the launch and every member reaching it
  (on CPU worker slots sharing cores, a process switch: ~1-2 ms here, α of the cluster file ~µs).

The fit's error per point is reported: it is the cost model's error on this machine. The result
is one JSON file (``Calibration.save``) that the planner (``--efficiency``) and the simulator
(``--efficiency``: efficiency and request overhead) read, stamped with the device, the date and
the load average during the measurement.
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

from hetserve.cost.analytic import CostModel, Efficiency, load_efficiency
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
    stages: int = 1  # pipeline stages of the replica measured (2: the pipeline probes)
    tp: int = 1  # its TP degree (2: the TP probes)

    @property
    def error(self) -> float:
        return (self.predicted_s - self.measured_s) / self.measured_s


@dataclass(frozen=True)
class Calibration:
    gpu: str  # the GPU type whose datasheet the efficiency is relative to
    efficiency: Efficiency
    points: tuple[CalibrationPoint, ...]
    request_overhead_s: float = 0.0  # HTTP + tokenisation + SSE per request, outside the engine
    stream_overhead_s: float = 0.0  # per sequence per iteration: its token streamed over HTTP/SSE to its client
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
                                                           "stream_overhead_s": self.stream_overhead_s,
                                                           "contention_slowdown": self.contention_slowdown},
            "measured_on": self.measured_on, "points": [asdict(p) for p in self.points]}, indent=2) + "\n")


def load_request_overhead(path: str | Path) -> float:
    """``runtime.request_overhead_s`` of a calibration file (0 when it has none)."""
    return float(_runtime(path).get("request_overhead_s", 0.0))


def load_stream_overhead(path: str | Path) -> float:
    """``runtime.stream_overhead_s`` of a calibration file (0 when it has none)."""
    return float(_runtime(path).get("stream_overhead_s", 0.0))


def served_efficiency(path: str | Path) -> Efficiency:
    """The calibrated efficiency of a *served* deployment: the engine's, with each sequence's token
    streamed over HTTP/SSE added to its per-sequence cost per iteration (what the simulator must
    charge to predict what clients of the HTTP server see; the planner's ``--efficiency`` reads the
    engine's alone, ``load_efficiency``)."""
    eff = load_efficiency(path)
    return replace(eff, seq_overhead_s=eff.seq_overhead_s + load_stream_overhead(path))


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


def _one_device_cluster(gpu_name: str, count: int = 1) -> Cluster:
    # Memory is left at the GPU's: calibration measures speed, not capacity.
    return cluster_from_dict({"name": "calibration", "machines": [{"name": "cal", "gpu": gpu_name, "count": count}]})


def _stage_bounds(num_layers: int, stages: int) -> list[tuple[int, int]]:
    """Layers split as evenly as they go over ``stages`` stages (the pipeline probe's layout)."""
    cuts = [round(i * num_layers / stages) for i in range(stages + 1)]
    return list(zip(cuts, cuts[1:]))


def _one_device_plan(spec, cluster: Cluster, stages: int = 1, tp: int = 1) -> Plan:
    """One colocated replica; ``stages`` > 1: a pipeline with one device per stage; ``tp`` > 1: one
    stage on ``tp`` devices."""
    devs = [[f"cal:{i * tp + k}" for k in range(tp)] for i in range(stages)]
    return Plan.from_dict({"model": spec.name, "cluster": cluster.name, "algorithm": "calibration",
                           "replicas": [{"id": "c0", "role": "colocated",
                                         "stages": [{"devices": d, "layers": [lo, hi]}
                                                    for d, (lo, hi) in zip(devs, _stage_bounds(spec.num_layers,
                                                                                                stages))]}]})


def _layout(spec, stages: int = 1, tp: int = 1) -> ReplicaLayout:
    return ReplicaLayout(tuple(StageLayout(tuple(range(i * tp, (i + 1) * tp)), b)
                               for i, b in enumerate(_stage_bounds(spec.num_layers, stages))))


def _tp_divides(spec, tp: int) -> bool:
    return spec.num_heads % tp == 0 and spec.num_kv_heads % tp == 0 and spec.ffn_hidden % tp == 0


@dataclass
class Measurements:
    ttft: dict[int, float]  # prompt length -> median TTFT on the engine (s)
    tpot: dict[int, float]  # batch size -> median TPOT on the engine (s)
    http_ttft: dict[int, float] = field(default_factory=dict)  # prompt length -> median TTFT through HTTP
    http_tpot: dict[int, float] = field(default_factory=dict)  # batch size -> median TPOT streamed through HTTP
    contention: float = 1.0  # TPOT of the largest decode probe beside one busy process / alone
    load_avg: list[float] = field(default_factory=list)  # 1-minute load average during the run
    pp_ttft: dict[int, float] = field(default_factory=dict)  # two-stage pipeline: prompt length -> median TTFT
    pp_tpot: dict[int, float] = field(default_factory=dict)  # two-stage pipeline: batch size -> median TPOT
    tp_ttft: dict[int, float] = field(default_factory=dict)  # one stage on TP 2: prompt length -> median TTFT
    tp_tpot: dict[int, float] = field(default_factory=dict)  # one stage on TP 2: batch size -> median TPOT


def measure(model_dir: str, gpu_name: str, prompt_lengths=(32, 128, 256, 512), batch_sizes=(1, 4, 16),
            decode_tokens: int = 24, reps: int = 5, serving: bool = True, pipeline: bool = True,
            tp: bool = True) -> Measurements:
    """Median TTFT per prompt length and median TPOT per batch size on the engine, (``serving``)
    median TTFT of the same prompts and TPOT of the same batches through the HTTP server and the
    ``openai`` client, and the TTFT of the second prompt length and the TPOT of one sequence on a
    two-stage pipeline (``pipeline``, checkpoints of two or more layers) and on one stage of TP 2
    (``tp``, heads and FFN divisible by 2)."""
    from hetserve.runtime.engine import Engine, EngineConfig
    from hetserve.runtime.sampling import SamplingParams

    spec = load_model(model_dir)
    cluster = _one_device_cluster(gpu_name)
    plan = _one_device_plan(spec, cluster)
    rng = np.random.default_rng(0)
    prompt_lengths = [L for L in prompt_lengths if L + decode_tokens < spec.max_context]
    m = Measurements({}, {})

    def prefill(eng, L: int) -> float:
        h = eng.submit(rng.integers(32, 127, L).tolist(), SamplingParams(max_tokens=1, ignore_eos=True))
        h.result(timeout=120)
        return h.ttft

    def decode(eng, b: int) -> float:
        handles = [eng.submit(rng.integers(32, 127, 16).tolist(),
                              SamplingParams(max_tokens=decode_tokens, ignore_eos=True)) for _ in range(b)]
        for h in handles:
            h.result(timeout=120)
        return statistics.median(h.tpot for h in handles)

    server = pp = tp2 = None
    if serving:
        from hetserve.serve.launch import ServeOptions, start_server

        server = start_server(ServeOptions(plan=plan, cluster=cluster, model_dir=str(model_dir),
                                           max_num_seqs=max(batch_sizes)))
        engine = server.deployment.engine
    else:
        engine = Engine.from_plan(plan, cluster, model_dir, EngineConfig(max_num_seqs=max(batch_sizes)))
    try:
        pp_prompt = prompt_lengths[min(1, len(prompt_lengths) - 1)]
        if pipeline and spec.num_layers >= 2:
            # A two-stage pipeline of the same checkpoint, probed in the same rounds (the load drifts):
            # one micro-batch, so what it adds to one stage is the second stage's fixed cost and hand-on.
            cluster2 = _one_device_cluster(gpu_name, 2)
            pp = Engine.from_plan(_one_device_plan(spec, cluster2, 2), cluster2, model_dir, EngineConfig(max_num_seqs=4))
            pp.generate([[65] * 8], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        if tp and _tp_divides(spec, 2):
            # One stage on TP 2: what it adds beyond half the compute is its collectives' fixed cost.
            cluster2 = _one_device_cluster(gpu_name, 2)
            tp2 = Engine.from_plan(_one_device_plan(spec, cluster2, 1, 2), cluster2, model_dir,
                                   EngineConfig(max_num_seqs=4))
            tp2.generate([[65] * 8], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        engine.generate([[65] * 8], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        # Rounds over every probe (not every probe's repetitions in a row): on a shared machine the
        # load drifts, and interleaving spreads it over all points instead of biasing some.
        ttft_s: dict[int, list[float]] = {L: [] for L in prompt_lengths}
        tpot_s: dict[int, list[float]] = {b: [] for b in batch_sizes}
        http_s: dict[int, list[float]] = {L: [] for L in prompt_lengths}
        http_tpot_s: dict[int, list[float]] = {b: [] for b in batch_sizes}
        pp_ttft_s: list[float] = []
        pp_tpot_s: list[float] = []
        tp_ttft_s: list[float] = []
        tp_tpot_s: list[float] = []
        for _ in range(reps):
            for L in prompt_lengths:
                ttft_s[L].append(prefill(engine, L))
            for b in batch_sizes:
                tpot_s[b].append(decode(engine, b))
            if pp is not None:
                pp_ttft_s.append(prefill(pp, pp_prompt))
                pp_tpot_s.append(decode(pp, 1))
            if tp2 is not None:
                tp_ttft_s.append(prefill(tp2, pp_prompt))
                tp_tpot_s.append(decode(tp2, 1))
            m.load_avg.append(os.getloadavg()[0])
            if server is not None:
                from hetserve.serve.loadgen import LoadRequest, replay

                # one client, requests spaced out (each alone on the server), as a replayed trace sends them
                gap = 1.5 * max(ttft_s[L][-1] for L in prompt_lengths) + 0.05
                reqs = [LoadRequest(i * gap, rng.integers(32, 127, L).tolist(), 1) for i, L in enumerate(prompt_lengths)]
                for L, r in zip(prompt_lengths, replay(server.url, Path(model_dir).resolve().name, reqs,
                                                       ignore_eos=True)):
                    http_s[L].append(r.ttft_s)
                # the decode probes again, every token streamed to the client (as the engine probes: all at once)
                for b in batch_sizes:
                    reqs = [LoadRequest(0.0, rng.integers(32, 127, 16).tolist(), decode_tokens) for _ in range(b)]
                    res = replay(server.url, Path(model_dir).resolve().name, reqs, ignore_eos=True)
                    http_tpot_s[b].append(statistics.median(r.tpot_s for r in res))
        for extra in (pp, tp2):
            if extra is not None:
                extra.shutdown()
        pp = tp2 = None
        # Contention: the largest decode probe again while one more process keeps a core busy (as a
        # second worker slot of the same host would); the ratio to the probe alone is the slow-down.
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        stop = ctx.Event()
        burner = ctx.Process(target=_burn, args=(stop,), daemon=True)
        burner.start()
        try:
            b = max(batch_sizes)
            busy = [decode(engine, b) for _ in range(reps)]
            m.contention = max(1.0, statistics.median(busy) / statistics.median(tpot_s[b]))
        finally:
            stop.set()
            burner.join(timeout=5)
            if burner.is_alive():
                burner.kill()
        m.ttft = {L: statistics.median(v) for L, v in ttft_s.items()}
        m.tpot = {b: statistics.median(v) for b, v in tpot_s.items()}
        m.http_ttft = {L: statistics.median(v) for L, v in http_s.items() if v}
        m.http_tpot = {b: statistics.median(v) for b, v in http_tpot_s.items() if v}
        if pp_ttft_s:
            m.pp_ttft = {pp_prompt: statistics.median(pp_ttft_s)}
            m.pp_tpot = {1: statistics.median(pp_tpot_s)}
        if tp_ttft_s:
            m.tp_ttft = {pp_prompt: statistics.median(tp_ttft_s)}
            m.tp_tpot = {1: statistics.median(tp_tpot_s)}
    finally:
        for extra in (pp, tp2):
            if extra is not None:
                extra.shutdown()
        if server is not None:
            server.close()
        else:
            engine.shutdown()
    return m


def fit(model_dir: str, gpu_name: str, ttft: dict[int, float], tpot: dict[int, float],
        base: Efficiency | None = None, decode_prompt_tokens: int = 16, decode_tokens: int = 24,
        http_ttft: dict[int, float] | None = None, measured_on: dict | None = None,
        contention: float = 1.0, pp_ttft: dict[int, float] | None = None,
        pp_tpot: dict[int, float] | None = None, http_tpot: dict[int, float] | None = None,
        tp_ttft: dict[int, float] | None = None, tp_tpot: dict[int, float] | None = None) -> Calibration:
    """Solve for compute and memory efficiency and the fixed costs per iteration, per stage and per
    sequence (least squares on the log of predicted / measured over every point); the request
    overhead is the median of HTTP TTFT − engine TTFT over the prompt lengths measured both ways,
    the stream overhead the least-squares slope (through 0) of HTTP TPOT − engine TPOT over the
    batch sizes measured both ways.

    Without pipeline points (``pp_ttft``/``pp_tpot``) a stage's fixed cost cannot be told from the
    iteration's: all of it is fitted as ``iteration_overhead_s`` (exact for one-stage replicas).
    Without TP points (``tp_ttft``/``tp_tpot``, one stage on TP 2) ``collective_overhead_s`` is 0."""
    spec = load_model(model_dir)
    pp_ttft, pp_tpot, tp_ttft, tp_tpot = pp_ttft or {}, pp_tpot or {}, tp_ttft or {}, tp_tpot or {}
    cluster = _one_device_cluster(gpu_name, 2 if pp_ttft or pp_tpot or tp_ttft or tp_tpot else 1)
    shapes = {(1, 1): _layout(spec), (2, 1): _layout(spec, 2), (1, 2): _layout(spec, 1, 2)}
    base = replace(base or Efficiency(), step_overhead_s=0.0, iteration_overhead_s=0.0, seq_overhead_s=0.0,
                   collective_overhead_s=0.0)
    ctx = decode_prompt_tokens + decode_tokens / 2
    probes = [(ph, n, st, t_, sec) for ph, st, t_, d in (("prefill", 1, 1, ttft), ("decode", 1, 1, tpot),
                                                         ("prefill", 2, 1, pp_ttft), ("decode", 2, 1, pp_tpot),
                                                         ("prefill", 1, 2, tp_ttft), ("decode", 1, 2, tp_tpot))
              for n, sec in d.items()]
    split = any(st == 2 for _, _, st, _, _ in probes)
    tp_probed = any(t_ == 2 for _, _, _, t_, _ in probes)

    def predict(eff: Efficiency):
        cm = CostModel(cluster, spec, eff)
        return np.array([cm.ttft(shapes[st, t_], n) if ph == "prefill"
                         else cm.decode_step_time(shapes[st, t_], n, n * ctx) for ph, n, st, t_, _ in probes])

    measured = np.array([sec for *_, sec in probes])

    def eff_of(x) -> Efficiency:
        return replace(base, compute=float(10 ** x[0]), memory=float(10 ** x[1]), iteration_overhead_s=float(x[2]),
                       seq_overhead_s=float(x[3]), step_overhead_s=float(x[4]) if split else 0.0,
                       collective_overhead_s=float(x[5]) if tp_probed else 0.0)

    def residuals(x):
        return np.log(predict(eff_of(x)) / measured)

    best = None
    hi = float(max(measured))
    for c0 in (-5.0, -3.0, -1.0):  # a few starts: the roofline's max() makes the surface piecewise
        x0 = np.array([c0, c0, 0.4 * float(min(measured)), 0.0, 0.05 * float(min(measured)),
                       0.01 * float(min(measured))])
        r = least_squares(residuals, x0, bounds=([-9, -9, 0.0, 0.0, 0.0, 0.0], [0, 0, hi, hi, hi, hi]))
        if best is None or r.cost < best.cost:
            best = r
    eff = eff_of(best.x)
    points = tuple(CalibrationPoint(ph, n, sec, float(p), st, t_) for (ph, n, st, t_, sec), p in zip(probes, predict(eff)))
    common = [L for L in (http_ttft or {}) if L in ttft]
    overhead = max(0.0, statistics.median(http_ttft[L] - ttft[L] for L in common)) if common else 0.0
    both = [b for b in (http_tpot or {}) if b in tpot]
    stream = max(0.0, sum(b * (http_tpot[b] - tpot[b]) for b in both) / sum(b * b for b in both)) if both else 0.0
    return Calibration(gpu_name, eff, points, overhead, stream, contention, measured_on or {})


def calibrate(model_dir: str, gpu_name: str, **kwargs) -> Calibration:
    """Measure the engine (and the server) on this machine and fit the cost model to it."""
    m = measure(model_dir, gpu_name, **kwargs)
    info = machine_info()
    info["load_avg_1m"] = round(float(np.mean(m.load_avg)), 2) if m.load_avg else info["load_avg_1m"]
    return fit(model_dir, gpu_name, m.ttft, m.tpot, decode_tokens=kwargs.get("decode_tokens", 24),
               http_ttft=m.http_ttft, measured_on=info, contention=m.contention, pp_ttft=m.pp_ttft,
               pp_tpot=m.pp_tpot, http_tpot=m.http_tpot, tp_ttft=m.tp_ttft, tp_tpot=m.tp_tpot)
