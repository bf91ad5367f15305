"""Calibrate the cost model (and the serving overheads) to the machine the engine runs on.

The cost model prices work as datasheet peaks times ``Efficiency`` fractions plus fixed costs where
the runtime pays them (docs/cost-model.md). Where the workers are not the GPUs the cluster file
names (the CPU demo, a new GPU) those numbers are unknown, so this module measures them: it serves
the checkpoint on one device (the real engine behind the real HTTP server), and in interleaved
rounds times prompts of several lengths and decode batches of several sizes on the engine and
through HTTP, a prompt and decodes on a two-stage pipeline and on one stage of TP 2
(``calibration_probes.measure``).

``fit`` solves for the efficiencies and fixed costs by least squares on log(predicted / measured),
each term from the probes that isolate it, in stages: the one-device points (compute, attention,
memory, the per-sequence and per-iteration costs, then again with a prompt step's own cost), the
two-stage points (the per-stage part of the fixed cost and the share of the turn-around that holds
the last stage), the TP 2 points (the per-collective cost and its per-byte part). Fitting all at
once lets the noisy two-device probes move the one-device terms. Memory efficiency keeps its
default where no decode probe is bandwidth-bound, since then no value of it is measured.

The HTTP probes give what a served request spends outside the engine (``request_overhead_s``), what
streaming a step's tokens adds (``stream_step_overhead_s`` + ``stream_overhead_s`` per sequence),
the front end's CPU per request, step and token, and its GIL wait (``frontend_dispatch_s``): the
simulator's model of the serving process on shared cores (``sim.hosts``). Each point's fit error is
reported, as the cost model's error on this machine. The result is one JSON file
(``Calibration.save``) that ``plan --efficiency`` and ``simulate``/``compare --efficiency`` read,
stamped with the device, the date and the load average during the measurement.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
from scipy.optimize import least_squares

from hetserve.cost.analytic import CostModel
from hetserve.cost.efficiency import Efficiency
from hetserve.calibration.probes import DECODE_PROMPT, LONG_DECODE_PROMPT, machine_info, measure
from hetserve.calibration.overhead_fit import fit_frontend_cpu, request_overhead, stream_overheads
from hetserve.calibration.probe_shapes import one_device_cluster, probe_layout
from hetserve.calibration.speed_probe import SpeedReading, combine
from hetserve.calibration.file import model_stamp
from hetserve.output_path import write_whole
from hetserve.specs.model import load_model


@dataclass(frozen=True)
class CalibrationPoint:
    phase: str  # "prefill" or "decode"
    size: int  # prompt tokens (prefill) or batch size (decode)
    measured_s: float
    predicted_s: float
    stages: int = 1  # pipeline stages of the replica measured (2: the pipeline probes)
    tp: int = 1  # its TP degree (2: the TP probes)
    prompt: int = 0  # decode probes: each sequence's prompt tokens (its context less the tokens decoded)

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
    # per KV hand-off beyond the link's α-β time: the prefill worker's step message, reading and
    # pickling the KV, the socket, the pool write on the decode worker's receiving thread, the acks
    kv_handoff_overhead_s: float = 0.0
    contention_slowdown: float = 1.0  # a worker's CPU time per decode probe beside one more busy worker / alone
    measured_on: dict = field(default_factory=dict)  # device, cores, date, load average
    # CPU seconds the front end (HTTP/SSE server, coordinator, replaying client: one process) spends
    # per request and per output token: the simulator's front-end CPU consumer (``sim.hosts``)
    frontend_request_cpu_s: float = 0.0
    frontend_token_cpu_s: float = 0.0
    frontend_step_cpu_s: float = 0.0  # per engine step: the coordinator's result, scheduling and next step
    frontend_points: tuple = ()  # FrontEndPoint per HTTP probe: the front-end fit's error per point
    # seconds a replica's next step waits for the front end (its GIL) per unit of the front end's
    # utilisation by other work (``sim.hosts``): the GIL probe's median delay per step per unit of
    # the GIL-holding thread's share
    frontend_dispatch_s: float = 0.0
    memory_bound: bool = True  # a decode probe is bandwidth-bound at the fitted memory efficiency (else: the default)
    speed_probe: SpeedReading | None = None  # the machine's speed index over the rounds (runtime.speed_probe)
    # per decoding step: the fixed part of streaming its tokens over HTTP/SSE, beyond
    # ``stream_overhead_s`` per sequence (the intercept of served − engine TPOT over the batch sizes)
    stream_step_overhead_s: float = 0.0
    http_tpot: dict = field(default_factory=dict)  # batch size -> median TPOT through HTTP (the stream fit's data)

    @property
    def mean_abs_error(self) -> float:
        return float(np.mean([abs(p.error) for p in self.points]))

    @property
    def max_abs_error(self) -> float:
        return float(max(abs(p.error) for p in self.points))

    def save(self, path: str | Path) -> None:
        """JSON that ``cost.analytic.load_efficiency`` (``plan/simulate --efficiency``) reads; the
        simulator also reads its ``runtime`` terms (``runtime.calibration_file``). Written whole or
        not at all (``write_whole``): a run stopped while writing leaves the earlier calibration."""
        write_whole(path, json.dumps({
            "gpu": self.gpu, "efficiency": asdict(self.efficiency), "mean_abs_error": self.mean_abs_error,
            "max_abs_error": self.max_abs_error, "memory_bound": self.memory_bound, "runtime": {"request_overhead_s": self.request_overhead_s,
                                                           "stream_overhead_s": self.stream_overhead_s,
                                                           "stream_step_overhead_s": self.stream_step_overhead_s,
                                                           "kv_handoff_overhead_s": self.kv_handoff_overhead_s,
                                                           "contention_slowdown": self.contention_slowdown,
                                                           "frontend_request_cpu_s": self.frontend_request_cpu_s,
                                                           "frontend_token_cpu_s": self.frontend_token_cpu_s,
                                                           "frontend_step_cpu_s": self.frontend_step_cpu_s,
                                                           "frontend_dispatch_s": self.frontend_dispatch_s},
            "measured_on": self.measured_on, "points": [asdict(p) for p in self.points],
            "speed_probe": self.speed_probe.to_dict() if self.speed_probe else None,
            "frontend_points": [asdict(p) for p in self.frontend_points],
            "http_tpot": {str(b): t for b, t in sorted(self.http_tpot.items())}}, indent=2) + "\n")


def _memory_binds(cm: CostModel, layout, batch: int, context: float) -> bool:
    """Whether the decode step of ``batch`` sequences is bandwidth-bound at ``cm``'s efficiency: its
    time drops by more than 1 % when memory efficiency rises to 1 (a fit may stop just inside the
    bound, where the efficiency still prices next to nothing)."""
    faster = CostModel(cm.cluster, cm.model, replace(cm.eff, memory=1.0))
    return faster.decode_step_time(layout, batch, context) < cm.decode_step_time(layout, batch, context) * 0.99


def _per_byte_scale(cluster, spec, **per_byte: float) -> CostModel:
    """A cost model pricing nothing but one per-byte term at 1 s per byte: its time for a probe is the
    bytes that probe pays the term on (``fit`` fits the term as seconds over them, so its unknowns
    share one scale), counted by the cost model's own formula rather than a copy of it."""
    return CostModel(cluster, spec, replace(Efficiency(), **per_byte))


