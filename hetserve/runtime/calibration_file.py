"""Reading a saved calibration (``hetserve calibrate -o``): what a *served* deployment's simulation
takes from it.

``runtime.calibrate`` measures and fits; this module is the other side of its file, used by
``hetserve compare``, ``simulate --efficiency`` and ``bench/bench_predict.py``: the engine's
efficiency with each token's HTTP/SSE stream added (``served_efficiency``), the ``SimOptions``
fields of the serving overheads, the contention and the front end (``served_sim_options``), both
scaled by the speed probe's slow-down, and the probe's reading itself. The planner reads the
engine's efficiency alone (``cost.analytic.load_efficiency``).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from hetserve.cost.analytic import Efficiency, load_efficiency
from hetserve.runtime.speed_probe import SpeedReading


def load_request_overhead(path: str | Path) -> float:
    """``runtime.request_overhead_s`` of a calibration file (0 when it has none)."""
    return float(_runtime(path).get("request_overhead_s", 0.0))


def load_stream_overhead(path: str | Path) -> float:
    """``runtime.stream_overhead_s`` of a calibration file (0 when it has none)."""
    return float(_runtime(path).get("stream_overhead_s", 0.0))


def load_stream_step_overhead(path: str | Path) -> float:
    """``runtime.stream_step_overhead_s`` of a calibration file (0 when it has none: calibrated
    before it was measured)."""
    return max(0.0, float(_runtime(path).get("stream_step_overhead_s", 0.0)))


def load_kv_handoff_overhead(path: str | Path) -> float:
    """``runtime.kv_handoff_overhead_s`` of a calibration file (0 when it has none): the simulator's
    ``link_overhead_s`` (each KV message is delivered this much later than its bytes)."""
    return float(_runtime(path).get("kv_handoff_overhead_s", 0.0))


def served_efficiency(path: str | Path, slowdown: float = 1.0) -> Efficiency:
    """The calibrated efficiency of a *served* deployment: the engine's, with each sequence's token
    streamed over HTTP/SSE added to its per-sequence cost per iteration (what the simulator must
    charge to predict what clients of the HTTP server see; the planner's ``--efficiency`` reads the
    engine's alone, ``load_efficiency``); ``slowdown``: on a machine that many times slower than at
    calibration (``runtime.speed_probe``)."""
    eff = load_efficiency(path)
    return replace(eff, seq_overhead_s=eff.seq_overhead_s + load_stream_overhead(path)).at_speed(slowdown)


def load_speed_probe(path: str | Path) -> SpeedReading | None:
    """``speed_probe`` of a calibration file (None: calibrated before the probe existed)."""
    data = json.loads(Path(path).read_text())
    sp = data.get("speed_probe") if isinstance(data, dict) else None
    return SpeedReading.from_dict(sp) if sp else None


def load_contention(path: str | Path) -> float:
    """``runtime.contention_slowdown`` of a calibration file (1 when it has none)."""
    return max(1.0, float(_runtime(path).get("contention_slowdown", 1.0)))


def load_frontend_cpu(path: str | Path) -> tuple[float, float, float]:
    """``runtime.frontend_{request,step,token}_cpu_s`` of a calibration file (0 where it has none)."""
    rt = _runtime(path)
    return tuple(max(0.0, float(rt.get(f"frontend_{k}_cpu_s", 0.0))) for k in ("request", "step", "token"))


def load_frontend_dispatch(path: str | Path) -> float:
    """``runtime.frontend_dispatch_s`` of a calibration file (0 when it has none: no GIL probe)."""
    return max(0.0, float(_runtime(path).get("frontend_dispatch_s", 0.0)))


def served_sim_options(path: str | Path | None, slowdown: float = 1.0) -> dict:
    """The ``SimOptions`` fields a calibration file sets for simulating a *served* deployment (what
    ``compare``, ``simulate --efficiency`` and ``bench_predict`` pass): the request overhead, the
    KV hand-off overhead per message, the contention slow-down and the front end's CPU costs; the
    times scaled by ``slowdown`` (``served_efficiency``; the contention slow-down is a ratio).
    ``None``: no calibration, every field at its default."""
    if path is None:
        return {}
    req_cpu, step_cpu, tok_cpu = load_frontend_cpu(path)
    times = {"request_overhead_s": load_request_overhead(path), "link_overhead_s": load_kv_handoff_overhead(path),
             "frontend_request_cpu_s": req_cpu, "frontend_step_cpu_s": step_cpu, "frontend_token_cpu_s": tok_cpu,
             "frontend_dispatch_s": load_frontend_dispatch(path),
             "stream_step_overhead_s": load_stream_step_overhead(path)}
    return {**{k: v * slowdown for k, v in times.items()}, "contention_slowdown": load_contention(path)}


def _runtime(path: str | Path) -> dict:
    data = json.loads(Path(path).read_text())
    return data.get("runtime", {}) if isinstance(data, dict) else {}


def calibrated_on_gpu(path: str | Path) -> bool:
    """Whether the engine of a calibration file ran on a GPU (``measured_on.gpus``, which
    ``calibration_probes.machine_info`` stamps where CUDA was available)."""
    data = json.loads(Path(path).read_text())
    on = data.get("measured_on") if isinstance(data, dict) else None
    return bool(isinstance(on, dict) and on.get("gpus"))


def speed_reference(efficiency: str | Path | None, correction: bool = True) -> tuple[SpeedReading | None, str | None]:
    """The calibration's speed-probe reading that ``hetserve compare`` scales its times by, or None,
    and why not where the file holds one (else None). The probe times the checkpoint on one CPU
    thread: it indexes a CPU engine's speed, not a GPU engine's, whose step is set by the host's
    Python and launch path. On one H200, four sets of three cells came within ±15 %
    in 77 of 156 figures as calibrated and 65 with the probe's correction; in the last set the probe
    read the host x0.59 in every cell while the served steps ran no faster than calibrated, and the
    correction took 21 of 39 to 5 (examples/calibrations/README.md)."""
    if not efficiency:
        return None, None
    reading = load_speed_probe(efficiency)
    if reading is None:
        return None, None
    if not correction:
        return None, "as calibrated (--no-speed-correction)"
    if calibrated_on_gpu(efficiency):
        return None, ("as calibrated: its engine ran on a GPU, whose host-bound step the speed probe "
                      "(one CPU thread) does not track")
    return reading, None
