"""The serve check's side of HTTP (``bench/gpu/serve_check.py``): ``hetserve serve`` as a subprocess
in its own session, and requests to it with the standard library only (the GPU machine has no
HTTP client the project depends on)."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"
# Seconds one blocking socket call of a request may wait (connect, a response, the next streamed
# chunk): well under serve.sh's limit, so a server that stops answering fails its stage and the
# later stages still run; a healthy request waits under a few seconds between chunks.
HTTP_TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def post(port: int, body: dict) -> dict:
    conn = http.client.HTTPConnection(HOST, port, timeout=HTTP_TIMEOUT_S)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {data[:300]!r}")
        return json.loads(data)
    finally:
        conn.close()


def stream(port: int, body: dict, t0: float, out: dict) -> None:
    """One streaming request: ``out`` gets first_s / end_s (since t0), completion tokens, or error."""
    conn = http.client.HTTPConnection(HOST, port, timeout=HTTP_TIMEOUT_S)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"error event: {chunk['error']}")
            out.setdefault("first_s", time.perf_counter() - t0)
            if chunk.get("usage"):
                out["tokens"] = chunk["usage"]["completion_tokens"]
        out["end_s"] = time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001 - reported by the caller, with the other requests' results
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        conn.close()


class Server:
    """``hetserve serve`` as a subprocess in its own session; its output echoed, timestamped, to ours."""

    def __init__(self, name: str, args: list[str], port: int):
        self.name, self.port, self.lines = name, port, []
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen([sys.executable, "-m", "hetserve.cli.main", "serve", *args, "--host", HOST,
                                      "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, bufsize=1, start_new_session=True, cwd=ROOT)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())
            print(f"[serve {self.name} {time.perf_counter() - self.t0:6.1f}s] {line.rstrip()}", flush=True)

    def health(self) -> str | None:
        conn = http.client.HTTPConnection(HOST, self.port, timeout=2)
        try:
            conn.request("GET", "/health")
            return json.loads(conn.getresponse().read()).get("status")
        except (OSError, ValueError):
            return None
        finally:
            conn.close()

    def wait_ok(self, limit_s: float) -> float:
        """Seconds from launch until /health answers ok; an exit or the limit first is an error."""
        while time.perf_counter() - self.t0 < limit_s:
            if self.proc.poll() is not None:
                self.reader.join(2)
                raise RuntimeError(f"serve exited with {self.proc.returncode} before /health was ok: "
                                   + " | ".join(self.lines[-5:]))
            if self.health() == "ok":
                return time.perf_counter() - self.t0
            time.sleep(0.1)
        raise TimeoutError(f"/health not ok within {limit_s} s")

    def printed_startup(self) -> dict:
        """What serve printed of its start-up: 'up in S s' and each worker's 'stage in S s' (empty if not)."""
        text = "\n".join(self.lines)
        up = re.search(r"up in ([\d.]+) s", text)
        stages = {d: float(s) for d, s in re.findall(r"(\S+) pid \d+, stage in ([\d.]+) s", text)}
        return {"up_s": float(up.group(1)) if up else None, "worker_stage_s": stages}

    def stop(self, quick: bool = False) -> dict:
        """SIGTERM to the server (it drains and stops its workers), then SIGKILL to its session if
        needed; ``quick``: a short wait (the check is out of time)."""
        t = time.perf_counter()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(4 if quick else 30)
            except subprocess.TimeoutExpired:
                pass
        left = group_alive(self.proc.pid)  # the server's own session: workers, a kernel build stopped mid-start
        if left:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        self.reader.join(5)
        return {"stop_s": time.perf_counter() - t, "rc": self.proc.returncode, "killed_leftovers": left,
                "clean": any("every worker has exited" in line for line in self.lines) and not left}


def group_alive(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid``, from /proc."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after the command name: state, ppid, pgrp
            if int(fields[2]) == pgid and fields[0] != "Z":
                alive.append(int(stat.parent.name))
    return alive


def burst(port: int, ps: list[list[int]], max_tokens: int) -> dict:
    """Every prompt at once, streamed; tokens/s = completion tokens / (last end - first send)."""
    outs = [{} for _ in ps]
    t0 = time.perf_counter()
    threads = [threading.Thread(target=stream, args=(port, {"model": "model", "prompt": p, "max_tokens": max_tokens,
                                                            "ignore_eos": True, "stream": True,
                                                            "stream_options": {"include_usage": True}}, t0, o))
               for p, o in zip(ps, outs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    errors = [o["error"] for o in outs if "error" in o]
    if errors:
        raise RuntimeError(f"{len(errors)} of {len(ps)} requests failed; first: {errors[0]}")
    wall = max(o["end_s"] for o in outs)
    tokens = sum(o.get("tokens", 0) for o in outs)
    return {"requests": len(ps), "max_tokens": max_tokens, "prompt_tokens": sum(map(len, ps)), "tokens": tokens,
            "wall_s": wall, "tokens_per_s": tokens / wall, "ttft_median_s": statistics.median(o["first_s"] for o in outs)}
