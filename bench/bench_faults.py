"""Serving through worker faults: kill -9 and SIGSTOP of a worker while streams run.

    .venv/bin/python -m bench.bench_faults [--streams 12] [--max-tokens 48] [--heartbeat-timeout 3]
                                           [--replan-time-limit 5]

One server (``hetserve serve``'s code path, in-process: ``start_server``) runs four colocated
replicas of a random-weight Llama (4 layers, hidden 64) on ``demo-cpu``, one CPU worker each.
Scenario 1: ``--streams`` streaming completions start; once every stream has its first token, one
worker holding streams gets SIGKILL; every stream must end with its full ``max_tokens`` and no
error event, and ``--after`` later requests must all succeed. Scenario 2: the same with SIGSTOP:
the time from the signal to the engine declaring the worker dead (heartbeat timeout) is measured
from the engine's own death record, and the streams must complete on the other replicas.

Prints one table: completed / total streams, later requests OK, detection time (measured,
wall clock on this machine; the load average is printed beside it since the machine is shared).

Scenario 3, elastic re-plan (HexGen's "GPUs leave and join"): a second server runs two colocated
replicas, each a two-stage pipeline over one machine (``--replan-on-failure``). SIGKILL of one
stage's worker while the streams run: its device is lost, the planner re-plans the freed device
(warm-started: the other replica is kept), and the new replica starts while the kept one serves.
Measured from the signal: detection, planning, start-up of the new workers, and the whole "failure
-> new plan serving"; then the lost device comes back (``POST /admin/replan`` with ``returned``)
and joins the same way. Every stream must complete; the later requests go to the new replica set.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import tempfile
import threading
import time
from dataclasses import replace
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


def start_streams(server, streams: int, max_tokens: int) -> tuple[list[dict], list[threading.Thread]]:
    """Start ``streams`` streaming completions; return once each has its first token."""
    outs = [dict() for _ in range(streams)]
    firsts = [threading.Event() for _ in range(streams)]
    threads = [threading.Thread(target=stream, args=(server.url, max_tokens, o, f)) for o, f in zip(outs, firsts)]
    for t in threads:
        t.start()
    for f in firsts:
        f.wait(60)
    return outs, threads


def later_requests_ok(server, after: int) -> int:
    """How many of ``after`` fresh 8-token completions, sent after a fault, succeed in full."""
    import httpx

    ok = 0
    for _ in range(after):
        r = httpx.post(server.url + "/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": "hello", "max_tokens": 8, "ignore_eos": True})
        ok += r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    return ok


def scenario(server, sig: int, streams: int, max_tokens: int, after: int) -> dict:
    engine = server.deployment.engine
    outs, threads = start_streams(server, streams, max_tokens)
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
    later = later_requests_ok(server, after)
    return {"signal": signal.Signals(sig).name, "victim": f"{victim} ({victim_replica}, {running[victim_replica]} "
            "streams)", "completed": sum(o.get("ok", False) for o in outs), "streams": streams,
            "errors": sum(len(o.get("errors", [])) for o in outs), "later_ok": later, "later": after,
            "detected_s": death[0]["at"] - t_signal if death else None}


# /admin/replan exists only behind an admin key: a fresh one per run, known to this script alone
ADMIN_KEY = secrets.token_urlsafe(32)
REPLAN_PLAN = {"model": "tiny", "cluster": "demo-cpu", "algorithm": "manual", "replicas": [
    {"id": f"c{i}", "role": "colocated", "stages": [{"devices": [f"m{i}:0"], "layers": [0, 2]},
                                                     {"devices": [f"m{i}:1"], "layers": [2, 4]}]}
    for i in range(2)]}


def replan_scenario(server, streams: int, max_tokens: int, after: int) -> dict:
    """SIGKILL one stage with --replan-on-failure; then the device returns. Seconds from the signal."""
    import httpx

    engine = server.deployment.engine
    replanner = server.deployment.coordinator.replanner
    outs, threads = start_streams(server, streams, max_tokens)
    victim = "m0:0"
    t_signal = time.monotonic()
    os.kill(engine.worker_pids()[victim], signal.SIGKILL)
    deadline = time.monotonic() + 120
    while not replanner.history and time.monotonic() < deadline:
        time.sleep(0.02)
    t_serving = time.monotonic()
    rec = replanner.history[0] if replanner.history else {}
    for t in threads:
        t.join(180)
    death = engine.stats()["deaths"][0]
    later = later_requests_ok(server, after)
    served = {rid: s["steps"] for rid, s in engine.stats()["replicas"].items()}
    t_back = time.monotonic()
    back = httpx.post(server.url + "/admin/replan", json={"returned": [victim]}, timeout=300,
                      headers={"Authorization": f"Bearer {ADMIN_KEY}"}).json()
    join_s = time.monotonic() - t_back
    return {"completed": sum(o.get("ok", False) for o in outs), "streams": streams,
            "errors": sum(len(o.get("errors", [])) for o in outs), "later_ok": later, "later": after,
            "detected_s": death["at"] - t_signal, "plan_s": rec.get("plan_s"), "start_s": rec.get("start_s"),
            "failure_to_serving_s": t_serving - t_signal if rec else None, "kept": rec.get("kept"),
            "retired": rec.get("retired"), "added": rec.get("added"), "steps_by_replica": served,
            "join": {"added": back.get("added"), "plan_s": back.get("plan_s"), "start_s": back.get("start_s"),
                     "total_s": join_s}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--after", type=int, default=20, help="requests sent after each fault")
    ap.add_argument("--heartbeat-timeout", type=float, default=3.0)
    ap.add_argument("--replan-time-limit", type=float, default=5.0, help="the re-plan's planner time limit (s)")
    ap.add_argument("--json", help="save the rows")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["NO_PROXY"] = "127.0.0.1,localhost"
    from hetserve.planner.plan import Plan
    from hetserve.runtime.model.make import make_model
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
        ropts = replace(opts, plan=Plan.from_dict(REPLAN_PLAN), replan_on_failure=True,
                        replan_time_limit_s=args.replan_time_limit, admin_keys=(ADMIN_KEY,))
        with start_server(ropts) as server:
            replan_row = replan_scenario(server, args.streams, args.max_tokens, args.after)
    load = os.getloadavg()
    print(f"\nfaults while {args.streams} streams run (4 colocated replicas on demo-cpu, heartbeat timeout "
          f"{args.heartbeat_timeout:g} s); load average {load[0]:.1f} / {load[1]:.1f}\n")
    print("| fault | victim | streams completed | error events | later requests OK | detected after (s) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        det = f"{r['detected_s']:.2f}" if r["detected_s"] is not None else "—"
        print(f"| {r['signal']} | {r['victim']} | {r['completed']}/{r['streams']} | {r['errors']} | "
              f"{r['later_ok']}/{r['later']} | {det} |")
    r = replan_row
    print(f"\nelastic re-plan (--replan-on-failure, planner time limit {args.replan_time_limit:g} s): SIGKILL of "
          f"m0:0, a stage of replica c0 (2 replicas x 2 stages on demo-cpu), while {args.streams} streams run\n")
    print("| streams completed | error events | later requests OK | detected (s) | planning (s) | start-up (s) "
          "| failure -> new plan serving (s) | kept / retired / added |")
    print("|---|---|---|---|---|---|---|---|")
    fmt = lambda x: f"{x:.2f}" if isinstance(x, (int, float)) else "—"  # noqa: E731
    print(f"| {r['completed']}/{r['streams']} | {r['errors']} | {r['later_ok']}/{r['later']} | {fmt(r['detected_s'])} "
          f"| {fmt(r['plan_s'])} | {fmt(r['start_s'])} | {fmt(r['failure_to_serving_s'])} "
          f"| {r['kept']} / {r['retired']} / {r['added']} |")
    j = r["join"]
    print(f"\nm0:0 comes back (POST /admin/replan {{\"returned\": [\"m0:0\"]}}): added {j['added']}, planning "
          f"{fmt(j['plan_s'])} s, start-up {fmt(j['start_s'])} s, request -> serving {fmt(j['total_s'])} s")
    print(f"steps per replica after the re-plan (later requests): {r['steps_by_replica']}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows + [replan_row], indent=2))


if __name__ == "__main__":
    main()
