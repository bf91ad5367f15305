"""A two-stage pipeline's round with two micro-batches in flight: measured, and as the cost model prices it.

    .venv/bin/python -m bench.bench_pipeline_round [--rounds 6] [--tokens 32] [--gpu RTX-4090]

``hetserve calibrate`` fits the cost model to this machine (its two-stage probe now decodes one
and two sequences, and ``Efficiency.turn_hold``, the share of the turn-around that holds the last
stage while another micro-batch is in flight, is fitted from the two). Then one server of
``predict/run``'s tiny Llama on two stages (one worker each) decodes 1, 2 and 4 sequences at once
(one micro-batch, two of one, two of two), on the engine and through HTTP with the ``openai``
client, in interleaved rounds; the medians are set beside the cost model's round at that batch:

- *calibrated*: the fitted share, and the front end's wait per step (``stream_step_overhead_s``)
  once per micro-batch on the slowest stage, as ``CostModel.decode_step_time`` prices CPU worker
  slots sharing the host's cores;
- *hold 1* (the baseline: the model before, which calibration did not measure): all of the
  turn-around on the last stage, the same wait.

The engine rows price ``Efficiency`` alone; the HTTP rows the served efficiency (the stream's
per-sequence cost) and the stream's fixed part per step as the wait. Each row is also divided by
its path's one-sequence row, measured and priced: the machine's speed drifts by tens of percent
between the calibration and these rounds and moves every row alike, while the hold sets how much
a second micro-batch adds. The last line: the error of that ratio (mean |log| over the rows of two
micro-batches), the baseline's over the calibrated one's.

Then the hand-offs themselves (``--handoff-only``: only these): between two worker processes, a
stage's activations (the decode batches above and a prompt step) and a KV piece of one worker of
a P/D plan (this model's layers of one stage, a prompt and a 512-token context), each by the
authenticated socket (what the engine's workers use) and by the device channel over gloo
(``runtime/workers/device_channel.py``), interleaved in one run (``bench/gpu/dataflow.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.lib.workdir import workdir

BATCHES = (1, 2, 4)
PROMPT = 16


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=6, help="interleaved rounds of every probe (default 6)")
    ap.add_argument("--tokens", type=int, default=32, help="tokens each sequence decodes (default 32)")
    ap.add_argument("--gpu", default="RTX-4090", help="the GPU row the worker slots are named after")
    ap.add_argument("--handoff-only", action="store_true", help="only the socket / device channel hand-offs")
    args = ap.parse_args()
    if args.rounds < 1 or args.tokens < 4:
        ap.error("--rounds must be at least 1 and --tokens at least 4")
    if not args.handoff_only:
        round_vs_cost_model(args)
    handoffs(args)
    return 0


def handoffs(args) -> None:
    """Stage and KV hand-off time of this bench's model, socket against the device channel (gloo)."""
    import json

    from bench.gpu.dataflow import Case, measure, table
    from bench.lib.console import wide_console
    from bench.predict.run import tiny_model

    cfg = json.loads((Path(tiny_model(workdir("bench-pipeline-handoff-"))) / "config.json").read_text())
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv_heads, layers = cfg.get("num_key_value_heads", heads), cfg["num_hidden_layers"] // 2  # one of two stages
    rows = [Case("stage", r, (r, hidden), "float32") for r in (*BATCHES, 4 * PROMPT)]
    rows += [Case("kv", t, (layers, 2, t, kv_heads, hidden // heads), "float32") for t in (PROMPT, 512)]
    results = measure(rows, "cpu", reps=max(5, args.rounds))
    wide_console().print(table(results, f"hand-offs between two worker processes on CPU, this bench's model "
                                        f"(hidden {hidden}; KV of {layers} layers x {kv_heads} KV heads), median "
                                        f"of {max(5, args.rounds)}; socket: the engine's path today"))


def round_vs_cost_model(args) -> None:

    import numpy as np
    from bench.lib.console import wide_console
    from rich.table import Table

    from bench.predict.run import tiny_model
    from hetserve.cost.analytic import CostModel
    from hetserve.calibration.calibrate import calibrate
    from hetserve.calibration.file import served_efficiency
    from hetserve.calibration.probe_shapes import one_device_cluster, one_device_plan, probe_layout
    from hetserve.runtime.params import SamplingParams
    from hetserve.serve.launch import ServeOptions, start_server
    from hetserve.serve.loadgen import LoadRequest, replay
    from hetserve.specs.cluster import cluster_from_dict
    from hetserve.specs.model import load_model

    console = wide_console()
    work = workdir("bench-pipeline-round-")
    model_dir = tiny_model(work)
    spec = load_model(model_dir)
    console.print("calibrating (hetserve calibrate's probes) ...")
    cal = calibrate(str(model_dir), args.gpu)
    cal.save(work / "cal.json")
    hold = cal.efficiency.turn_hold
    console.print(f"fitted turn_hold {hold:.2f}" if hold is not None else "turn_hold not fitted (no two-stage probe)")

    cluster = one_device_cluster(args.gpu, 2)
    server = start_server(ServeOptions(plan=one_device_plan(spec, cluster, 2), cluster=cluster, model_dir=str(model_dir),
                                       max_num_seqs=max(BATCHES), kv_capacity_tokens=16384))
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    engine = server.deployment.engine
    name = Path(model_dir).resolve().name
    try:
        engine.generate([[65] * 8], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        replay(server.url, name, [LoadRequest(0.0, [65] * 8, 2)], ignore_eos=True)
        measured: dict[tuple[str, int], list[float]] = {}
        for _ in range(args.rounds):
            for b in BATCHES:
                handles = [engine.submit(rng.integers(32, 127, PROMPT).tolist(), params) for _ in range(b)]
                for h in handles:
                    h.result(timeout=120)
                measured.setdefault(("engine", b), []).append(statistics.median(h.tpot for h in handles))
                res = replay(server.url, name, [LoadRequest(0.0, rng.integers(32, 127, PROMPT).tolist(), args.tokens)
                                                for _ in range(b)], ignore_eos=True)
                measured.setdefault(("http", b), []).append(statistics.median(r.tpot_s for r in res))
    finally:
        server.close()

    # the same two slots, as a cluster file says them: sharing this machine's cores
    shared = cluster_from_dict({"name": "round", "machines": [{"name": "cal", "gpu": args.gpu, "count": 2,
                                                                "cpu_cores": os.cpu_count() or 1}]})
    layout = probe_layout(spec, 2)
    wait = cal.stream_step_overhead_s
    served = served_efficiency(work / "cal.json")
    models = {"calibrated": (cal.efficiency, served),
              "hold 1": (dataclasses.replace(cal.efficiency, turn_hold=1.0), dataclasses.replace(served, turn_hold=1.0))}

    def priced(kind: str, b: int, which: str) -> float:
        eff = models[which][0 if kind == "engine" else 1]
        return CostModel(shared, spec, eff).decode_step_time(layout, b, b * (PROMPT + args.tokens / 2),
                                                             dispatch_s=wait if kind == "http" else 0.0)

    pp = {p.size: p for p in cal.points if p.stages == 2 and p.phase == "decode"}
    if 1 in pp and 2 in pp:
        console.print(f"the calibration's two-stage decode: one sequence {pp[1].measured_s * 1e3:.2f} ms, two "
                      f"{pp[2].measured_s * 1e3:.2f} ms ({pp[2].measured_s / pp[1].measured_s:.2f}x, measured), "
                      f"priced {pp[1].predicted_s * 1e3:.2f} / {pp[2].predicted_s * 1e3:.2f} ms")
    # Each row also against its path's one-micro-batch row: the machine's speed drifts by tens of
    # percent within minutes on a shared machine, which moves every row alike; the share of the
    # turn-around that holds the last stage sets the rows' shape.
    t = Table("batch", "micro-batches", "path", "measured (ms)", "calibrated (ms)", "hold 1 (ms)",
              "measured / batch 1", "calibrated / batch 1", "hold 1 / batch 1",
              title=f"two-stage pipeline, {args.tokens} tokens per sequence, median of {args.rounds} rounds "
                    f"(measured on this machine; priced by the calibration above: turn_hold "
                    f"{'-' if hold is None else f'{hold:.2f}'}, stream wait {wait * 1e3:.2f} ms per step)")
    errs: dict[str, list[float]] = {k: [] for k in models}
    for kind in ("engine", "http"):
        m1 = statistics.median(measured[kind, 1])
        p1 = {k: priced(kind, 1, k) for k in models}
        for b in BATCHES:
            m = statistics.median(measured[kind, b])
            p = {k: priced(kind, b, k) for k in models}
            if b > 1:
                for k in models:
                    errs[k].append(abs(math.log((p[k] / p1[k]) / (m / m1))))
            t.add_row(str(b), str(min(2, b)), kind, f"{m * 1e3:.2f}", f"{p['calibrated'] * 1e3:.2f}",
                      f"{p['hold 1'] * 1e3:.2f}", f"{m / m1:.2f}", f"{p['calibrated'] / p1['calibrated']:.2f}",
                      f"{p['hold 1'] / p1['hold 1']:.2f}")
    console.print(t)
    mean = {k: statistics.mean(v) for k, v in errs.items()}
    console.print(f"two micro-batches against one, mean |log(priced ratio / measured ratio)|: calibrated "
                  f"{mean['calibrated']:.3f}, hold 1 {mean['hold 1']:.3f}; ratio hold 1 / calibrated "
                  f"{mean['hold 1'] / max(mean['calibrated'], 1e-9):.2f}")


if __name__ == "__main__":
    sys.exit(main())
