"""The hetserve bundle run for real (a bench-level check, `make bench-deploy`; not in the default suite).

    .venv/bin/python tests/export/run_hetserve_bundle.py

A tiny random Llama; a P/D plan over three machines whose addresses are 127.0.0.2-4 (prefill on m0,
decode's two stages on m1 and m2); `hetserve export --to hetserve`; then the bundle's own scripts:
`bash machines/<m>.sh ray` on each "machine" (three Ray nodes on the loopback addresses, each with
its `hetserve_machine_<m>` resource) and `bash machines/m0.sh serve` (hetserve serve over Ray). The
openai client's greedy completions through it are compared with the same plan served on one node
(`hetserve serve`, local processes). Exit 0 when every completion is the same.

Ray runs with RAY_AUTH_MODE=disabled (loopback only, as the multi-node tests), a private RAY_TMPDIR,
and a small object store. Everything this script starts is ended by pid: the serve scripts' process
groups, and the Ray processes whose command line names the private RAY_TMPDIR.
"""

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
NODES = {"m0": "127.0.0.2", "m1": "127.0.0.3", "m2": "127.0.0.4"}
CLUSTER_YAML = "name: loopback-pool\nmachines:\n" + "".join(
    f"  - {{name: {m}, gpu: RTX-4090, count: 1, address: {ip}}}\n" for m, ip in NODES.items()) + \
    "network:\n  intra_site: {bandwidth_gbps: 10, latency_ms: 0.1}\n"
LAYERS = 4
PLAN = {"model": "tiny", "cluster": "loopback-pool", "algorithm": "hand", "replicas": [
    {"id": "p0", "role": "prefill", "stages": [{"devices": ["m0:0"], "layers": [0, LAYERS]}]},
    {"id": "d0", "role": "decode", "stages": [{"devices": ["m1:0"], "layers": [0, 2]},
                                              {"devices": ["m2:0"], "layers": [2, LAYERS]}]}],
    "kv_routes": [{"from": "p0", "to": "d0", "weight": 1.0}]}
PROMPTS = ["Hello, many machines!", "The quick brown fox jumps over the lazy dog.", "A", "0123456789"]
MAX_NEW = 16


def free_port(host="127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_health(url: str, proc, deadline_s: float) -> None:
    import httpx

    t = time.monotonic() + deadline_s
    while time.monotonic() < t:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the server exited ({proc.returncode})")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not up after {deadline_s:.0f} s")


def completions(url: str) -> list[str]:
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    return [client.completions.create(model="tiny", prompt=p, max_tokens=MAX_NEW, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].text for p in PROMPTS]


def end_group(proc) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def ray_pids(marker: str) -> list[int]:
    """Processes whose command line names ``marker`` (this run's private RAY_TMPDIR)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if marker in (d / "cmdline").read_bytes().decode(errors="replace"):
                    out.append(int(d.name))
            except OSError:
                continue
    return out


def main() -> int:
    from hetserve.cli.main import main as hetserve
    from hetserve.runtime.model.make import make_model

    work = Path(tempfile.mkdtemp(prefix="hsb-", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
    ray_tmp = work / "ray"
    ray_tmp.mkdir()
    procs = []
    try:
        model = make_model(work / "tiny", "llama", layers=LAYERS, hidden=64, heads=4, kv_heads=2,
                           max_positions=512, seed=3)
        (work / "cluster.yaml").write_text(CLUSTER_YAML)
        (work / "plan.json").write_text(json.dumps(PLAN))
        bundle = work / "bundle"
        assert hetserve(["export", "--plan", str(work / "plan.json"), "--cluster", str(work / "cluster.yaml"),
                         "--to", "hetserve", "--model", str(model), "--ray-port", str(free_port(NODES["m0"])),
                         "-o", str(bundle)]) == 0
        env = {**os.environ, "PATH": f"{ROOT / '.venv' / 'bin'}:{os.environ['PATH']}", "RAY_AUTH_MODE": "disabled",
               "RAY_TMPDIR": str(ray_tmp), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1",
               "RAY_DEFAULT_OBJECT_STORE_MEMORY_PROPORTION": "0.01", "HF_HUB_OFFLINE": "1"}
        t0 = time.perf_counter()
        for m in NODES:  # the ray phase on every machine, head first (README order)
            subprocess.run(["bash", str(bundle / "machines" / f"{m}.sh"), "ray"], env=env, check=True, cwd=bundle)
        ray_up = time.perf_counter() - t0
        serve = subprocess.Popen(["bash", str(bundle / "machines" / "m0.sh"), "serve"], env=env, cwd=bundle,
                                 start_new_session=True)
        procs.append(serve)
        wait_health(f"http://{NODES['m0']}:8000", serve, 300)
        served_up = time.perf_counter() - t0
        three = completions(f"http://{NODES['m0']}:8000")
        end_group(serve)
        port = free_port()
        one = subprocess.Popen([str(ROOT / ".venv" / "bin" / "hetserve"), "serve", "--plan", str(work / "plan.json"),
                                "--cluster", str(work / "cluster.yaml"), "--model", str(model), "--port", str(port)],
                               env=env, start_new_session=True)
        procs.append(one)
        wait_health(f"http://127.0.0.1:{port}", one, 300)
        local = completions(f"http://127.0.0.1:{port}")
        same = three == local
        print(json.dumps({"ray_nodes_up_s": round(ray_up, 1), "served_after_s": round(served_up, 1),
                          "completions": len(three), "same_as_one_node": same}, indent=1))
        if not same:
            for a, b in zip(three, local):
                print(f"3 nodes {a!r}\n1 node  {b!r}")
        return 0 if same else 1
    finally:
        for p in procs:
            end_group(p)
        for pid in ray_pids(str(ray_tmp)):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        time.sleep(2)
        for pid in ray_pids(str(ray_tmp)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
