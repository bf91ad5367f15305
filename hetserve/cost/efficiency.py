"""What the cost model's roofline assumes of the hardware and the engine, and what calibration sets.

``Efficiency`` holds the achieved fractions of datasheet peaks, the engine's fixed costs per
stage / iteration / sequence / TP collective and its batch cap; ``load_efficiency`` reads them
from a JSON file (a flat mapping, or ``hetserve calibrate -o``'s output). The formulas that use
them live in ``hetserve.cost.analytic``.
"""

from __future__ import annotations

import json
import math
import numbers
from dataclasses import dataclass, fields, replace
from pathlib import Path

from hetserve.errors import SpecError


MIN_FRACTION = 1e-18


class FieldError(ValueError):
    """A field out of its range: which field, what it must be, what it was."""

    def __init__(self, field: str, expected: str, value):
        super().__init__(f"efficiency {field} must be {expected}, got {value!r}")
        self.field, self.expected, self.value = field, expected, value


@dataclass(frozen=True)
class Efficiency:
    """Achieved fractions of datasheet peaks and other knobs a calibration may set."""

    compute: float = 0.5  # of peak dense FP16 tensor FLOP/s (typical prefill MFU on large GEMMs)
    memory: float = 0.8  # of peak HBM bandwidth (typical for decode weight streaming)
    # of peak FLOP/s for attention's score and value products (a causal prefill's 2·q_dim·s² per
    # layer, a decode token's 4·q_dim·context): 0 = the same as ``compute`` (the pure roofline).
    # Small batched matmuls over a growing context do not run at the weight GEMMs' rate (on this
    # CPU demo a prompt's time per token grows with its length: `hetserve calibrate` fits it).
    attention: float = 0.0
    # of peak FLOP/s for a *decode* step's attention over its context (4·q_dim·context per layer):
    # 0 = the same as ``attention``. A decode step reads every sequence's KV blocks one by one (on
    # this CPU demo ~4 µs per context token, 15x a prompt's attention per FLOP); `hetserve calibrate`
    # fits it from decode probes at two context lengths.
    decode_attention: float = 0.0
    usable_memory: float = 0.9  # of device memory (CUDA context, allocator fragmentation)
    activation_buffers: int = 4  # HexGen Appendix B: 4 reusable activation buffers
    activation_tokens: int = 2048  # tokens those buffers are sized for (the prefill token budget)
    # Fixed costs of one iteration, split by where the runtime pays them (``hetserve calibrate``
    # fits all three; 0 = the pure roofline):
    step_overhead_s: float = 0.0  # per stage: taking the step message, attention metadata, launches, the hand-on
    iteration_overhead_s: float = 0.0  # per replica, on its last stage: the scheduler's turn-around, sampling, tokens back
    seq_overhead_s: float = 0.0  # per sequence in the step, on the last stage: its bookkeeping, sampling, token streamed
    collective_overhead_s: float = 0.0  # per collective of a TP group (> 1 device): its launch and the members' meeting
    # per stage, per step that carries prompt tokens, beyond a decode step's fixed costs (its
    # attention's causal mask and padded query grid, ``runtime/model/attention.py``): without it short
    # prompts are priced low and long ones high, the one intercept of the decode probes being too low
    # for a step that carries a prompt. `hetserve calibrate` fits it (0 = none)
    prompt_step_overhead_s: float = 0.0
    # per byte a TP collective carries (each layer's two all-reduces and the broadcast of the stage's
    # input activations), beyond the link's α-β time: on CPU worker slots, gloo's copies and sums
    collective_s_per_byte: float = 0.0
    # seconds per weight byte (of a device's shard) that a step's matrix products spend once they
    # multiply more than one row: one row runs as matrix-vector products, two or more as a GEMM,
    # which on this CPU demo costs about one more pass over the weights (torch's fp32 linear of a
    # 768x256 matrix: 18 µs for one row, 31 µs for two, 40 µs for four). Scaled by min(1, rows - 1),
    # so a mean of 1.5 rows per micro-batch pays half. `hetserve calibrate` fits it from the decode
    # probes of one and of more sequences (0 = the pure roofline).
    multi_row_s_per_byte: float = 0.0
    # the share of ``iteration_overhead_s`` that holds a pipeline's last stage while its other
    # micro-batches are in flight (the rest overlaps them, ``CostModel.decode_step_time``); None: by
    # the host (all of it on CPU worker slots sharing cores, none on GPU hosts). `hetserve calibrate`
    # fits it from a two-stage pipeline decoding two sequences (two micro-batches) beside one.
    turn_hold: float | None = None
    max_batch: int = 256  # running requests per replica: the serving engine's cap (vLLM's max_num_seqs)
    # the GPU type whose datasheet peaks the fractions above are of on CPU worker slots (``cpu_cores``):
    # a calibration's ``gpu`` (``load_efficiency`` sets it). A CPU slot's GPU type is a price tag; every
    # slot runs at its CPU's speed, which the calibration measured against this type's peaks, so an
    # "L4" slot beside an "RTX-4090" slot on the same cores is priced as fast. None: each slot's own
    # type. Real GPUs always keep their own peaks.
    reference_gpu: str | None = None

    def __post_init__(self) -> None:
        # a fraction of a peak is at least MIN_FRACTION, the least `hetserve calibrate` fits (compute
        # down to 10**-9, attention as compute times a factor down to 10**-9):
        # below it times overflow to years (1e-300 prices a step at 1e290 s) instead of being refused
        for k in ("compute", "memory", "usable_memory"):
            if not MIN_FRACTION <= getattr(self, k) <= 1:
                raise FieldError(k, f"in [{MIN_FRACTION:g}, 1]", getattr(self, k))
        for k, zero in (("attention", "compute"), ("decode_attention", "attention")):
            v = getattr(self, k)
            if not (v == 0 or MIN_FRACTION <= v <= 1):
                raise FieldError(k, f"0 (the same as {zero}) or in [{MIN_FRACTION:g}, 1]", v)
        # counts are whole (a buffer, a token, a sequence); costs finite: an infinite or NaN one
        # left simulated requests unfinished instead of being refused here
        for k, least in (("activation_buffers", 0), ("activation_tokens", 1), ("max_batch", 1)):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < least:
                raise FieldError(k, f"a whole number >= {least}", v)
        for k in ("step_overhead_s", "iteration_overhead_s", "seq_overhead_s", "collective_overhead_s",
                  "prompt_step_overhead_s", "multi_row_s_per_byte", "collective_s_per_byte"):
            if not 0 <= getattr(self, k) < math.inf:
                raise FieldError(k, "a finite number >= 0", getattr(self, k))
        if self.turn_hold is not None and not 0 <= self.turn_hold <= 1:
            raise FieldError("turn_hold", "in [0, 1] (or null: by the host)", self.turn_hold)
        if self.reference_gpu is not None and not (isinstance(self.reference_gpu, str) and self.reference_gpu):
            raise FieldError("reference_gpu", "a GPU type's name (or null: each slot's own type)", self.reference_gpu)

    def at_speed(self, slowdown: float) -> "Efficiency":
        """The same engine on a machine ``slowdown`` times slower (``runtime.speed_probe``: a shared
        VM's speed drifts after calibration): every time it prices scaled by ``slowdown`` — the
        achieved fractions of peak divided (at most 1), the fixed costs multiplied."""
        if slowdown <= 0:
            raise ValueError("slowdown must be positive")
        frac = lambda x: min(1.0, x / slowdown)  # noqa: E731
        return replace(self, compute=frac(self.compute), memory=frac(self.memory),
                       attention=frac(self.attention) if self.attention else 0.0,
                       decode_attention=frac(self.decode_attention) if self.decode_attention else 0.0,
                       step_overhead_s=self.step_overhead_s * slowdown,
                       iteration_overhead_s=self.iteration_overhead_s * slowdown,
                       seq_overhead_s=self.seq_overhead_s * slowdown,
                       collective_overhead_s=self.collective_overhead_s * slowdown,
                       prompt_step_overhead_s=self.prompt_step_overhead_s * slowdown,
                       multi_row_s_per_byte=self.multi_row_s_per_byte * slowdown,
                       collective_s_per_byte=self.collective_s_per_byte * slowdown)


