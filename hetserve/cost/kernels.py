"""Per-operator kernel times on one GPU: the roofline's structure with what measurements show.

One layer on one TP rank runs four matrix products (QKV, output, gate+up, down) and elementwise
operators (two norms, RoPE, the activation, two residual adds). Each is priced from the GPU's
datasheet peaks (``GpuType.fp16_flops``, ``GpuType.mem_bandwidth``) and a few fitted numbers
(``KernelParams``):

* a matrix product of ``M`` rows by a ``K x N`` weight shard:
  ``floor + (t_mem^p + t_comp^p)^(1/p)`` where ``t_mem = 2·(KN + MK + MN) bytes / (bandwidth ·
  gemm_memory)`` and ``t_comp = 2·M'·K·N / (FLOP/s · gemm_compute)``. ``M'`` is ``M`` rounded up to
  the kernel's row tile (``ROW_TILE`` once ``M`` passes ``SMALL_ROWS``; the share ``gemm_tile_waste``
  of the padding is paid): the measured times climb in steps of 128 rows, not smoothly. The sharpness ``p`` sets how the memory-bound floor at few
  tokens turns into the compute-bound ceiling at many (p -> inf: the plain roofline's max);
* an elementwise operator moving ``b`` bytes: ``floor + b / (bandwidth · memory)``, with its own
  floor and memory fraction per kind (norm, rope, act, add): the profiles show a norm reaching a
  third of the bandwidth an add reaches.

Attention's score and value products are not among the profiled operators; ``layer_time`` leaves
them out (the cost model prices them on the roofline beside it). Units: seconds, bytes, FLOP/s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from hetserve.cost.profiles import LayerShape

ROW_TILE = 128  # rows of one output tile of the GEMM kernels the profiles time (the steps' period)
SMALL_ROWS = 64  # up to this many rows a narrower kernel runs, with no step
ELEMENTWISE = ("norm", "rope", "act", "add")
GEMMS = ("qkv", "out", "up", "down")
PARAM_NAMES = ("gemm_floor_s", "gemm_memory", "gemm_compute", "gemm_sharpness", "gemm_tile_waste") + tuple(
    f"{k}_{f}" for k in ELEMENTWISE for f in ("floor_s", "memory"))
# Where each profile operator's time goes: a GEMM or an elementwise kind.
PROFILE_OP = {"attn_pre_proj": "qkv", "attn_post_proj": "out", "mlp_up_proj": "up", "mlp_down_proj": "down",
              "input_layernorm": "norm", "post_attention_layernorm": "norm", "attn_rope": "rope",
              "mlp_act": "act", "add": "add"}


@dataclass(frozen=True)
class KernelParams:
    """The fitted numbers of one GPU (``PARAM_NAMES``): floors in seconds, the rest fractions of the
    datasheet's peak (``gemm_sharpness``: the exponent ``p``)."""

    gemm_floor_s: float
    gemm_memory: float
    gemm_compute: float
    gemm_sharpness: float
    gemm_tile_waste: float
    norm_floor_s: float
    norm_memory: float
    rope_floor_s: float
    rope_memory: float
    act_floor_s: float
    act_memory: float
    add_floor_s: float
    add_memory: float

    def __post_init__(self) -> None:
        for name in PARAM_NAMES:
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"kernel parameter {name} must be a finite non-negative number, got {v!r}")
        for name in PARAM_NAMES:
            if not name.endswith("floor_s") and getattr(self, name) <= 0:
                raise ValueError(f"kernel parameter {name} must be positive")

    def as_dict(self) -> dict[str, float]:
        return {n: float(getattr(self, n)) for n in PARAM_NAMES}

    @staticmethod
    def of(values) -> "KernelParams":
        """From a mapping or a sequence in ``PARAM_NAMES`` order."""
        if isinstance(values, dict):
            return KernelParams(**{n: float(values[n]) for n in PARAM_NAMES})
        return KernelParams(*(float(v) for v in values))


def gemm_dims(shape: LayerShape, tp: int) -> dict[str, tuple[float, float]]:
    """(K, N) of each projection's weight shard on one rank of TP ``tp`` (column-parallel QKV and
    gate+up split N; row-parallel output and down split K)."""
    hd = shape.head_dim
    return {"qkv": (shape.hidden, (shape.heads + 2 * shape.kv_heads) * hd / tp),
            "out": (shape.heads * hd / tp, shape.hidden),
            "up": (shape.hidden, (2 if shape.gated else 1) * shape.ffn / tp),
            "down": (shape.ffn / tp, shape.hidden)}


class ElementwiseBytes:
    """Bytes each elementwise operator (``ELEMENTWISE`` order) reads and writes for ``tokens`` rows
    (``at``), with what it reads of the shape found once: a norm reads and writes the full hidden
    state (it is not split by TP), RoPE rotates this rank's queries and keys, the activation reads
    gate and up and writes one, an add reads two and writes one. Numbers or arrays alike."""

    def __init__(self, shape: LayerShape, tp: int, dtype_bytes: int = 2):
        self.hidden, self.tp, self.dtype_bytes = shape.hidden, tp, dtype_bytes
        self.rotated_heads, self.head_dim = shape.heads + shape.kv_heads, shape.head_dim
        self.ffn_shard, self.act_reads = shape.ffn / tp, 3 if shape.gated else 2

    def at(self, tokens: Any) -> tuple[Any, Any, Any, Any]:
        d = self.dtype_bytes
        return (2 * tokens * self.hidden * d,
                2 * tokens * self.rotated_heads * self.head_dim / self.tp * d,
                tokens * self.ffn_shard * self.act_reads * d,
                3 * tokens * self.hidden * d)


