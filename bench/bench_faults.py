"""Serving through worker faults: kill -9 and SIGSTOP of a worker while streams run.

    .venv/bin/python bench/bench_faults.py [--streams 12] [--max-tokens 48] [--heartbeat-timeout 3]

One server (``hetserve serve``'s code path, in-process: ``start_server``) runs four colocated
replicas of a random-weight Llama (4 layers, hidden 64) on ``demo-cpu``, one CPU worker each.
Scenario 1: ``--streams`` streaming completions start; once every stream has its first token, one
worker holding streams gets SIGKILL; every stream must end with its full ``max_tokens`` and no
error event, and ``--after`` later requests must all succeed. Scenario 2: the same with SIGSTOP:
the time from the signal to the engine declaring the worker dead (heartbeat timeout) is measured
from the engine's own death record, and the streams must complete on the other replicas.

Prints one table: completed / total streams, later requests OK, detection time (measured,
wall clock on this machine; the load average is printed beside it since the machine is shared).
Failure -> re-planned deployment (issue 11, item 3) is not measured: re-planning is not built yet.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
import threading
import time
from pathlib import Path

PLAN = {"model": "tiny", "cluster": "demo-cpu", "algorithm": "manual", "replicas": [
    {"id": f"c{i}", "role": "colocated", "stages": [{"devices": [d], "layers": [0, 4]}]}
    for i, d in enumerate(["m0:0", "m0:1", "m1:0", "m1:1"])]}


def stream(url: str, max_tokens: int, out: dict, first: threading.Event) -> None:
    import httpx

    events, tokens = [], 0
    try:
        with httpx.stream("POST", url + "/v1/completions", timeout=120,
                          json={"model": "tiny", "prompt": "the quick brown fox", "max_tokens": max_tokens,
                                "stream": True, "ignore_eos": True, "temperature": 0,
                                "stream_options": {"include_usage": True}}) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                first.set()
    except Exception as exc:  # noqa: BLE001 - a transport failure is a lost stream, counted below
        events.append(json.dumps({"error": {"message": repr(exc)}}))
    errors = [e for e in events if e.startswith('{"error"')]
    usage = [json.loads(e)["usage"] for e in events if e.startswith("{") and '"usage":{' in e]
    tokens = usage[-1]["completion_tokens"] if usage else 0
    out.update(ok=not errors and events[-1:] == ["[DONE]"] and tokens == max_tokens, errors=errors, tokens=tokens)


def scenario(server, sig: int, streams: int, max_tokens: int, after: int) -> dict:
    import httpx

    engine = server.deployment.engine
    outs = [dict() for _ in range(streams)]
    firsts = [threading.Event() for _ in range(streams)]
    threads = [threading.Thread(target=stream, args=(server.url, max_tokens, o, f)) for o, f in zip(outs, firsts)]
    for t in threads:
        t.start()
    for f in firsts:
        f.wait(60)
    running = {rid: s["running"] for rid, s in engine.stats()["replicas"].items() if s["alive"]}
    victim_replica = max(running, key=running.get)
    victim = next(w.name for w in engine.replicas[victim_replica].workers)
    deaths_before = len(engine.stats()["deaths"])
    t_signal = time.monotonic()
    os.kill(engine.worker_pids()[victim], sig)
    for t in threads:
        t.join(180)
    deadline = time.monotonic() + 30
    while len(engine.stats()["deaths"]) == deaths_before and time.monotonic() < deadline:
        time.sleep(0.05)
    death = engine.stats()["deaths"][deaths_before:][:1]
    later = 0
    for _ in range(after):
        r = httpx.post(server.url + "/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": "hello", "max_tokens": 8, "ignore_eos": True})
        later += r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    return {"signal": signal.Signals(sig).name, "victim": f"{victim} ({victim_replica}, {running[victim_replica]} "
            "streams)", "completed": sum(o.get("ok", False) for o in outs), "streams": streams,
            "errors": sum(len(o.get("errors", [])) for o in outs), "later_ok": later, "later": after,
            "detected_s": death[0]["at"] - t_signal if death else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--after", type=int, default=20, help="requests sent after each fault")
    ap.add_argument("--heartbeat-timeout", type=float, default=3.0)
    ap.add_argument("--json", help="save the rows")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["NO_PROXY"] = "127.0.0.1,localhost"
    from hetserve.planner.plan import Plan
    from hetserve.runtime.make_model import make_model
    from hetserve.serve.launch import ServeOptions, start_server

    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp) / "tiny", "llama", layers=4, hidden=64, heads=4, kv_heads=2, seed=0)
        opts = ServeOptions(plan=Plan.from_dict(PLAN), cluster="demo-cpu", model_dir=str(model),
                            kv_capacity_tokens=4096,
                            engine_options={"heartbeat_timeout_s": args.heartbeat_timeout,
                                            "heartbeat_interval_s": min(0.5, args.heartbeat_timeout / 4)})
        rows = []
        with start_server(opts) as server:
            for sig in (signal.SIGKILL, signal.SIGSTOP):
                rows.append(scenario(server, sig, args.streams, args.max_tokens, args.after))
    load = os.getloadavg()
    print(f"\nfaults while {args.streams} streams run (4 colocated replicas on demo-cpu, heartbeat timeout "
          f"{args.heartbeat_timeout:g} s); load average {load[0]:.1f} / {load[1]:.1f}\n")
    print("| fault | victim | streams completed | error events | later requests OK | detected after (s) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        det = f"{r['detected_s']:.2f}" if r["detected_s"] is not None else "—"
        print(f"| {r['signal']} | {r['victim']} | {r['completed']}/{r['streams']} | {r['errors']} | "
              f"{r['later_ok']}/{r['later']} | {det} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
