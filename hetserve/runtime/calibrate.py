"""Calibrate the cost model's efficiency factors to the machine the engine runs on.

The cost model prices work with datasheet peaks times ``Efficiency`` fractions. On a machine
whose workers are not the GPUs the cluster file names (the CPU demo, or a new GPU), those
fractions are unknown; this module measures them. It runs the real engine on one device
(a single-stage colocated replica of the checkpoint), measures

* TTFT of single prompts of several lengths (prefill: the slope gives achieved FLOP/s), and
* TPOT of decode batches of several sizes (the intercept gives the fixed per-iteration cost),

and solves for ``Efficiency(compute, step_overhead_s)`` minimising the cost model's mean relative
error over the measurements (for a given compute fraction the overhead is the least-squares one). The fit's residuals are reported; they are the cost model's error on this machine.

Only ``compute`` and ``step_overhead_s`` are fitted: on a CPU a tiny model's decode is dominated
by per-iteration overhead, so the memory term cannot be told apart and keeps its default.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
from scipy.optimize import minimize_scalar

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

    @property
    def mean_abs_error(self) -> float:
        return float(np.mean([abs(p.error) for p in self.points]))

    def save(self, path: str | Path) -> None:
        """JSON that ``cost.analytic.load_efficiency`` (``hetserve simulate --efficiency``) reads."""
        Path(path).write_text(json.dumps({
            "gpu": self.gpu, "efficiency": asdict(self.efficiency), "mean_abs_error": self.mean_abs_error,
            "points": [asdict(p) for p in self.points]}, indent=2) + "\n")


def _one_device_cluster(gpu_name: str) -> Cluster:
    # Memory is left at the GPU's: calibration measures speed, not capacity.
    return cluster_from_dict({"name": "calibration", "machines": [{"name": "cal", "gpu": gpu_name, "count": 1}]})


def measure(model_dir: str, gpu_name: str, prompt_lengths=(32, 128, 256, 512), batch_sizes=(1, 4, 16),
            decode_tokens: int = 24, reps: int = 3) -> tuple[dict[int, float], dict[int, float]]:
    """Median TTFT per prompt length and median TPOT per batch size, measured on the engine."""
    from hetserve.runtime.engine import Engine, EngineConfig
    from hetserve.runtime.sampling import SamplingParams

    spec = load_model(model_dir)
    cluster = _one_device_cluster(gpu_name)
    plan = Plan.from_dict({"model": spec.name, "cluster": cluster.name, "algorithm": "calibration",
                           "replicas": [{"id": "c0", "role": "colocated",
                                         "stages": [{"devices": ["cal:0"], "layers": [0, spec.num_layers]}]}]})
    rng = np.random.default_rng(0)
    prompt_lengths = [L for L in prompt_lengths if L + decode_tokens < spec.max_context]
    ttft: dict[int, float] = {}
    tpot: dict[int, float] = {}
    engine = Engine.from_plan(plan, cluster, model_dir, EngineConfig(max_num_seqs=max(batch_sizes)))
    try:
        engine.generate([[65] * 8], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        for L in prompt_lengths:
            samples = []
            for _ in range(reps):
                h = engine.submit(rng.integers(32, 127, L).tolist(), SamplingParams(max_tokens=1, ignore_eos=True))
                h.result(timeout=120)
                samples.append(h.ttft)
            ttft[L] = statistics.median(samples)
        for b in batch_sizes:
            handles = [engine.submit(rng.integers(32, 127, 16).tolist(),
                                     SamplingParams(max_tokens=decode_tokens, ignore_eos=True)) for _ in range(b)]
            for h in handles:
                h.result(timeout=120)
            tpot[b] = statistics.median(h.tpot for h in handles)
    finally:
        engine.shutdown()
    return ttft, tpot


def fit(model_dir: str, gpu_name: str, ttft: dict[int, float], tpot: dict[int, float],
        base: Efficiency | None = None, decode_prompt_tokens: int = 16, decode_tokens: int = 24) -> Calibration:
    """Solve for compute efficiency and per-iteration overhead from the measurements."""
    spec = load_model(model_dir)
    cluster = _one_device_cluster(gpu_name)
    layout = ReplicaLayout((StageLayout((0,), (0, spec.num_layers)),))
    base = replace(base or Efficiency(), step_overhead_s=0.0)

    def predict(eff: Efficiency):
        cm = CostModel(cluster, spec, eff)
        ctx = decode_prompt_tokens + decode_tokens / 2
        return ([cm.ttft(layout, L) for L in ttft], [cm.decode_step_time(layout, b, b * ctx) for b in tpot])

    measured = np.array([*ttft.values(), *tpot.values()])

    def with_overhead(compute: float) -> tuple[Efficiency, float]:
        # For a given compute efficiency the best overhead is the mean residual (least squares).
        eff = replace(base, compute=compute)
        pre, dec = predict(eff)
        eff = replace(eff, step_overhead_s=max(0.0, float(np.mean(measured - np.array([*pre, *dec])))))
        pre, dec = predict(eff)
        return eff, float(np.mean(np.abs(np.array([*pre, *dec]) / measured - 1)))

    # One unknown left: search log10(compute) for the smallest mean relative error.
    result = minimize_scalar(lambda x: with_overhead(10 ** x)[1], bounds=(-8, 0), method="bounded")
    eff, _ = with_overhead(float(10 ** result.x))
    pre, dec = predict(eff)
    points = tuple([CalibrationPoint("prefill", L, ttft[L], p) for L, p in zip(ttft, pre)]
                   + [CalibrationPoint("decode", b, tpot[b], p) for b, p in zip(tpot, dec)])
    return Calibration(gpu_name, eff, points)


def calibrate(model_dir: str, gpu_name: str, **kwargs) -> Calibration:
    """Measure the engine on this machine and fit the cost model's efficiency to it."""
    ttft, tpot = measure(model_dir, gpu_name, **kwargs)
    return fit(model_dir, gpu_name, ttft, tpot)
