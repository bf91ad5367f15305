"""Fitting ``KernelParams`` to measured operator times, the transfer rule, and the error figures.

``fit_gpu`` fits one GPU's parameters to its profile rows by least squares on the log of
predicted / measured time (a 10 % miss weighs the same at 5 µs and at 5 ms): the four GEMM
parameters to every projection of every row, each elementwise kind's two to its operator.

``transfer`` is the rule for a GPU without profiles: the geometric mean of the profiled GPUs'
parameters, applied to that GPU's datasheet peaks. The measured efficiencies are fractions of
each GPU's own peak FLOP/s and bandwidth and the floors are kernel launch and tail costs in
seconds; across the profiled GPUs (A100 80 GB: HBM2e, 2.0 TB/s, 312 TFLOP/s; A40: GDDR6,
0.7 TB/s, 150 TFLOP/s) they agree within a few per cent, which is what lets them carry
(``docs/cost-model.md`` holds the leave-one-out figures).
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import least_squares

from hetserve.cost.kernels import (ELEMENTWISE, PARAM_NAMES, PROFILE_OP, ROW_TILE, SMALL_ROWS, KernelParams,
                                   elementwise_bytes, gemm_dims, layer_time)
from hetserve.cost.profiles import OpPoint
from hetserve.specs.gpus import GpuType

_GEMM_X0 = (5e-6, 0.8, 0.7, 3.0, 0.5)
_GEMM_LO = (1e-8, 0.05, 0.05, 1.0, 1e-3)
_GEMM_HI = (2e-4, 1.5, 1.5, 50.0, 1.0)
_ELEM_X0 = (3e-6, 0.5)
_ELEM_LO = (1e-8, 0.01)
_ELEM_HI = (2e-4, 1.5)


def _gemm_rows(points: list[OpPoint]) -> np.ndarray:
    """(rows, K, N, seconds) of every projection in ``points``."""
    out = []
    for pt in points:
        dims = gemm_dims(pt.shape, pt.tp)
        for op, kind in PROFILE_OP.items():
            if kind in dims and op in pt.times:
                out.append((pt.tokens, *dims[kind], pt.times[op]))
    return np.array(out, dtype=float).reshape(-1, 4)


def _gemm_vec(x, rows, k, n, flops_peak, bandwidth):
    """``kernels.gemm_time`` over arrays (tests hold the two equal)."""
    floor, mem, comp, s, waste = x
    tiled = np.where(rows <= SMALL_ROWS, rows, rows + waste * (np.ceil(rows / ROW_TILE) * ROW_TILE - rows))
    t_mem = 2 * (k * n + rows * k + rows * n) / (bandwidth * mem)
    t_comp = 2 * tiled * k * n / (flops_peak * comp)
    hi, lo = np.maximum(t_mem, t_comp), np.minimum(t_mem, t_comp)
    return floor + hi * (1 + (lo / hi) ** s) ** (1 / s)


def _solve(residual, x0, lo, hi, robust: bool = False):
    """Least squares in log-parameter space (every parameter stays positive); ``robust``: a soft-L1
    loss past 5 % (the kernel library's choice of tile for one shape is noise to this model, and
    should not pull the fit off the bulk of the points)."""
    lo, hi = np.log(lo), np.log(hi)
    r = least_squares(lambda z: residual(np.exp(z)), np.clip(np.log(x0), lo, hi), bounds=(lo, hi),
                      loss="soft_l1" if robust else "linear", f_scale=0.05)
    return np.exp(r.x)


def fit_gpu(points: list[OpPoint], gpu: GpuType) -> KernelParams:
    """The parameters of ``gpu`` fitted to ``points`` (its own profile rows)."""
    if not points:
        raise ValueError(f"no profile rows to fit {gpu.name} on")
    F, B = gpu.fp16_flops, gpu.mem_bandwidth
    g = _gemm_rows(points)
    rows, k, n, t = g.T
    gemm = _solve(lambda x: np.log(_gemm_vec(x, rows, k, n, F, B) / t), _GEMM_X0, _GEMM_LO, _GEMM_HI,
                  robust=True)
    params = list(gemm)
    for kind in ELEMENTWISE:
        nb, tm = [], []
        for pt in points:
            b = elementwise_bytes(pt.shape, pt.tp, pt.tokens)[kind]
            for op, k_ in PROFILE_OP.items():
                if k_ == kind and op in pt.times:
                    nb.append(b)
                    tm.append(pt.times[op])
        nb, tm = np.array(nb), np.array(tm)
        params += list(_solve(lambda x: np.log((x[0] + nb / (B * x[1])) / tm), _ELEM_X0, _ELEM_LO, _ELEM_HI))
    return KernelParams.of(params)


def transfer(fitted: list[KernelParams]) -> KernelParams:
    """The transfer rule: each parameter the geometric mean over the profiled GPUs' fits."""
    if not fitted:
        raise ValueError("the transfer rule needs at least one fitted GPU")
    values = np.array([[getattr(p, n) for n in PARAM_NAMES] for p in fitted], dtype=float)
    return KernelParams.of(np.exp(np.log(np.maximum(values, 1e-12)).mean(axis=0)))


def measured_layer(pt: OpPoint) -> tuple[float, float]:
    """(linear_s, layer_s) a profile row measures: the four projections; every profiled operator,
    the residual add twice (a layer has two; the profile times one)."""
    linear = sum(pt.times[op] for op in ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj"))
    return linear, sum(pt.times.values()) + pt.times["add"]


def predicted_layer(p: KernelParams, gpu: GpuType, pt: OpPoint) -> tuple[float, float]:
    """(linear_s, layer_s) the model gives for a profile row (one norm where the profile has one)."""
    norms = 2 if "post_attention_layernorm" in pt.times else 1
    lt = layer_time(p, gpu.fp16_flops, gpu.mem_bandwidth, pt.shape, pt.tp, pt.tokens, norms=norms)
    return lt.linear_s, lt.layer_s


def errors(p: KernelParams, gpu: GpuType, points: list[OpPoint]) -> dict[str, np.ndarray]:
    """predicted / measured per point: ``linear`` and ``layer`` (each an array over ``points``)."""
    pred = np.array([predicted_layer(p, gpu, pt) for pt in points]).reshape(-1, 2)
    meas = np.array([measured_layer(pt) for pt in points]).reshape(-1, 2)
    ratio = pred / meas
    return {"linear": ratio[:, 0], "layer": ratio[:, 1]}


def summary(ratio: np.ndarray, within: float) -> dict[str, float]:
    """Share of points within ``±within`` of the measurement, and the extreme ratios."""
    ratio = np.asarray(ratio, dtype=float)
    return {"points": int(ratio.size), "within": within, "share_within": float(np.mean(np.abs(ratio - 1) <= within)),
            "min_ratio": float(ratio.min()), "max_ratio": float(ratio.max()),
            "median_abs_error": float(np.median(np.abs(ratio - 1)))}