def turn_hold(cm: CostModel, layout, rounds, decode_tokens: int) -> float | None:
    """The share of the turn-around that holds a pipeline's last stage (``Efficiency.turn_hold``)
    from decodes of two or more sequences on it (``rounds``: ``fit``'s probe tuples, each sequence
    a micro-batch up to one per stage): the share at which the last stage's bound, ``m · (last − (1 − h) · turn)``, is the measured
    round; the median over the probes, within [0, 1]. The round is ``max`` of that bound and the
    front end's, ``m · (1 − h) · turn``, so a round below both has two solutions; the last stage's is
    the one that grows with the batch, as the measured rounds do (the front end's bound barely
    grows with it)."""
    shares = []
    for _, n, _, _, prompt, seconds in rounds:
        round_ = cm.decode_round(layout, n)
        times = round_.stage_times(n * (prompt + decode_tokens / 2))
        turn = round_.turn_around(times)
        if turn > 0:
            shares.append(1.0 - (times[-1] - seconds / round_.micro_batches) / turn)
    return float(np.clip(statistics.median(shares), 0.0, 1.0)) if shares else None


def fit(model_dir: str, gpu_name: str, ttft: dict[int, float], tpot: dict[int, float],
        base: Efficiency | None = None, decode_prompt_tokens: int = DECODE_PROMPT, decode_tokens: int = 24,
        http_ttft: dict[int, float] | None = None, measured_on: dict | None = None,
        contention: float = 1.0, pp_ttft: dict[int, float] | None = None,
        pp_tpot: dict[int, float] | None = None, http_tpot: dict[int, float] | None = None,
        tp_ttft: dict[int, float] | None = None, tp_tpot: dict[int, float] | None = None,
        kv_handoff: dict[int, float] | None = None, frontend_cpu=None, attention: bool = True,
        dispatch: list[float] | None = None, speed_probe: SpeedReading | None = None,
        tpot_long: dict[int, float] | None = None, long_prompt_tokens: int = LONG_DECODE_PROMPT,
        outside: tuple[list[float], list[float]] | None = None, multi_row: bool = True,
        collective_bytes: bool = True, prompt_fixed: bool = True) -> Calibration:
    """Solve for compute, attention and memory efficiency and the fixed costs per iteration, per
    stage, per prompt step, per sequence and per TP collective (least squares on the log of predicted
    / measured, in stages: the one-device points (twice: then with the prompt step's cost), then the
    two-stage points for the per-stage part, then the TP 2
    points for the per-collective cost; memory efficiency stays ``base``'s where no decode point is
    bandwidth-bound, ``Calibration.memory_bound``), the GIL wait the median of ``dispatch``; the request
    overhead ``request_overhead(http_ttft, ttft, outside)``, the stream overheads per step and per
    sequence ``stream_overheads(http_tpot, tpot)``, the KV
    hand-off overhead the median of the measured hand-off
    (``kv_handoff``: prompt tokens -> seconds) − the cost model's transfer time for that KV, the
    front end's CPU per request and per token ``fit_frontend_cpu(frontend_cpu)``.

    Without pipeline points (``pp_ttft``/``pp_tpot``) a stage's fixed cost cannot be told from the
    iteration's: all of it is fitted as ``iteration_overhead_s`` (exact for one-stage replicas).
    Without TP points (``tp_ttft``/``tp_tpot``, one stage on TP 2) ``collective_overhead_s`` is 0.
    ``attention`` (and three or more prompt lengths): attention's FLOPs get their own efficiency
    (``Efficiency.attention``), which lets a prompt's time per token grow with its length as measured.
    ``tpot_long`` (batch -> TPOT of sequences started from ``long_prompt_tokens``-token prompts): a
    decode step's attention over its context gets its own efficiency (``Efficiency.decode_attention``),
    which lets a decode step's time grow with its context as measured. ``multi_row`` (a one-sequence
    decode probe beside larger ones): the matrix products' extra cost once a step has more than one
    row (``Efficiency.multi_row_s_per_byte``). ``collective_bytes`` (a TP prompt beside the TP
    decode): the collectives' cost per byte beside their fixed cost (``Efficiency.collective_s_per_byte``).
    ``prompt_fixed`` (two or more prompt lengths beside the decode probes): what a stage spends on a
    step that carries a prompt beyond a decode step's fixed costs (``Efficiency.prompt_step_overhead_s``);
    without it short prompts are priced low and long ones high."""
    spec = load_model(model_dir)
    pp_ttft, pp_tpot, tp_ttft, tp_tpot = pp_ttft or {}, pp_tpot or {}, tp_ttft or {}, tp_tpot or {}
    cluster = one_device_cluster(gpu_name, 2 if pp_ttft or pp_tpot or tp_ttft or tp_tpot else 1)
    shapes = {(1, 1): probe_layout(spec), (2, 1): probe_layout(spec, 2), (1, 2): probe_layout(spec, 1, 2)}
    base = replace(base or Efficiency(), step_overhead_s=0.0, iteration_overhead_s=0.0, seq_overhead_s=0.0,
                   collective_overhead_s=0.0, attention=0.0, decode_attention=0.0,
                   multi_row_s_per_byte=0.0, collective_s_per_byte=0.0, prompt_step_overhead_s=0.0)
    attention = attention and len(ttft) >= 3  # its own efficiency needs the curvature of three lengths
    tpot_long = tpot_long or {}
    short = decode_prompt_tokens
    # (phase, size, stages, tp, decode prompt, seconds)
    probes = [(ph, n, st, t_, 0 if ph == "prefill" else L, sec)
              for ph, st, t_, L, d in (("prefill", 1, 1, 0, ttft), ("decode", 1, 1, short, tpot),
                                       ("decode", 1, 1, long_prompt_tokens, tpot_long),
                                       ("prefill", 2, 1, 0, pp_ttft), ("decode", 2, 1, short, pp_tpot),
                                       ("prefill", 1, 2, 0, tp_ttft), ("decode", 1, 2, short, tp_tpot))
              for n, sec in d.items()]

    def predict(eff: Efficiency, subset=None):
        cm = CostModel(cluster, spec, eff)
        return np.array([cm.ttft(shapes[st, t_], n) if ph == "prefill"
                         else cm.decode_step_time(shapes[st, t_], n, n * (L + decode_tokens / 2))
                         for ph, n, st, t_, L, _ in (probes if subset is None else subset)])

    measured = np.array([sec for *_, sec in probes])

    def solve(subset, eff_of, x0s, lo, hi_):
        """Least squares of the log error over ``subset``'s points: the best of a few starts (the
        roofline's max() makes the surface piecewise)."""
        meas = np.array([sec for *_, sec in subset])
        best = None
        for x0 in x0s:
            r = least_squares(lambda x: np.log(predict(eff_of(x), subset) / meas), x0, bounds=(lo, hi_))
            if best is None or r.cost < best.cost:
                best = r
        return best.x

    # Each term from the probes that isolate it (a joint fit let the noise of the two-device probes
    # move the one-device terms): (1) the one-device prompts and decode batches give compute,
    # attention and memory efficiency, the per-sequence cost and the fixed cost of a one-stage
    # iteration; (2) the two-stage probes split that fixed cost into its per-stage and
    # per-iteration parts; (3) the TP 2 probes give the per-collective cost and the cost per byte
    # the collectives carry. Then every point is priced by the one result.
    hi = float(max(measured))
    one = [p for p in probes if p[2] == 1 and p[3] == 1]

    long_decode = bool(tpot_long)
    # What a step's matrix products cost once they multiply more than one row (a GEMM where one row
    # is a matrix-vector product): the first added sequence costs several times each later one, so
    # a line through b = 1, 4, 16 misprices the small batches a server mostly runs. Fitted as
    # seconds over the one-device replica's weights (the unknowns of one scale); it needs a
    # one-sequence decode beside decodes of more.
    multi_row = multi_row and 1 in tpot and any(b > 1 for b in tpot)
    one_bytes = _per_byte_scale(cluster, spec, multi_row_s_per_byte=1.0).multi_row_time(shapes[1, 1].stages[0], 2, 2, True)

    def eff_one(x) -> Efficiency:
        # attention's efficiencies as fractions of compute's, at most 1: the small products over a
        # context never run faster than the weight GEMMs (free, the fit ran it to the bound 1.0 on a
        # noisy prompt curve, i.e. attention for nothing)
        return replace(base, compute=float(10 ** x[0]), memory=float(10 ** x[1]),
                       iteration_overhead_s=float(x[2]), seq_overhead_s=float(x[3]),
                       attention=float(10 ** (x[0] + x[4])) if attention else 0.0,
                       decode_attention=float(10 ** (x[0] + x[5])) if long_decode else 0.0,
                       multi_row_s_per_byte=float(x[6]) / one_bytes if multi_row else 0.0)

    starts = [np.array([c0, c0, 0.4 * float(min(measured)), 0.0, -0.5, -1.0, 0.0]) for c0 in (-5.0, -3.0, -1.0)]
    x_one = solve(one, eff_one, starts, [-9, -9, 0.0, 0.0, -9, -9, 0.0], [0, 0, hi, hi, 0, 0, hi])
    eff = eff_one(x_one)
    if prompt_fixed and len(ttft) >= 2 and tpot:
        # (1b) What a step carrying a prompt pays beyond a decode step's fixed costs, fitted with the
        # other one-device terms again but memory efficiency held at (1)'s: with it free, the
        # prompts' own intercept let the decodes' fixed costs turn into a bandwidth bound (memory
        # 0.0025 of peak, ``iteration_overhead_s`` 0) that priced the pipeline probes 10-37 % off.
        def eff_prompt(x) -> Efficiency:  # eff_one's unknowns less memory, then the prompt step's cost
            return replace(eff_one(np.r_[x[0], x_one[1], x[1:6]]), prompt_step_overhead_s=float(x[6]))

        # from (1)'s solution, with no prompt cost and with one of a tenth of the shortest probe
        x1 = [np.r_[np.delete(x_one, 1), p0] for p0 in (0.0, 0.1 * float(min(measured)))]
        eff = eff_prompt(solve(one, eff_prompt, x1, [-9, 0.0, 0.0, -9, -9, 0.0, 0.0], [0, hi, hi, 0, 0, hi, hi]))
    memory_bound = any(p[0] == "decode" and _memory_binds(CostModel(cluster, spec, eff), shapes[1, 1], p[1],
                                                          p[1] * (p[4] + decode_tokens / 2))
                       for p in one)
    if not memory_bound:
        # No probe is bandwidth-bound at this efficiency: every value above it prices them alike, so
        # it is not measured (left free, it wanders tenfold between calibrations): keep the default.
        eff = replace(eff, memory=max(eff.memory, base.memory))
    lump = eff.iteration_overhead_s  # what one stage pays per iteration: its step + the iteration's turn-around
    # one micro-batch on two stages: the split; two micro-batches (a decode of two): the turn-around's hold
    two = [p for p in probes if p[2] == 2 and not (p[0] == "decode" and p[1] > 1)]
    rounds = [p for p in probes if p[2] == 2 and p[0] == "decode" and p[1] > 1]
    if two and lump > 0:
        split_of = lambda x: replace(eff, step_overhead_s=float(x[0]), iteration_overhead_s=lump - float(x[0]))  # noqa: E731
        eff = split_of(solve(two, split_of, [np.array([0.25 * lump])], [0.0], [lump]))
        if rounds:
            eff = replace(eff, turn_hold=turn_hold(CostModel(cluster, spec, eff), shapes[2, 1], rounds, decode_tokens))
    tp_pts = [p for p in probes if p[3] == 2]
    if tp_pts:
        # With a TP prompt beside the TP decode, the collectives' cost splits into a fixed part per
        # collective and a part per byte they carry (a prompt's are its tokens' activations): one
        # fixed cost prices the decode over and the prompt under by 10-18 %.
        per_byte = collective_bytes and {p[0] for p in tp_pts} == {"prefill", "decode"}
        # the per-byte unknown as seconds over the largest probe's bytes (the unknowns of one scale)
        scale = _per_byte_scale(cluster, spec, collective_s_per_byte=1.0).collective_bytes_time(
            shapes[1, 2].stages[0], max(p[1] for p in tp_pts))

        def col_of(x) -> Efficiency:
            return replace(eff, collective_overhead_s=float(x[0]),
                           collective_s_per_byte=float(x[1]) / scale if per_byte else 0.0)
        eff = col_of(solve(tp_pts, col_of, [np.array([0.01 * float(min(measured)), 0.0])], [0.0, 0.0], [hi, hi]))
    points = tuple(CalibrationPoint(ph, n, sec, float(p), st, t_, L)
                   for (ph, n, st, t_, L, sec), p in zip(probes, predict(eff)))
    overhead = request_overhead(http_ttft, ttft, outside)
    stream_step, stream = stream_overheads(http_tpot, tpot)
    two = one_device_cluster(gpu_name, 2)
    cm2 = CostModel(two, spec, eff)
    handoff = max(0.0, statistics.median(t - cm2.kv_transfer_time(probe_layout(spec), probe_layout(spec, 1, 1, first_device=1), L)
                                         for L, t in kv_handoff.items())) if kv_handoff else 0.0
    (req_cpu, step_cpu, tok_cpu), fe_points = fit_frontend_cpu(frontend_cpu)
    return Calibration(gpu_name, eff, points, overhead, stream, handoff, contention, measured_on or {},
                       req_cpu, tok_cpu, step_cpu, fe_points,
                       max(0.0, statistics.median(dispatch)) if dispatch else 0.0, memory_bound, speed_probe,
                       stream_step, dict(http_tpot or {}))


