"""The measurements ``hetserve calibrate`` fits the cost model to (``calibration/calibrate.py`` fits).

One colocated replica of the checkpoint on one device, served by the real engine behind the real
HTTP server, probed in interleaved rounds (the load of a shared machine drifts): single prompts of
several lengths (TTFT), decode batches of several sizes (TPOT), the same through HTTP with the
``openai`` client, and a prompt and a one-sequence decode on a two-stage pipeline and on one stage
of TP 2 of the same checkpoint, and the KV hand-off of that prompt from a prefill to a decode
replica; then the largest decode batch alone and beside one more busy worker-like process, interleaved (the
contention slow-down: the ratio of the worker's own CPU time). The replicas probed are
``probe_shapes``', which the fit prices too.
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hetserve.errors import SpecError

from hetserve.calibration.host_load import burn, cpu_meter, cpu_ns, gil_load, idle_cpu_rate
from hetserve.calibration.probe_shapes import handoff_plan, one_device_cluster, one_device_plan, tp_divides
from hetserve.calibration.speed_probe import paired_round_median, round_median
from hetserve.specs.model import load_model


# Every probed worker runs one torch thread: the probes' engines run side by side (more threads
# would oversubscribe the cores), and `hetserve compare` serves at the same count.
PROBE_THREADS = 1
DECODE_PROMPT = 16  # prompt tokens of each sequence of the decode probes
LONG_DECODE_PROMPT = 256  # ... and of the long-context decode probe
# The noisiest probes, the TP 2 probe and the two-stage pipeline's prompt, are taken this many times
# in each round (1: after the one-device probes; 2: and at the round's end; 3: and at its start),
# where every other probe is taken once. Each is two worker processes handing work to each other, so
# on shared cores a spell of seconds in which either waits for a core stretches the probe (single TP
# decodes read 2x the median now and then): three samples a round, priced by their median, narrow its
# spread by about a third, where one sample a round let one slow spell set a calibration's TP price.
NOISY_SAMPLES_PER_ROUND = 3


def machine_info() -> dict:
    """Where a measurement was taken: the device the engine ran on (the GPU's name where CUDA is
    available: the engine's ``device="auto"`` then runs there; else the CPU model), the host's CPU
    and cores, date (UTC), load average now."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    info = {"device": cpu, "cores": os.cpu_count(), "date": datetime.datetime.now(datetime.timezone.utc)
            .strftime("%Y-%m-%d %H:%M UTC"), "load_avg_1m": round(load[0], 2)}
    import torch

    if torch.cuda.is_available():
        info.update(device=f"{torch.cuda.get_device_name(0)} (CUDA {torch.version.cuda}, torch {torch.__version__})",
                    host_cpu=cpu, gpus=torch.cuda.device_count())
    return info


@dataclass
class Measurements:
    ttft: dict[int, float]  # prompt length -> median TTFT on the engine (s)
    tpot: dict[int, float]  # batch size -> median TPOT on the engine (s)
    # batch size -> median TPOT of sequences started from a LONG_DECODE_PROMPT-token prompt: a decode
    # step's cost per context token (its attention over the KV) beside the short-context probes
    tpot_long: dict[int, float] = field(default_factory=dict)
    http_ttft: dict[int, float] = field(default_factory=dict)  # prompt length -> median TTFT through HTTP
    # batch size -> TPOT streamed through HTTP: the engine's median plus the median of the rounds'
    # HTTP − engine differences (``speed_probe.paired_round_median``)
    http_tpot: dict[int, float] = field(default_factory=dict)
    # batch size -> (round, seconds) of every round: the engine's and the HTTP decode probes, raw
    # (``bench/bench_overhead.py`` differences them both ways)
    tpot_rounds: dict[int, list[tuple[int, float]]] = field(default_factory=dict)
    http_tpot_rounds: dict[int, list[tuple[int, float]]] = field(default_factory=dict)
    # Per request, its TTFT less the span of its own prompt step (the coordinator's ``step_times``):
    # through HTTP (what the server and the client add, plus the engine's own hand-on) and on the
    # engine (the hand-on alone). Paired within one request, so the machine's drift between the
    # probes cancels; the request overhead is the difference of their medians (``calibrate.fit``).
    http_outside: list[float] = field(default_factory=list)
    engine_outside: list[float] = field(default_factory=list)
    contention: float = 1.0  # the worker's CPU time for the largest decode probe beside one busy process / alone
    load_avg: list[float] = field(default_factory=list)  # 1-minute load average during the run
    pp_ttft: dict[int, float] = field(default_factory=dict)  # two-stage pipeline: prompt length -> median TTFT
    # two-stage pipeline: batch size -> median TPOT; 2 (two micro-batches of one): the one-sequence
    # median plus the rounds' paired difference, as ``http_tpot`` (what a second micro-batch adds)
    pp_tpot: dict[int, float] = field(default_factory=dict)
    tp_ttft: dict[int, float] = field(default_factory=dict)  # one stage on TP 2: prompt length -> median TTFT
    tp_tpot: dict[int, float] = field(default_factory=dict)  # one stage on TP 2: batch size -> median TPOT
    # the (round, seconds) samples of the probes taken NOISY_SAMPLES_PER_ROUND times a round, raw:
    # "tp_ttft" and "tp_tpot" (TP 2: the prompt, one sequence), "pp_ttft" (the two-stage prompt)
    noisy_rounds: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    kv_handoff: dict[int, float] = field(default_factory=dict)  # prefill -> decode slot: prompt -> median hand-off (s)
    # the front end's dispatch wait: (engine TPOT of the dispatch probe beside a GIL-holding thread −
    # alone) / that thread's utilisation, per round ("the GIL probe"; seconds per unit of utilisation)
    dispatch: list[float] = field(default_factory=list)
    # the front end's CPU (server, coordinator and client: this process) per HTTP probe:
    # (requests, engine steps, output tokens, CPU seconds beyond this process's idle rate and a
    # replay's own start and end: the client's set-up, measured with an empty replay)
    frontend_cpu: list[tuple[int, int, int, float]] = field(default_factory=list)
    speed: list = field(default_factory=list)  # a SpeedReading per round (runtime.speed_probe)


