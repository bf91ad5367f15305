"""What ``hetserve route`` adds to time-to-first-token: the same backends called directly and through it.

    .venv/bin/python -m bench.bench_route                 # 300 streamed requests each way
    .venv/bin/python -m bench.bench_route --requests 100 --json out.json

Two stand-in OpenAI backends (tests/export/route_standin.py: answer at once, no model) as processes
on 127.0.0.1, and ``hetserve route --backends`` in its own process in front of them. Requests go
one at a time, alternating direct / routed, so both sides see the same machine state; TTFT is the
time from sending the request to the first SSE byte (httpx, one kept-alive connection per side).
Target: the route adds at most 2 ms median.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STANDIN = ROOT / "tests" / "export" / "route_standin.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_up(url: str, deadline_s: float = 60.0) -> None:
    import httpx

    t = time.monotonic() + deadline_s
    while time.monotonic() < t:
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(url)


def ttft(client, url: str, body: dict) -> float:
    t0 = time.perf_counter()
    dt = None
    with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        for _ in r.iter_raw():
            if dt is None:
                dt = time.perf_counter() - t0
    return dt


def main(argv=None) -> int:
    import httpx

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=300, help="requests each way (default 300)")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    procs = []
    try:
        urls = []
        for i in range(2):
            port = free_port()
            procs.append(subprocess.Popen([sys.executable, str(STANDIN), "--port", str(port), "--id", f"b{i}"],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            urls.append(f"http://127.0.0.1:{port}")
        rport = free_port()
        route = f"http://127.0.0.1:{rport}"
        procs.append(subprocess.Popen([sys.executable, "-m", "hetserve.cli.main", "route", "--backends", ",".join(urls),
                                       "--port", str(rport), "--policy", "rr"],
                                      env={**os.environ, "HF_HUB_OFFLINE": "1"},
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for u in urls + [route]:
            wait_up(u)
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 4, "stream": True}
        direct, routed = [], []
        with httpx.Client(timeout=30) as cd, httpx.Client(timeout=30) as cr:
            for _ in range(20):  # warm-up: connections, first-call imports
                ttft(cd, urls[0], body)
                ttft(cr, route, body)
            for i in range(args.requests):
                direct.append(ttft(cd, urls[i % 2], body))
                routed.append(ttft(cr, route, body))
        q = lambda xs, p: statistics.quantiles(xs, n=100)[p - 1] * 1e3  # noqa: E731
        row = {"requests": args.requests,
               "direct_ms": {"p50": statistics.median(direct) * 1e3, "p90": q(direct, 90)},
               "route_ms": {"p50": statistics.median(routed) * 1e3, "p90": q(routed, 90)}}
        row["added_p50_ms"] = row["route_ms"]["p50"] - row["direct_ms"]["p50"]
        print(f"TTFT over {args.requests} streamed requests each way (stand-in backends, 127.0.0.1):")
        print(f"  direct  p50 {row['direct_ms']['p50']:.2f} ms  p90 {row['direct_ms']['p90']:.2f} ms")
        print(f"  route   p50 {row['route_ms']['p50']:.2f} ms  p90 {row['route_ms']['p90']:.2f} ms")
        print(f"  added by route: {row['added_p50_ms']:.2f} ms median (target ≤ 2 ms: "
              f"{'met' if row['added_p50_ms'] <= 2.0 else 'NOT met'})")
        if args.json:
            Path(args.json).write_text(json.dumps(row, indent=1) + "\n")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
