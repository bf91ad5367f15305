"""What the HTTP front end costs a served plan on this machine, beside the engine alone.

    .venv/bin/python -m bench.bench_frontend [--rates 5.16,20.65] [--requests 48]

Two tables, each with its baseline measured in the same run:

1. **Core contention.** One worker-like process (one torch thread, the tiny Llama of
   ``predict/run``) times a batch-4 decode step alone, beside one process prefilling 128 tokens in
   a loop, and beside two. Ratio: each step time ÷ the step alone.
2. **Engine vs served.** ``predict/run``'s ``prefill-decode`` plan and requests (Azure LPLD, prompts
   <= 128, outputs <= 32 tokens, ``ignore_eos``), sent at the same arrival times once straight to
   ``Engine.submit`` (no HTTP) and once through the HTTP server and the ``openai`` client (what
   ``predict/run`` serves). Reported: TTFT and TPOT means, KV hand-off time (engine side), and
   served ÷ engine, plus the extra time per decode step the front end adds.
3. **Where a served step's extra time goes.** The decode replica's steps timed in the coordinator
   on both sides of table 2: its own turn-around (result handled -> next step sent) and the round
   trip (sent -> result handled: the sender thread, the worker, the reader thread and the
   coordinator's wake-up, each needing the front end's GIL).

The machine is shared: the 1-minute load average is printed beside every table.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.lib.workdir import workdir


def _tiny_llama():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(1)  # as runtime/workers/worker.py: one core's worth of work per worker
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=256, intermediate_size=768, num_hidden_layers=8,
                      num_attention_heads=4, num_key_value_heads=2)
    return torch, LlamaForCausalLM(cfg).eval()


def _prefill_loop(stop) -> None:
    torch, model = _tiny_llama()
    x = torch.randint(0, 32000, (1, 128))
    with torch.no_grad():
        while not stop.is_set():
            model(x)


def _decode_step_ms(reps: int = 60) -> float:
    torch, model = _tiny_llama()
    x = torch.randint(0, 32000, (4, 1))
    with torch.no_grad():
        for _ in range(10):
            model(x)
        t = time.perf_counter()
        for _ in range(reps):
            model(x)
    return (time.perf_counter() - t) / reps * 1e3


def contention_rows() -> list[tuple[str, float]]:
    rows = [("alone", _decode_step_ms())]
    for n in (1, 2):
        stop = mp.Event()
        procs = [mp.Process(target=_prefill_loop, args=(stop,)) for _ in range(n)]
        for p in procs:
            p.start()
        time.sleep(3)  # the burners have built their models and run
        rows.append((f"beside {n} prefill process{'es' if n > 1 else ''}", _decode_step_ms()))
        stop.set()
        for p in procs:
            p.join()
    return rows


class StepTimer:
    """Times the decode replica's steps in the coordinator (a measurement hook for this bench only):
    per step, the coordinator's own turn-around (its result handled -> its next step sent) and the
    round trip (step sent -> its result handled: the sender thread, the worker, the reader thread
    and the coordinator's wake-up, each needing the front end's GIL)."""

    def __init__(self, replica: str = "d0"):
        self.replica, self.events = replica, []

    def __enter__(self):
        import hetserve.runtime.engine_loop as coord

        self._mod, self._orig = coord.EngineLoop, (coord.EngineLoop._on_result, coord.EngineLoop._send_step)
        on_result, send_step = self._orig
        events, rid = self.events, self.replica

        def timed_result(c, step_id, *rest):  # whatever else the coordinator passes on (tokens, meta)
            entry = c.steps.get(step_id)
            if entry is not None and entry[0] == rid:
                events.append(("result", time.monotonic()))
            return on_result(c, step_id, *rest)

        def timed_send(c, sched, *rest):
            if sched.id == rid:
                events.append(("send", time.monotonic()))
            return send_step(c, sched, *rest)

        self._mod._on_result, self._mod._send_step = timed_result, timed_send
        return self

    def __exit__(self, *exc):
        self._mod._on_result, self._mod._send_step = self._orig

    def summary(self) -> dict[str, float]:
        import numpy as np

        turn, trip, last_send, last_result = [], [], None, None
        for kind, t in self.events:
            if kind == "send":
                if last_result is not None and last_send is not None and last_result > last_send:
                    turn.append(t - last_result)  # a step sent right after this replica's last result
                last_send = t
            else:
                if last_send is not None:
                    trip.append(t - last_send)
                last_result = t
        return {"turn_ms": float(np.median(turn)) * 1e3 if turn else float("nan"),
                "turn_mean_ms": float(np.mean(turn)) * 1e3 if turn else float("nan"),
                "trip_ms": float(np.mean(trip)) * 1e3 if trip else float("nan"), "steps": len(trip)}


def engine_vs_served(rate: float, n: int, tmp: Path, model_dir: Path) -> dict[str, dict[str, float]]:
    import numpy as np

    from bench.predict import run as bp
    from hetserve.runtime.engine import Engine
    from hetserve.runtime.engine_config import EngineConfig
    from hetserve.runtime.params import SamplingParams
    from hetserve.serve.launch import ServeOptions, start_server
    from hetserve.serve.loadgen import replay, requests_from_workload
    from hetserve.specs.cluster import load_cluster
    from hetserve.specs.workload import load_workload

    cluster_path = tmp / "cluster.yaml"
    plan = bp.plans()["prefill-decode"]
    trace = load_workload("azure-conv").of_class("LPLD").with_rate(rate)
    reqs = requests_from_workload(trace, n, max_input=128, max_output=32)
    with Engine.from_plan(plan, cluster_path, model_dir, EngineConfig(kv_capacity_tokens=16384)) as eng, \
            StepTimer() as eng_steps:
        handles, t0 = [], time.monotonic()
        for r in reqs:
            time.sleep(max(0.0, t0 + r.arrival_s - time.monotonic()))
            handles.append(eng.submit(r.prompt, SamplingParams(max_tokens=r.max_tokens, ignore_eos=True)))
        for h in handles:
            h.result(timeout=120)
    engine = {"ttft_ms": np.mean([h.ttft for h in handles]) * 1e3,
              "tpot_ms": np.mean([h.tpot for h in handles if h.tpot]) * 1e3,
              "handoff_ms": np.mean([h.handoff_s for h in handles if h.handoff_s is not None]) * 1e3,
              **eng_steps.summary()}
    opts = ServeOptions(plan=plan, cluster=load_cluster(str(cluster_path)), model_dir=str(model_dir))
    with start_server(opts) as server, StepTimer() as served_steps:
        results = replay(server.url, server.deployment.coordinator.model_name, reqs, ignore_eos=True)
    ok = [r for r in results if r.error is None]
    served = {"ttft_ms": np.mean([r.ttft_s for r in ok]) * 1e3,
              "tpot_ms": np.mean([r.tpot_s for r in ok if r.tpot_s is not None]) * 1e3,
              "handoff_ms": float("nan"), **served_steps.summary()}
    return {"engine": engine, "served": served}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="5.16,20.65", help="requests/s (default: bench_predict's prefill-decode "
                                                          "light and near-saturation rates of a quiet run)")
    ap.add_argument("--requests", type=int, default=48)
    args = ap.parse_args()
    mp.set_start_method("spawn", force=True)

    from bench.lib.console import wide_console
    from rich.table import Table

    from bench.predict import run as bp

    console = wide_console()
    t = Table(title=f"decode step (batch 4, one torch thread) beside other processes on {os.cpu_count()} cores, "
                    f"load {os.getloadavg()[0]:.2f}")
    for col in ("beside", "step ms", "÷ alone"):
        t.add_column(col)
    rows = contention_rows()
    for name, ms in rows:
        t.add_row(name, f"{ms:.2f}", f"{ms / rows[0][1]:.2f}")
    console.print(t)

    tmp = workdir("bench-frontend-")
    (tmp / "cluster.yaml").write_text(bp.CLUSTER)
    model_dir = bp.tiny_model(tmp)
    t = Table(title="prefill-decode plan: the engine alone vs served over HTTP (same requests, same arrivals)")
    for col in ("req/s", "load", "TTFT engine ms", "TTFT served ms", "served ÷ engine", "TPOT engine ms",
                "TPOT served ms", "served ÷ engine", "hand-off ms (engine)"):
        t.add_column(col)
    steps = Table(title="the decode replica's steps in the coordinator: its own turn-around (result handled -> next "
                        "step sent) and the round trip (sent -> result handled, through the front end's threads)")
    for col in ("req/s", "side", "steps", "turn-around p50 ms", "turn-around mean ms", "round trip mean ms"):
        steps.add_column(col)
    for rate in (float(r) for r in args.rates.split(",")):
        r = engine_vs_served(rate, args.requests, tmp, model_dir)
        e, s = r["engine"], r["served"]
        for side, x in (("engine", e), ("served", s)):
            steps.add_row(f"{rate:.2f}", side, str(x["steps"]), f"{x['turn_ms']:.2f}", f"{x['turn_mean_ms']:.2f}",
                          f"{x['trip_ms']:.2f}")
        t.add_row(f"{rate:.2f}", f"{os.getloadavg()[0]:.2f}", f"{e['ttft_ms']:.1f}", f"{s['ttft_ms']:.1f}",
                  f"{s['ttft_ms'] / e['ttft_ms']:.2f}", f"{e['tpot_ms']:.2f}", f"{s['tpot_ms']:.2f}",
                  f"{s['tpot_ms'] / e['tpot_ms']:.2f}", f"{e['handoff_ms']:.1f}")
    console.print(t)
    console.print(steps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
