"""One plan on three Ray nodes vs the same plan on one Ray node: start-up time, tokens/s, same tokens.

    .venv/bin/python -m bench.bench_multinode                    # 32 requests x 64 tokens, both plan shapes (~3 min)
    .venv/bin/python -m bench.bench_multinode --requests 8 --max-tokens 16 --json out.json

On this one machine: "three nodes" is a Ray cluster of three nodes, each on its own loopback address
(127.0.0.2 head, 127.0.0.3, 127.0.0.4), each advertising one machine of the cluster file, so every
worker binds its own node's address and activations, KV hand-offs and the TP group cross nodes over
TCP; "one node" is a private one-node Ray on 127.0.0.1 advertising all three machines. Same
checkpoint, same plan, same requests (all arriving at t = 0, greedy, every request generating exactly
``--max-tokens`` tokens), Ray backend both times.

Plans: ``pd`` (prefill on m0 -> decode stages on m1 and m2) and ``asym`` (TP 2 across m0 + m1 for
layer 0, then TP 1 on m2 for the rest).

Measured: ``start_s`` is ``start_ray_engine`` until every worker has loaded its shard and connected
to its peers (Ray's own cluster start is shown apart, ``ray_up_s``); ``tokens/s`` is all output
tokens over the makespan, the median of ``--repeats`` rounds of the whole request set after one
warm-up round; ``same tokens`` compares each request's tokens with the one-node run's.
Each of the three nodes has 1 CPU for Ray, the one node 3: Ray starts at most a node's CPU count of
worker processes at once, so both start three workers in parallel.
Loopback has no network cost, so the ratio shows what spanning Ray nodes costs in hetserve's own
software path (addresses, per-node Ray scheduling), not a real network's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.lib.workdir import workdir

NODES = {"m0": "127.0.0.2", "m1": "127.0.0.3", "m2": "127.0.0.4"}
LAYERS = 4


def cluster_yaml() -> str:
    return ("name: bench-pool\nmachines:\n"
            + "".join(f"  - {{name: {m}, gpu: RTX-4090, count: 2, address: {ip}}}\n" for m, ip in NODES.items())
            + "network:\n  intra_site: {bandwidth_gbps: 10, latency_ms: 0.1}\n")


def plans() -> dict[str, dict]:
    def plan(replicas, routes=()):
        return {"model": "tiny", "cluster": "bench-pool", "replicas": replicas,
                "kv_routes": [{"from": a, "to": b, "weight": 1.0} for a, b in routes]}

    return {
        "pd": plan([{"id": "p0", "role": "prefill", "stages": [{"devices": ["m0:0"], "layers": [0, LAYERS]}]},
                    {"id": "d0", "role": "decode", "stages": [{"devices": ["m1:0"], "layers": [0, 2]},
                                                              {"devices": ["m2:0"], "layers": [2, LAYERS]}]}],
                   [("p0", "d0")]),
        "asym": plan([{"id": "c0", "role": "colocated",
                       "stages": [{"devices": ["m0:1", "m1:1"], "layers": [0, 1]},
                                  {"devices": ["m2:1"], "layers": [1, LAYERS]}]}]),
    }


def run_plan(plan_dict, cluster, model, prompts, max_tokens, addresses, repeats) -> dict:
    from hetserve.planner.plan import Plan
    from hetserve.runtime.engine_config import EngineConfig
    from hetserve.runtime.workers.ray_backend import start_ray_engine
    from hetserve.runtime.params import SamplingParams

    t0 = time.monotonic()
    engine = start_ray_engine(Plan.from_dict(plan_dict), cluster, model, EngineConfig(kv_capacity_tokens=4096),
                              machine_addresses=addresses)
    start_s = time.monotonic() - t0
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        engine.generate(prompts[:2], params, timeout=300)  # warm-up: first-step allocations on every worker
        spans = []
        for _ in range(repeats):
            t0 = time.monotonic()
            outs = engine.generate(prompts, params, timeout=600)
            spans.append(time.monotonic() - t0)
        makespan = statistics.median(spans)
        hosts = sorted({p.host for p in engine.procs.values()})
    finally:
        engine.shutdown()
    tokens = sum(len(o) for o in outs)
    return {"start_s": start_s, "tokens": tokens, "makespan_s": makespan, "tokens_per_s": tokens / makespan,
            "outputs": outs, "worker_hosts": hosts}


def one_node(cluster, model, prompts, max_tokens, repeats) -> tuple[float, dict]:
    import ray

    from hetserve.runtime.workers.ray_session import RaySession

    t0 = time.monotonic()
    # private: 127.0.0.1, every machine's resource, as many CPUs as the three nodes together (Ray starts
    # at most that many worker processes at once on a node)
    session = RaySession.start(cluster, num_cpus=len(NODES))
    up = time.monotonic() - t0
    try:
        return up, {name: run_plan(p, cluster, model, prompts, max_tokens, {}, repeats)
                    for name, p in plans().items()}
    finally:
        session.close()
        assert not ray.is_initialized()


def three_nodes(cluster, model, prompts, max_tokens, repeats) -> tuple[float, dict]:
    from ray.cluster_utils import Cluster

    from hetserve.runtime.workers.ray_session import RaySession, machine_resource

    small = {"num_cpus": 1, "object_store_memory": 78 * 1024 * 1024}
    t0 = time.monotonic()
    rc = Cluster(initialize_head=True, head_node_args={
        "node_ip_address": NODES["m0"], "resources": {machine_resource("m0"): 1000}, "include_dashboard": False,
        **small})
    session = None
    try:
        for m in ("m1", "m2"):
            rc.add_node(node_ip_address=NODES[m], resources={machine_resource(m): 1000}, **small)
        rc.wait_for_nodes()
        session = RaySession.start(cluster, address=rc.address, node_ip_address=NODES["m0"])
        up = time.monotonic() - t0
        return up, {name: run_plan(p, cluster, model, prompts, max_tokens, None, repeats)
                    for name, p in plans().items()}
    finally:
        if session is not None:
            session.close()
        rc.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds per run (median reported)")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()

    from hetserve.runtime.model.make import make_model
    from hetserve.specs.cluster import load_cluster

    ray_tmp = str(workdir("hsbn-", dir="/tmp"))  # Ray's socket paths must stay short
    os.environ.update(RAY_AUTH_MODE="disabled", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_TMPDIR=ray_tmp)
    work = workdir("hsbn-work-")
    (work / "pool.yaml").write_text(cluster_yaml())
    cluster = load_cluster(str(work / "pool.yaml"))
    model = make_model(work / "tiny", "llama", layers=LAYERS, hidden=args.hidden, heads=4, kv_heads=2,
                       max_positions=512, seed=0)
    rng = random.Random(0)
    prompts = [[rng.randrange(32, 127) for _ in range(rng.randrange(8, 65))] for _ in range(args.requests)]
    up1, one = one_node(cluster, model, prompts, args.max_tokens, args.repeats)
    up3, three = three_nodes(cluster, model, prompts, args.max_tokens, args.repeats)

    load = os.getloadavg()
    print(f"\n{args.requests} requests x {args.max_tokens} tokens, tiny Llama ({LAYERS} layers, hidden {args.hidden}); "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} (2 cores shared: timings are noisy)")
    print(f"Ray cluster start (not in start_s): one node {up1:.1f} s, three nodes {up3:.1f} s\n")
    head = f"{'plan':<6} {'nodes':>5} {'start_s':>8} {'tokens/s':>9} {'makespan_s':>10}  {'worker hosts':<30} {'same tokens':>11}"
    print(head)
    print("-" * len(head))
    rows = []
    for name in plans():
        a, b = one[name], three[name]
        same = a["outputs"] == b["outputs"]
        for n, r in ((1, a), (3, b)):
            print(f"{name:<6} {n:>5} {r['start_s']:>8.2f} {r['tokens_per_s']:>9.1f} {r['makespan_s']:>10.2f}  "
                  f"{','.join(r['worker_hosts']):<30} {('yes' if same else 'NO') if n == 3 else '':>11}")
            rows.append({"plan": name, "nodes": n, **{k: v for k, v in r.items() if k != "outputs"},
                         "same_tokens_as_one_node": same})
        print(f"{name:<6} {'3 / 1':>5} {b['start_s'] / a['start_s']:>7.2f}x {b['tokens_per_s'] / a['tokens_per_s']:>8.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "ray_up_s": {"1": up1, "3": up3},
                                               "loadavg": load}, indent=2))
    return 0 if all(r["same_tokens_as_one_node"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