def elementwise_bytes(shape: LayerShape, tp: int, tokens: Any, dtype_bytes: int = 2) -> dict[str, Any]:
    """{kind: bytes} of ``ElementwiseBytes``."""
    return dict(zip(ELEMENTWISE, ElementwiseBytes(shape, tp, dtype_bytes).at(tokens)))


def tiled_rows(rows: float, waste: float = 1.0) -> float:
    """The rows a GEMM kernel pays for at ``rows``: ``rows`` plus the share ``waste`` of the padding
    up to the next whole tile (1: a whole tile's work; below 1 where the library picks narrower
    tiles for some shapes, as on the A40)."""
    if rows <= SMALL_ROWS:
        return rows
    return rows + waste * (math.ceil(rows / ROW_TILE) * ROW_TILE - rows)


def gemm_time(p: KernelParams, flops_peak: float, bandwidth: float, rows: float, k: float, n: float,
              dtype_bytes: int = 2) -> float:
    """Seconds for ``rows`` x ``k`` times ``k`` x ``n`` on a GPU with these peaks."""
    t_mem = dtype_bytes * (k * n + rows * k + rows * n) / (bandwidth * p.gemm_memory)
    t_comp = 2.0 * tiled_rows(rows, p.gemm_tile_waste) * k * n / (flops_peak * p.gemm_compute)
    s = p.gemm_sharpness
    hi = max(t_mem, t_comp)
    return p.gemm_floor_s + hi * (1.0 + (min(t_mem, t_comp) / hi) ** s) ** (1.0 / s)


@dataclass(frozen=True)
class LayerTimes:
    """One layer on one TP rank, in seconds: the four projections and the whole layer (the
    projections plus two norms, RoPE, the activation and two residual adds; attention's score and
    value products left out)."""

    linear_s: float
    layer_s: float


class LayerKernel:
    """One layer's operators on one rank of TP ``tp`` as a function of its rows (``at``), with what
    they read of the GPU's parameters and the shape found once (a simulation prices a new token
    count at nearly every step)."""

    def __init__(self, p: KernelParams, flops_peak: float, bandwidth: float, shape: LayerShape, tp: int,
                 norms: int = 2, adds: int = 2):
        self.p, self.flops_peak, self.bandwidth = p, flops_peak, bandwidth
        self.dims: tuple[tuple[float, float], ...] = tuple(gemm_dims(shape, tp).values())
        self.bytes = ElementwiseBytes(shape, tp)
        count = {"norm": norms, "rope": 1, "act": 1, "add": adds}
        # (how many, floor, bytes/s) per elementwise kind: each costs floor + bytes / (bytes/s)
        self.elementwise = tuple((count[k], getattr(p, f"{k}_floor_s"), bandwidth * getattr(p, f"{k}_memory"))
                                 for k in ELEMENTWISE)

    def at(self, tokens: Any) -> LayerTimes:
        linear, rest = self._parts(float(tokens))
        return LayerTimes(linear, linear + rest)

    def layer_s(self, tokens: Any) -> float:
        """``at(tokens).layer_s`` (the kernel pricing's memo misses ask for this alone)."""
        linear, rest = self._parts(float(tokens))
        return linear + rest

    def _parts(self, tokens: float) -> tuple[float, float]:
        """(the projections, the elementwise operators) at ``tokens`` rows (typed: compiled, the
        sums run on native floats)."""
        if tokens <= 0:
            return 0.0, 0.0
        p, flops_peak, bandwidth = self.p, self.flops_peak, self.bandwidth
        linear = 0.0
        for k, n in self.dims:
            linear += gemm_time(p, flops_peak, bandwidth, tokens, k, n)
        rest = 0.0
        for (count, floor, rate), b in zip(self.elementwise, self.bytes.at(tokens)):
            moved: float = b
            rest += count * (floor + moved / rate)
        return linear, rest


def layer_time(p: KernelParams, flops_peak: float, bandwidth: float, shape: LayerShape, tp: int,
               tokens: float, norms: int = 2, adds: int = 2) -> LayerTimes:
    """One layer's operators at ``tokens`` rows on one rank of TP ``tp`` (``LayerKernel``)."""
    return LayerKernel(p, flops_peak, bandwidth, shape, tp, norms, adds).at(tokens)


def layer_times(p: KernelParams, flops_peak: float, bandwidth: float, shape: LayerShape, tp: int, tokens) -> np.ndarray:
    """``layer_time(...).layer_s`` over an array of token counts (the planner's bound prices whole
    batch ranges at once; a test holds the two equal)."""
    m = np.asarray(tokens, dtype=float)
    tiled = np.where(m <= SMALL_ROWS, m, m + p.gemm_tile_waste * (np.ceil(m / ROW_TILE) * ROW_TILE - m))
    total = np.zeros_like(m)
    s = p.gemm_sharpness
    for k, n in gemm_dims(shape, tp).values():
        t_mem = 2 * (k * n + m * k + m * n) / (bandwidth * p.gemm_memory)
        t_comp = 2.0 * tiled * k * n / (flops_peak * p.gemm_compute)
        hi = np.maximum(t_mem, t_comp)
        total += p.gemm_floor_s + hi * (1.0 + (np.minimum(t_mem, t_comp) / hi) ** s) ** (1.0 / s)
    b = elementwise_bytes(shape, tp, m)
    for kind, count in (("norm", 2), ("rope", 1), ("act", 1), ("add", 2)):
        total += count * (getattr(p, f"{kind}_floor_s") + b[kind] / (bandwidth * getattr(p, f"{kind}_memory")))
    return np.where(m > 0, total, 0.0)
