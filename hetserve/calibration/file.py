"""Reading a saved calibration (``hetserve calibrate -o``): what a *served* deployment's simulation
takes from it.

``runtime.calibrate`` measures and fits; this module is the other side of its file, used by
``hetserve compare``, ``simulate --efficiency`` and ``bench/predict/run.py``: the engine's
efficiency with each token's HTTP/SSE stream added (``served_efficiency``), the ``SimOptions``
fields of the serving overheads, the contention and the front end (``served_sim_options``), both
scaled by the speed probe's slow-down, and the probe's reading itself. The planner reads the
engine's efficiency alone (``cost.analytic.load_efficiency``).
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Iterable

from hetserve.cost.efficiency import Efficiency, load_efficiency
from hetserve.cost.efficiency import of_json_type
from hetserve.errors import SpecError
from hetserve.calibration.speed_probe import SpeedReading
from hetserve.specs._validation import read_mapping
from hetserve.specs.cluster import Device
from hetserve.specs.model import ModelSpec


# runtime terms of the file: (default where the file has none, floor or None); the times scale by
# the speed probe's slow-down, the contention slow-down is a ratio
_TERMS = {"request_overhead_s": (0.0, None), "stream_overhead_s": (0.0, None),
          "stream_step_overhead_s": (0.0, 0.0), "kv_handoff_overhead_s": (0.0, None),
          "contention_slowdown": (1.0, 1.0), "frontend_request_cpu_s": (0.0, 0.0),
          "frontend_step_cpu_s": (0.0, 0.0), "frontend_token_cpu_s": (0.0, 0.0), "frontend_dispatch_s": (0.0, 0.0)}
# the SimOptions field each served time sets (``served_sim_options``)
_SIM_TIMES = {"request_overhead_s": "request_overhead_s", "link_overhead_s": "kv_handoff_overhead_s",
              "frontend_request_cpu_s": "frontend_request_cpu_s", "frontend_step_cpu_s": "frontend_step_cpu_s",
              "frontend_token_cpu_s": "frontend_token_cpu_s", "frontend_dispatch_s": "frontend_dispatch_s",
              "stream_step_overhead_s": "stream_step_overhead_s"}


def load_request_overhead(path: str | Path) -> float:
    """``runtime.request_overhead_s`` of a calibration file (0 when it has none)."""
    return _term(_runtime(path), "request_overhead_s")


def load_kv_handoff_overhead(path: str | Path) -> float:
    """``runtime.kv_handoff_overhead_s`` of a calibration file (0 when it has none): the simulator's
    ``link_overhead_s`` (each KV message is delivered this much later than its bytes)."""
    return _term(_runtime(path), "kv_handoff_overhead_s")


def served_efficiency(path: str | Path, slowdown: float = 1.0) -> Efficiency:
    """The calibrated efficiency of a *served* deployment: the engine's, with each sequence's token
    streamed over HTTP/SSE added to its per-sequence cost per iteration (what the simulator must
    charge to predict what clients of the HTTP server see; the planner's ``--efficiency`` reads the
    engine's alone, ``load_efficiency``); ``slowdown``: on a machine that many times slower than at
    calibration (``runtime.speed_probe``)."""
    eff = load_efficiency(path)
    stream = _term(_runtime(path), "stream_overhead_s")
    return replace(eff, seq_overhead_s=eff.seq_overhead_s + stream).at_speed(slowdown)


def foreign_calibration(path: str | Path, devices: Iterable[Device]) -> str | None:
    """A warning when the file was calibrated as a GPU type none of ``devices`` is (its factors are
    then applied to other devices unchanged), naming where it was measured; None when it matches,
    is a plain efficiency mapping (no ``gpu``), or the devices are CPU worker slots alone (those run
    at the calibration's own GPU peaks whatever type they name: ``cost.analytic``)."""
    gpu_types = {d.gpu.name for d in devices if d.cpu_cores is None}
    data = read_mapping(Path(path))
    gpu = data.get("gpu")
    if not gpu_types or not isinstance(gpu, str) or gpu in gpu_types:
        return None
    on = data.get("measured_on") if isinstance(data.get("measured_on"), dict) else {}
    where = ", ".join(str(on[k]) for k in ("device", "date") if on.get(k))
    return (f"{path} was calibrated as {gpu}" + (f" (measured on {where})" if where else "") +
            f"; this pool has {', '.join(sorted(gpu_types))}: its efficiency factors are applied to them unchanged")


# the checkpoint's shape a calibration stamps in ``measured_on.model`` (beside its name): its fixed
# costs and its speed probe are that checkpoint's, so another shape is told apart by these fields
MODEL_SHAPE = ("arch", "num_layers", "hidden", "num_heads", "num_kv_heads", "ffn_hidden", "vocab", "dtype_bytes")


def model_stamp(spec: ModelSpec) -> dict:
    """What ``measured_on.model`` says of the calibrated checkpoint: its name and shape."""
    return {"name": spec.name, **{k: getattr(spec, k) for k in MODEL_SHAPE}}


def foreign_model(path: str | Path, spec: ModelSpec) -> str | None:
    """A warning when the file was calibrated on a checkpoint of another shape than ``spec`` (its
    fixed costs and speed probe are that checkpoint's), naming both; None when the shapes match or
    the file does not say (calibrated before it was stamped, or a plain efficiency mapping)."""
    stamp = _model_of(read_mapping(Path(path)))
    if not _other_shape(stamp, spec):
        return None
    return (f"{path} was calibrated on the checkpoint {_shape(stamp)}; this run's is {_shape(model_stamp(spec))}: "
            "its fixed costs are that checkpoint's")


def calibration_warnings(path: str | Path | None, devices: Iterable[Device], spec: ModelSpec) -> list[str]:
    """What ``compare`` warns of before it serves, as ``plan`` and ``simulate`` do: a calibration
    taken as another GPU type than ``devices`` (``foreign_calibration``) or on a checkpoint of
    another shape than ``spec`` (``foreign_model``)."""
    if not path:
        return []
    return [w for w in (foreign_calibration(path, devices), foreign_model(path, spec)) if w]


def _other_shape(stamp: dict | None, spec: ModelSpec | None) -> bool:
    """Whether a calibration's ``measured_on.model`` stamp is of another shape than ``spec`` (False
    where either is missing: nothing to tell them apart by)."""
    return stamp is not None and spec is not None and any(stamp.get(k) != getattr(spec, k) for k in MODEL_SHAPE)


def _model_of(data: dict) -> dict | None:
    on = data.get("measured_on")
    model = on.get("model") if isinstance(on, dict) else None
    return model if isinstance(model, dict) else None


def _shape(stamp: dict) -> str:
    return (f"{stamp.get('name', '?')} ({stamp.get('arch', '?')}, {stamp.get('num_layers', '?')} layers, hidden "
            f"{stamp.get('hidden', '?')}, {stamp.get('num_heads', '?')}/{stamp.get('num_kv_heads', '?')} heads, FFN "
            f"{stamp.get('ffn_hidden', '?')}, vocab {stamp.get('vocab', '?')}, {stamp.get('dtype_bytes', '?')} bytes "
            "per parameter)")


def load_speed_probe(path: str | Path) -> SpeedReading | None:
    """``speed_probe`` of a calibration file (None: calibrated before the probe existed)."""
    return _speed_probe(_read(path))


def served_sim_options(path: str | Path | None, slowdown: float = 1.0) -> dict:
    """The ``SimOptions`` fields a calibration file sets for simulating a *served* deployment (what
    ``compare``, ``simulate --efficiency`` and ``predict/run`` pass): the request overhead, the
    KV hand-off overhead per message, the contention slow-down, the front end's CPU costs and the
    stream's fixed part per step; the times scaled by ``slowdown`` (``served_efficiency``; the
    contention slow-down is a ratio). ``None``: no calibration, every field at its default."""
    if path is None:
        return {}
    rt = _runtime(path)
    return {**{field: _term(rt, key) * slowdown for field, key in _SIM_TIMES.items()},
            "contention_slowdown": _term(rt, "contention_slowdown")}


def timings_source(path: str | Path | None, pricing: dict[str, str] | None = None) -> str:
    """Where a simulation's times come from, for its table: the calibration file and, where it says,
    the device and date it was measured on; a hand-written efficiency file (no ``efficiency`` key:
    ``load_efficiency``'s flat form) as such, never as a calibration; or, without a file, how the
    cost model prices each GPU type (``CostModel.pricing()``: fitted, transferred or roofline)."""
    if not path:
        from hetserve.cost.kernel_pricing import describe_pricing

        if pricing is None:
            raise ValueError("timings_source: without a calibration file, pass the cost model's pricing()")

        return "cost model (uncalibrated: an estimate), " + describe_pricing(pricing)
    data = _read(path)
    if "efficiency" not in data:  # a flat mapping of Efficiency fields: factors someone wrote, nothing measured
        from hetserve.cost.kernel_pricing import describe_pricing

        return (f"cost model with the efficiency factors of {path} (not a calibration: nothing measured, an "
                "estimate)") + (f", {describe_pricing(pricing)}" if pricing else "")
    on = data.get("measured_on") or {}
    where = ", ".join(str(on[k]) for k in ("device", "date") if on.get(k))
    model = _model_of(data)
    if model:
        where = ", ".join(filter(None, (where, f"checkpoint {model.get('name', '?')}")))
    return f"cost model calibrated by {path}" + (f" (measured on {where})" if where else "")


def speed_reference(efficiency: str | Path | None, correction: bool = True,
                    model: ModelSpec | None = None) -> tuple[SpeedReading | None, str | None]:
    """The calibration's speed-probe reading that ``hetserve compare`` scales its times by, or None,
    and why not where the file holds one (else None). The probe times the checkpoint on one CPU
    thread: it indexes a CPU engine's speed, not a GPU engine's, whose step is set by the host's
    Python and launch path: on an H200 host the probe read the host up to 1.7x faster while the
    served steps ran no faster than calibrated, so the correction made the prediction worse
    (examples/calibrations/README.md). ``model``: the checkpoint ``compare`` reads the probe on
    again; a calibration stamped with another shape timed another checkpoint, and the ratio of two
    checkpoints' times is no speed of the machine."""
    if not efficiency:
        return None, None
    data = _read(efficiency)
    reading = _speed_probe(data)
    if reading is None:
        return None, None
    if not correction:
        return None, "as calibrated (--no-speed-correction)"
    stamp = _model_of(data)
    if _other_shape(stamp, model):
        return None, (f"as calibrated: its speed probe timed the checkpoint {stamp.get('name', '?')}, not "
                      f"{model.name} (another shape: their times' ratio is no speed of the machine)")
    if _on_gpu(data):
        return None, ("as calibrated: its engine ran on a GPU, whose host-bound step the speed probe "
                      "(one CPU thread) does not track")
    return reading, None


def _read(path: str | Path) -> dict:
    """The file's content, its ``runtime`` terms checked (``load_efficiency`` checks the rest)."""
    data = read_mapping(Path(path))
    runtime = data.get("runtime", {})
    if not isinstance(runtime, dict):
        raise SpecError(str(path), "runtime", "a mapping of the serving terms", runtime)
    for key, value in runtime.items():
        if key not in _TERMS:
            raise SpecError(str(path), f"runtime.{key}", "one of " + ", ".join(_TERMS))
        # a time is a finite number of seconds, at least 0; the contention slow-down a ratio above 0
        # (under 1 is read as 1). Refused here, naming the file: a NaN left every simulated request
        # unfinished, a negative one failed in the simulator naming neither the file nor the field
        ratio = key == "contention_slowdown"
        if not of_json_type(value, (int, float)) or not math.isfinite(value) or value < 0 or (ratio and value == 0):
            raise SpecError(str(path), f"runtime.{key}", "a number, finite and > 0 (a ratio)" if ratio else
                            "a number of seconds, finite and >= 0", value)
    _check_speed_probe(path, data.get("speed_probe"))
    return data


def _check_speed_probe(path: str | Path, sp) -> None:
    """``speed_probe`` is null or ``SpeedReading.to_dict``'s mapping: both times finite and above 0
    (``compare`` divides by them after serving, where a zero or a missing one failed with a
    traceback and the served run was lost), ``samples`` a count."""
    if sp is None:
        return
    if not isinstance(sp, dict):
        raise SpecError(str(path), "speed_probe", "a mapping of decode_s, prefill_s, samples or null", sp)
    for key, value in sp.items():
        if key not in ("decode_s", "prefill_s", "samples"):
            raise SpecError(str(path), f"speed_probe.{key}", "one of decode_s, prefill_s, samples", "an unknown field")
    for key in ("decode_s", "prefill_s"):
        value = sp.get(key)
        if not of_json_type(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise SpecError(str(path), f"speed_probe.{key}", "a number of seconds, finite and > 0", value)
    samples = sp.get("samples", 0)
    if not of_json_type(samples, int) or samples < 0:
        raise SpecError(str(path), "speed_probe.samples", "a count (an integer >= 0)", samples)


def _runtime(path: str | Path) -> dict:
    return _read(path).get("runtime", {})


def _term(runtime: dict, key: str) -> float:
    default, floor = _TERMS[key]
    value = float(runtime.get(key, default))
    return value if floor is None else max(floor, value)


def _speed_probe(data: dict) -> SpeedReading | None:
    sp = data.get("speed_probe")
    return SpeedReading.from_dict(sp) if sp else None


def _on_gpu(data: dict) -> bool:
    """The engine ran on a GPU: ``measured_on.gpus``, which ``calibration_probes.machine_info``
    stamps where CUDA was available."""
    on = data.get("measured_on")
    return bool(isinstance(on, dict) and on.get("gpus"))