def calibrate(model_dir: str, gpu_name: str, **kwargs) -> Calibration:
    """Measure the engine (and the server) on this machine and fit the cost model to it
    (``progress``, where given, is told each phase: ``measure``'s, then the fit)."""
    m = measure(model_dir, gpu_name, **kwargs)
    if kwargs.get("progress"):
        kwargs["progress"]("fitting the cost model", kwargs.get("reps", 5), kwargs.get("reps", 5))
    info = machine_info()
    info["model"] = model_stamp(load_model(model_dir))  # its fixed costs and speed probe are this checkpoint's
    info["load_avg_1m"] = round(float(np.mean(m.load_avg)), 2) if m.load_avg else info["load_avg_1m"]
    return fit(model_dir, gpu_name, m.ttft, m.tpot, decode_tokens=kwargs.get("decode_tokens", 24),
               http_ttft=m.http_ttft, measured_on=info, contention=m.contention, pp_ttft=m.pp_ttft,
               pp_tpot=m.pp_tpot, http_tpot=m.http_tpot, tp_ttft=m.tp_ttft, tp_tpot=m.tp_tpot,
               kv_handoff=m.kv_handoff, frontend_cpu=m.frontend_cpu, dispatch=m.dispatch,
               speed_probe=combine(m.speed) if m.speed else None, tpot_long=m.tpot_long,
               outside=(m.http_outside, m.engine_outside))