# The top-level keys of a calibration file (``hetserve calibrate -o``, ``runtime.calibrate.Calibration.save``;
# a test holds the two together) and the JSON type each must have: an unknown key is a typo or
# another tool's file, and is refused rather than silently ignored.
CALIBRATION_KEYS = {"gpu": str, "efficiency": dict, "mean_abs_error": (int, float), "max_abs_error": (int, float),
                    "memory_bound": bool, "runtime": dict, "measured_on": dict, "points": list,
                    "speed_probe": (dict, type(None)), "frontend_points": list, "http_tpot": dict,
                    "refitted": bool}  # bench/predict/run.py --replay --refit: fitted again from its own points


def load_efficiency(path: str | Path) -> Efficiency:
    """Read efficiency factors from JSON: a flat mapping of ``Efficiency`` fields, or a
    calibration file holding one under ``"efficiency"`` (``hetserve calibrate -o``), whose ``gpu``
    becomes ``reference_gpu`` (the peaks CPU worker slots run at). A wrong key or
    value raises ``SpecError`` naming the file, the field's dotted path and what was expected."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:  # bytes that are no UTF-8 text too
        raise SpecError(str(path), "(file)", "a readable JSON file", str(exc)) from exc
    if not isinstance(data, dict):
        raise SpecError(str(path), "(file)", "a mapping of Efficiency fields or a calibration file",
                        type(data).__name__)
    if "replicas" in data or "stages" in data:  # the easy mix-up: a plan given where a calibration goes
        raise SpecError(str(path), "(file)", "an efficiency or calibration file (`hetserve calibrate -o`)",
                        "a plan file")
    prefix = ""
    if "efficiency" in data:  # a calibration file
        for key, value in data.items():
            if key not in CALIBRATION_KEYS:
                raise SpecError(str(path), key, "one of the calibration file's keys: " + ", ".join(CALIBRATION_KEYS),
                                "an unknown field")
            if not of_json_type(value, CALIBRATION_KEYS[key]):
                raise SpecError(str(path), key, _json_type(CALIBRATION_KEYS[key]), value)
        gpu_name = data.get("gpu")
        data, prefix = dict(data["efficiency"]), "efficiency."
        # its fractions are of the calibrated GPU type's peaks: CPU worker slots of every type run at them
        if data.get("reference_gpu") is None and gpu_name is not None:
            _check_gpu_name(gpu_name, path, "gpu")
            data["reference_gpu"] = gpu_name
    known = {f.name: f.type for f in fields(Efficiency)}
    for key, value in data.items():
        if key not in known:
            raise SpecError(str(path), prefix + key,
                            "a field of an efficiency file, one of " + ", ".join(sorted(known)), "an unknown field")
        if key == "reference_gpu":
            if value is not None:
                _check_gpu_name(value, path, prefix + key)
            continue
        optional = "None" in str(known[key])
        if value is None and optional:
            continue
        if not of_json_type(value, (int, float)):
            raise SpecError(str(path), prefix + key, "a number" + (" or null" if optional else ""), value)
    try:
        return Efficiency(**data)
    except FieldError as exc:
        raise SpecError(str(path), prefix + exc.field, exc.expected, exc.value) from exc
    except (TypeError, ValueError) as exc:
        raise SpecError(str(path), prefix.rstrip(".") or "(file)", "values in range", str(exc)) from exc


def _check_gpu_name(value, path: Path, field: str) -> None:
    """A GPU type of the catalog (``gpus.csv``), or ``SpecError`` naming the file and field."""
    from hetserve.specs.gpus import gpu_catalog

    known = gpu_catalog()
    if not isinstance(value, str) or value not in known:
        raise SpecError(str(path), field, "a GPU type of the catalog: " + ", ".join(sorted(known)), value)


def of_json_type(value, kind) -> bool:
    """``isinstance`` as JSON means it: true and false are not numbers."""
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)


def _json_type(kind) -> str:
    names = {str: "a string", dict: "a mapping", list: "a list", bool: "true or false", type(None): "null",
             int: "a number", float: "a number"}
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(dict.fromkeys(names[k] for k in kinds))