def measure(model_dir: str, gpu_name: str, prompt_lengths=(32, 128, 256, 512), batch_sizes=(1, 4, 16),
            decode_tokens: int = 24, reps: int = 5, serving: bool = True, pipeline: bool = True,
            tp: bool = True, handoff: bool = True, speed: bool = True, long_decode: bool = True,
            progress=None) -> Measurements:
    """Median TTFT per prompt length and median TPOT per batch size on the engine (``long_decode``:
    and of one batch started from LONG_DECODE_PROMPT-token prompts, the decode's cost per context
    token: served contexts are prompts long, the other decode probes' 16 tokens), (``serving``)
    median TTFT of the same prompts and TPOT of the same batches through the HTTP server and the
    ``openai`` client, and the TTFT of the second prompt length and the TPOT of one sequence on a
    two-stage pipeline (``pipeline``, checkpoints of two or more layers) and on one stage of TP 2
    (``tp``, heads and FFN divisible by 2; it and the two-stage prompt ``NOISY_SAMPLES_PER_ROUND``
    times a round), and
    (``handoff``) the KV hand-off of that prompt from a prefill replica to a decode replica (the
    coordinator's send to the last acknowledgement), and (``speed``) the machine's speed index in
    every round (``runtime.speed_probe``), which ``hetserve compare`` reads again when it serves;
    each round's times are then scaled to the speed of the median reading
    (``speed_probe.round_median``). ``progress(phase, rounds_done, reps)`` is told each phase."""
    from hetserve.runtime.engine import Engine
    from hetserve.runtime.engine_config import EngineConfig
    from hetserve.runtime.params import SamplingParams

    spec = load_model(model_dir)
    cluster = one_device_cluster(gpu_name)
    plan = one_device_plan(spec, cluster)
    rng = np.random.default_rng(0)
    fitting = [L for L in prompt_lengths if L + decode_tokens < spec.max_context]  # the others are skipped
    if not fitting:
        raise SpecError(model_dir, "max_position_embeddings", f"a context above {min(prompt_lengths) + decode_tokens} "
                        f"tokens (the shortest probe prompt + {decode_tokens} decode tokens)", spec.max_context)
    prompt_lengths = fitting
    long_b = min(4, max(batch_sizes))
    long_decode = long_decode and LONG_DECODE_PROMPT + decode_tokens < spec.max_context
    # KV tokens of every probe replica: twice what the largest probe holds at once. Not what memory
    # allows: the probes' cluster names one GPU type for worker slots that may share one real device
    # (on a one-GPU machine every slot of the pipeline, TP and hand-off probes is cuda:0), and a
    # pool sized to the datasheet's memory per slot would not fit beside the others.
    kv_tokens = 2 * max(max(batch_sizes) * (DECODE_PROMPT + decode_tokens), max(prompt_lengths) + decode_tokens,
                        long_b * (LONG_DECODE_PROMPT + decode_tokens) if long_decode else 0)
    m = Measurements({}, {})

    def prefill(eng, L: int) -> float:
        h = eng.submit(rng.integers(32, 127, L).tolist(), SamplingParams(max_tokens=1, ignore_eos=True))
        h.result(timeout=120)
        return h.ttft

    def with_prompt_steps(fn):
        """``fn()`` with the main engine's coordinator timing its steps: (its result, the spans of
        the steps that carried prompts, in the order they started)."""
        engine.loop.step_times = []
        try:
            out = fn()
        finally:
            steps, engine.loop.step_times = engine.loop.step_times, None
        return out, [t.seconds for t in sorted(steps, key=lambda t: t.started) if t.prompt_tokens]

    def decode(eng, b: int, prompt: int = DECODE_PROMPT) -> float:
        handles = [eng.submit(rng.integers(32, 127, prompt).tolist(),
                              SamplingParams(max_tokens=decode_tokens, ignore_eos=True)) for _ in range(b)]
        for h in handles:
            h.result(timeout=120)
        return statistics.median(h.tpot for h in handles)

    say = progress or (lambda phase, done, total: None)
    say("starting the probe engines", 0, reps)
    server = pp = tp2 = pd = None
    if serving:
        from hetserve.serve.launch import ServeOptions, start_server

        server = start_server(ServeOptions(plan=plan, cluster=cluster, model_dir=str(model_dir),
                                           max_num_seqs=max(batch_sizes), kv_capacity_tokens=kv_tokens,
                                           engine_options={"threads_per_worker": PROBE_THREADS}))
        engine = server.deployment.engine
    else:
        engine = Engine.from_plan(plan, cluster, model_dir,
                                  EngineConfig(max_num_seqs=max(batch_sizes), kv_capacity_tokens=kv_tokens,
                                               threads_per_worker=PROBE_THREADS))
    try:
        pp_prompt = prompt_lengths[min(1, len(prompt_lengths) - 1)]
        if pipeline and spec.num_layers >= 2:
            # A two-stage pipeline of the same checkpoint, probed in the same rounds (the load drifts):
            # one micro-batch, so what it adds to one stage is the second stage's fixed cost and hand-on;
            # and two (two sequences): how much of the turn-around holds the last stage meanwhile.
            cluster2 = one_device_cluster(gpu_name, 2)
            pp = Engine.from_plan(one_device_plan(spec, cluster2, 2), cluster2, model_dir,
                                  EngineConfig(max_num_seqs=4, kv_capacity_tokens=kv_tokens, threads_per_worker=PROBE_THREADS))
            pp.generate([[65] * 8], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        if tp and tp_divides(spec, 2):
            # One stage on TP 2: what it adds beyond half the compute is its collectives' fixed cost.
            cluster2 = one_device_cluster(gpu_name, 2)
            tp2 = Engine.from_plan(one_device_plan(spec, cluster2, 1, 2), cluster2, model_dir,
                                   EngineConfig(max_num_seqs=4, kv_capacity_tokens=kv_tokens, threads_per_worker=PROBE_THREADS))
            tp2.generate([[65] * 8], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        if handoff:
            cluster2 = one_device_cluster(gpu_name, 2)
            pd = Engine.from_plan(handoff_plan(spec, cluster2), cluster2, model_dir,
                                  EngineConfig(max_num_seqs=4, kv_capacity_tokens=kv_tokens, threads_per_worker=PROBE_THREADS))
            pd.generate([[65] * 8], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
        engine.generate([[65] * 8], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        if server is not None:  # the client's and the server's first request import and build things once
            from hetserve.serve.loadgen import LoadRequest, replay

            replay(server.url, Path(model_dir).resolve().name, [LoadRequest(0.0, [65] * 8, 2)], ignore_eos=True)
        # Rounds over every probe (not every probe's repetitions in a row): on a shared machine the
        # load drifts, and interleaving spreads it over all points instead of biasing some.
        # per probe, (round, seconds) of every round
        ttft_s: dict[int, list[tuple[int, float]]] = {L: [] for L in prompt_lengths}
        tpot_s: dict[int, list[tuple[int, float]]] = {b: [] for b in batch_sizes}
        long_s: list[tuple[int, float]] = []
        http_s: dict[int, list[tuple[int, float]]] = {L: [] for L in prompt_lengths}
        http_tpot_s: dict[int, list[tuple[int, float]]] = {b: [] for b in batch_sizes}
        pp_ttft_s: list[tuple[int, float]] = []
        pp_tpot_s: list[tuple[int, float]] = []
        pp_round_s: list[tuple[int, float]] = []  # two sequences: two micro-batches in flight
        tp_ttft_s: list[tuple[int, float]] = []
        tp_tpot_s: list[tuple[int, float]] = []
        handoff_s: list[tuple[int, float]] = []
        probe = None
        if speed:
            from hetserve.calibration.speed_probe import SpeedProbe

            probe = SpeedProbe(model_dir)

        def noisy_sample(rnd: int) -> None:
            if tp2 is not None:
                tp_ttft_s.append((rnd, prefill(tp2, pp_prompt)))
                tp_tpot_s.append((rnd, decode(tp2, 1)))
            if pp is not None:
                pp_ttft_s.append((rnd, prefill(pp, pp_prompt)))

        for rnd in range(reps):
            say(f"round {rnd + 1} of {reps}: every probe", rnd, reps)
            if probe is not None:
                m.speed.append(probe.read(1.0))
            if NOISY_SAMPLES_PER_ROUND >= 3:
                noisy_sample(rnd)
            for L in prompt_lengths:
                t, spans = with_prompt_steps(lambda: prefill(engine, L))
                ttft_s[L].append((rnd, t))
                if len(spans) == 1:  # the probe's one prompt step
                    m.engine_outside.append(t - spans[0])
            for b in batch_sizes:
                tpot_s[b].append((rnd, decode(engine, b)))
            if long_decode:
                long_s.append((rnd, decode(engine, long_b, LONG_DECODE_PROMPT)))
            noisy_sample(rnd)
            if pp is not None:
                pp_tpot_s.append((rnd, decode(pp, 1)))
                pp_round_s.append((rnd, decode(pp, 2)))
            if pd is not None:
                h = pd.submit(rng.integers(32, 127, pp_prompt).tolist(), SamplingParams(max_tokens=2, ignore_eos=True))
                h.result(timeout=120)
                if h.handoff_s is not None:
                    handoff_s.append((rnd, h.handoff_s))
            m.load_avg.append(os.getloadavg()[0])
            if server is not None:
                # This process is the front end (HTTP server, coordinator, the client): its CPU time
                # over a replay, less what its idle threads (other probes' coordinators, heartbeats)
                # burn meanwhile, is what the served requests cost it.
                idle = idle_cpu_rate()
                with cpu_meter(idle) as used:
                    replay(server.url, Path(model_dir).resolve().name, [], ignore_eos=True)
                setup = used()
                # one client, requests spaced out (each alone on the server), as a replayed trace sends them
                gap = 1.5 * max(ttft_s[L][-1][1] for L in prompt_lengths) + 0.05
                reqs = [LoadRequest(i * gap, rng.integers(32, 127, L).tolist(), 1) for i, L in enumerate(prompt_lengths)]
                with cpu_meter(idle) as used:
                    res, spans = with_prompt_steps(
                        lambda: replay(server.url, Path(model_dir).resolve().name, reqs, ignore_eos=True))
                # one step per prompt (each alone), one token each
                m.frontend_cpu.append((len(reqs), len(reqs), len(reqs), max(0.0, used() - setup)))
                for L, r in zip(prompt_lengths, res):
                    http_s[L].append((rnd, r.ttft_s))
                if len(spans) == len(res):  # each request alone: its prompt step is the one in its turn
                    m.http_outside.extend(r.ttft_s - span for r, span in zip(res, spans))
                # the decode probes again, every token streamed to the client (as the engine probes: all at once)
                for b in batch_sizes:
                    reqs = [LoadRequest(0.0, rng.integers(32, 127, 16).tolist(), decode_tokens) for _ in range(b)]
                    with cpu_meter(idle) as used:
                        res = replay(server.url, Path(model_dir).resolve().name, reqs, ignore_eos=True)
                    # all b in each step: the prompts' step, then decode_tokens - 1 decode steps
                    m.frontend_cpu.append((b, decode_tokens, b * decode_tokens, max(0.0, used() - setup)))
                    http_tpot_s[b].append((rnd, statistics.median(r.tpot_s for r in res)))
            if NOISY_SAMPLES_PER_ROUND >= 2:
                noisy_sample(rnd)
        for extra in (pp, tp2, pd):
            if extra is not None:
                extra.shutdown()
        pp = tp2 = pd = None
        # The GIL probe: the engine's coordinator shares this process (and its GIL) with the HTTP
        # server and the client; other work holding the GIL delays each next step of a replica. A
        # decode batch alone and beside a thread holding the GIL a known share of the time at random
        # phase (bursts of the interpreter's switch interval, the longest one thread holds it while
        # another waits), interleaved; the step's delay per unit of that share (median over the rounds) is the simulator's
        # ``frontend_dispatch_s`` (sim.hosts).
        import sys
        import threading

        say("the GIL probe", reps, reps)
        b_gil, duty = min(4, max(batch_sizes)), 0.5  # half the time: a delay well above the load's noise
        for _ in range(reps):
            alone = decode(engine, b_gil)
            stop_gil, used = threading.Event(), []
            th = threading.Thread(target=gil_load, args=(stop_gil, duty, sys.getswitchinterval(), used), daemon=True)
            th.start()
            try:
                busy_t = decode(engine, b_gil)
            finally:
                stop_gil.set()
                th.join()
            if used and used[0] > 0:
                m.dispatch.append((busy_t - alone) / used[0])
        # Contention: the largest decode probe alone and beside one more process computing as a second
        # worker slot of the same host would, interleaved. The slow-down is the ratio of the worker's
        # own CPU time per probe (what the neighbour costs it beyond the cores' share, which the
        # simulator's k / c already counts: cache, memory bandwidth); the ratio of wall times, where
        # /proc has no CPU time, would also hold the load of other processes on a shared machine.
        import multiprocessing

        say("the contention probe", reps, reps)
        ctx = multiprocessing.get_context("spawn")
        stop, go = ctx.Event(), ctx.Event()
        burner = ctx.Process(target=burn, args=(stop, go, spec.weight_bytes), daemon=True)
        burner.start()
        pids = list(engine.worker_pids().values())
        try:
            b = max(batch_sizes)
            alone, busy = [], []
            for _ in range(reps):
                for on, out in ((False, alone), (True, busy)):
                    go.set() if on else go.clear()
                    if on:
                        time.sleep(0.05)  # the burner is computing before the probe starts
                    c0 = [cpu_ns(p) for p in pids]
                    t = decode(engine, b)
                    c1 = [cpu_ns(p) for p in pids]
                    cpu = None if None in c0 + c1 else sum(c1) - sum(c0)
                    out.append(cpu if cpu else t)
            m.contention = max(1.0, statistics.median(busy) / statistics.median(alone))
        finally:
            stop.set()
            burner.join(timeout=5)
            if burner.is_alive():
                burner.kill()
        # each round's times at the machine speed of the calibration's median reading (its speed
        # probe read just before the round): the speed drifts within a calibration too. Not where the
        # engine ran on a GPU: the probe times this process's CPU, which does not pace a GPU's steps
        # (``calibration_file.speed_reference`` leaves such calibrations uncorrected for the same reason).
        import torch

        readings = [] if torch.cuda.is_available() else m.speed
        med = lambda samples: round_median(samples, readings)  # noqa: E731
        m.ttft = {L: med(v) for L, v in ttft_s.items()}
        m.tpot = {b: med(v) for b, v in tpot_s.items()}
        if long_s:
            m.tpot_long = {long_b: med(long_s)}
        m.http_ttft = {L: med(v) for L, v in http_s.items() if v}
        # the HTTP TPOT as the engine's plus the round-paired difference: the stream fit
        # (``calibrate.stream_overheads``) takes HTTP − engine per batch size, and a difference of
        # two medians from different rounds keeps the machine's drift between rounds in it
        m.tpot_rounds, m.http_tpot_rounds = tpot_s, {b: v for b, v in http_tpot_s.items() if v}
        m.http_tpot = {b: m.tpot[b] + paired_round_median(v, tpot_s[b], readings)
                       for b, v in m.http_tpot_rounds.items()}
        if pp_ttft_s:
            m.pp_ttft = {pp_prompt: med(pp_ttft_s)}
            one = med(pp_tpot_s)
            m.pp_tpot = {1: one, 2: one + paired_round_median(pp_round_s, pp_tpot_s, readings)}
        if tp_ttft_s:
            m.tp_ttft = {pp_prompt: med(tp_ttft_s)}
            m.tp_tpot = {1: med(tp_tpot_s)}
        m.noisy_rounds = {k: v for k, v in (("tp_ttft", tp_ttft_s), ("tp_tpot", tp_tpot_s), ("pp_ttft", pp_ttft_s)) if v}
        if handoff_s:
            m.kv_handoff = {pp_prompt: med(handoff_s)}
    finally:
        for extra in (pp, tp2, pd):
            if extra is not None:
                extra.shutdown()
        if server is not None:
            server.close()
        else:
            engine.shutdown()
    return m
