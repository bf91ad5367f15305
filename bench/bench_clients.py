"""Standard benchmark clients against ``hetserve serve`` (guidellm, aiperf, inference-perf), beside its metrics.

    make bench-clients                      # installs guidellm + aiperf into .bench-venv, then runs this
    .venv/bin/python -m bench.bench_clients --client-bin /tmp/benchvenv/bin [--requests 40] [--concurrency 4]

Starts ``hetserve serve`` (a subprocess, as a user would) with two colocated replicas of a
random-weight Llama (8 layers, hidden 64) on ``demo-cpu``, then runs each client with synthetic
prompts of ``--isl`` tokens and ``--osl`` output tokens: guidellm (``--profile concurrent``; it sends
vLLM's ``ignore_eos``), aiperf (``--extra-inputs ignore_eos:true min_tokens:OSL``) and, with
``--clients ...,inference-perf``, the Kubernetes serving benchmark inference-perf (a ``concurrent``
load of exact-length prompts from its synthetic corpus, streamed completions, ``ignore_eos``; it
needs Python 3.12, so its executable may live in another venv: ``--inference-perf-bin``). Prints,
per client: its completed / errored request counts and its own TTFT and latency, then the server's
``hetserve_requests_total`` by outcome and its TTFT histogram mean over the same requests (the
server measures TTFT at the first text it streams; a client adds the network and its own parsing).

``--with-api-key`` serves behind a fresh random API key (``HETSERVE_API_KEY``) and hands it to every
client (guidellm's backend ``api_key``, aiperf's ``--api-key``, inference-perf's ``server.api_key``):
a client that does not send it fails with 401s.

Token counts differ between a client and the server when the client re-tokenizes the output text
(aiperf does): the server's count is the ``usage`` it returns.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

PLAN = {"model": "tiny", "cluster": "demo-cpu", "algorithm": "manual", "replicas": [
    {"id": f"c{i}", "role": "colocated", "stages": [{"devices": [d], "layers": [0, 8]}]}
    for i, d in enumerate(["m0:0", "m0:1"])]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_metrics(url: str) -> dict:
    text = httpx.get(url + "/metrics", timeout=10).text
    out = {"requests": {}, "ttft_sum": 0.0, "ttft_count": 0.0}
    for line in text.splitlines():
        m = re.match(r'hetserve_requests_total\{endpoint="(\w+)",outcome="(\w+)"\} ([\d.e+]+)', line)
        if m:
            out["requests"][f"{m[1]}/{m[2]}"] = float(m[3])
        elif line.startswith("hetserve_time_to_first_token_seconds_sum"):
            out["ttft_sum"] = float(line.split()[-1])
        elif line.startswith("hetserve_time_to_first_token_seconds_count"):
            out["ttft_count"] = float(line.split()[-1])
    return out


def diff(after: dict, before: dict) -> dict:
    reqs = {k: v - before["requests"].get(k, 0.0) for k, v in after["requests"].items()}
    n = after["ttft_count"] - before["ttft_count"]
    return {"requests": {k: int(v) for k, v in reqs.items() if v},
            "ttft_mean_ms": 1000 * (after["ttft_sum"] - before["ttft_sum"]) / n if n else None}


def run_guidellm(bin_dir: Path, url: str, model: Path, args, out: Path) -> dict:
    key = f",api_key={args.key}" if args.key else ""
    cmd = [str(bin_dir / "guidellm"), "run", "--backend", f"kind=openai_http,target={url},model=tiny{key}",
           "--profile", f"kind=concurrent,streams={args.concurrency}",
           "--data", f"kind=synthetic_text,prompt_tokens={args.isl},output_tokens={args.osl}",
           "--tokenizer", f"kind=hf_auto,model={model}",
           "--constraint", f"kind=max_requests,count={args.requests}",
           "--output", f"kind=json,path={out}", "--disable-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        return {"error": proc.stdout[-2000:] + proc.stderr[-2000:]}
    m = json.loads(out.read_text())["benchmarks"][0]["metrics"]
    tot = m["request_totals"]
    return {"completed": tot["successful"], "errored": tot["errored"], "incomplete": tot["incomplete"],
            "ttft_mean_ms": m["time_to_first_token_ms"]["successful"]["mean"],
            "latency_mean_s": m["request_latency"]["successful"]["mean"]}


def run_aiperf(bin_dir: Path, url: str, model: Path, args, out: Path) -> dict:
    cmd = [str(bin_dir / "aiperf"), "profile", "--model", "tiny", "--url", url, "--endpoint-type", "completions",
           "--streaming", "--concurrency", str(args.concurrency), "--request-count", str(args.requests),
           "--isl", str(args.isl), "--osl", str(args.osl), "--tokenizer", str(model),
           "--extra-inputs", "ignore_eos:true", "--extra-inputs", f"min_tokens:{args.osl}",
           "--artifact-dir", str(out), "--ui", "none"] + (["--api-key", args.key] if args.key else [])
    # aiperf's offline mode resolves a tokenizer *folder* through the hub cache and fails: let it see the folder
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
    path = out / "profile_export_aiperf.json"
    if proc.returncode != 0 or not path.exists():
        return {"error": proc.stdout[-2000:] + proc.stderr[-2000:]}
    d = json.loads(path.read_text())
    errors = sum(e.get("count", 1) for e in d.get("error_summary") or [])
    return {"completed": int(d["request_count"]["avg"]) - errors, "errored": errors, "incomplete": 0,
            "ttft_mean_ms": d["time_to_first_token"]["avg"], "latency_mean_s": d["request_latency"]["avg"] / 1000}


def run_inference_perf(bin_dir: Path, url: str, model: Path, args, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)

    def exactly(n: int) -> dict:
        return {"min": n, "max": n, "mean": n, "std_dev": 0, "total_count": args.requests}

    config = {"load": {"type": "concurrent", "num_workers": 1,
                       "stages": [{"num_requests": args.requests, "concurrency_level": args.concurrency}]},
              "api": {"type": "completion", "streaming": True},
              "server": {"type": "vllm", "model_name": "tiny", "base_url": url, "ignore_eos": True,
                         **({"api_key": args.key} if args.key else {})},
              "tokenizer": {"pretrained_model_name_or_path": str(model)},
              # "synthetic": exact-length text cut from its corpus; "random" token ids do not survive the
              # tiny model's byte-level tokenizer's round trip (inference-perf then gives up on a prompt)
              "data": {"type": "synthetic", "input_distribution": exactly(args.isl),
                       "output_distribution": exactly(args.osl)},
              "storage": {"local_storage": {"path": str(out / "reports")}}}
    (out / "config.json").write_text(json.dumps(config))  # YAML is a superset of JSON
    binary = Path(args.inference_perf_bin or bin_dir) / "inference-perf"
    proc = subprocess.run([str(binary), "--config_file", str(out / "config.json")], capture_output=True, text=True,
                          timeout=1800, cwd=out)
    found = sorted(out.rglob("summary_lifecycle_metrics.json"))
    if proc.returncode != 0 or not found:
        return {"error": proc.stdout[-2000:] + proc.stderr[-2000:]}
    d = json.loads(found[-1].read_text())
    ok, failed = d["successes"], d["failures"]
    done, errored = int(ok["count"]), int(failed["count"])
    # requests it never sent (a prompt it could not build) count as incomplete, not as silently fine
    return {"completed": done, "errored": errored, "incomplete": args.requests - done - errored,
            "ttft_mean_ms": 1000 * ok["latency"]["time_to_first_token"]["mean"],
            "latency_mean_s": ok["latency"]["request_latency"]["mean"]}


RUNNERS = {"guidellm": run_guidellm, "aiperf": run_aiperf, "inference-perf": run_inference_perf}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--client-bin", required=True, help="folder holding the guidellm and aiperf executables")
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--isl", type=int, default=32, help="prompt tokens")
    ap.add_argument("--osl", type=int, default=16, help="output tokens")
    ap.add_argument("--clients", default="guidellm,aiperf", help="comma-separated: " + ", ".join(RUNNERS))
    ap.add_argument("--inference-perf-bin", help="folder holding the inference-perf executable (default: "
                                                  "--client-bin); inference-perf needs Python 3.12")
    ap.add_argument("--with-api-key", action="store_true",
                    help="serve behind a fresh random API key and pass it to the clients")
    args = ap.parse_args()
    args.key = secrets.token_urlsafe(32) if args.with_api_key else None
    bin_dir = Path(args.client_bin)
    from hetserve.planner.plan import Plan
    from hetserve.runtime.model.make import make_model

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = make_model(tmp / "tiny", "llama", layers=8, hidden=64, heads=4, kv_heads=2, seed=0)
        Plan.from_dict(PLAN).save(tmp / "plan.json")
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        env = {**os.environ, "NO_PROXY": "127.0.0.1,localhost", "HF_HUB_OFFLINE": "1"}
        env.pop("HETSERVE_API_KEY", None)
        if args.key:  # through the environment: a key in the server's argv would show in ps
            env["HETSERVE_API_KEY"] = args.key
        server = subprocess.Popen([sys.executable, "-m", "hetserve.cli.main", "serve", "--plan", str(tmp / "plan.json"),
                                   "--cluster", "demo-cpu", "--model", str(model), "--port", str(port),
                                   "--log-level", "warning"], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
        os.environ["NO_PROXY"] = "127.0.0.1,localhost"
        rows = []
        try:
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline:
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.5)
            for name in args.clients.split(","):
                before = server_metrics(url)
                run = RUNNERS[name]
                t0 = time.monotonic()
                res = run(bin_dir, url, model, args, tmp / f"{name}.json" if name == "guidellm" else tmp / name)
                rows.append((name, res, diff(server_metrics(url), before), time.monotonic() - t0))
        finally:
            server.terminate()
            server.wait(60)
    load = os.getloadavg()
    print(f"\n{args.requests} requests per client, concurrency {args.concurrency}, {args.isl} prompt / {args.osl} "
          f"output tokens; 2 colocated CPU replicas on demo-cpu{', behind an API key' if args.key else ''}; "
          f"load average {load[0]:.1f} / {load[1]:.1f}\n")
    print("| client | completed | errored | client TTFT mean (ms) | client latency mean (s) | server requests_total "
          "(this run) | server TTFT mean (ms) | wall (s) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, res, srv, wall in rows:
        if "error" in res:
            print(f"| {name} | failed to run: {res['error'][-300:]!r} | | | | {srv['requests']} | | {wall:.0f} |")
            continue
        ttft = f"{srv['ttft_mean_ms']:.1f}" if srv["ttft_mean_ms"] is not None else "—"
        missing = f" ({res['incomplete']} not completed)" if res.get("incomplete") else ""
        print(f"| {name} | {res['completed']}{missing} | {res['errored']} | {res['ttft_mean_ms']:.1f} | "
              f"{res['latency_mean_s']:.3f} | {srv['requests']} | {ttft} | {wall:.0f} |")


if __name__ == "__main__":
    main()
