"""The testbed of experiment 2 (MoLink Tables 2, 3 and 5) and one simulated run on it.

``make_cluster`` builds the three-server RTX 4090 pipeline at a link speed, ``make_plan`` the one
colocated replica in three stages (``stages_of``), ``workload`` the filtered Azure trace at a rate,
``extended_micro_batches`` MoLink §4.3's micro-batch count, and ``run`` one simulation of it with a
transmission policy, measuring the decode messages' extra delay on the links. The tables built
from these runs live in ``molink_tables.py`` beside this module.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from hetserve.cost.analytic import CostModel
from hetserve.planner.plan import Plan, PlanReplica, PlanStage
from hetserve.policies.transmission import choose_micro_batches
from hetserve.sim.simulator import SimOptions, simulate
from hetserve.specs.cluster import cluster_from_dict, load_cluster
from hetserve.specs.workload import load_workload

MODEL = "qwen2-7b"
WARMUP_S = 60.0


def stages_of(model, n: int = 3) -> tuple[tuple[int, int], ...]:
    """``n`` contiguous layer ranges, as even as the layer count allows (the first take the extra)."""
    size, extra = divmod(model.num_layers, n)
    out, lo = [], 0
    for i in range(n):
        hi = lo + size + (1 if i < extra else 0)
        out.append((lo, hi))
        lo = hi
    return tuple(out)


@dataclass
class Row:
    ttft: float
    tpot: float
    e2e: float
    micro_batches: int
    wall_s: float
    decode_delay_mean_ms: float = float("nan")  # extra delay of decode messages on the links
    decode_delay_p99_ms: float = float("nan")


def make_cluster(bandwidth_mbps: float, latency_ms: float = 30.0):
    if bandwidth_mbps == 100 and latency_ms == 30:
        return load_cluster("molink-3x4090")
    return cluster_from_dict({
        "name": f"molink-3x4090-{bandwidth_mbps:g}mbps",
        "machines": [{"name": f"pc{i}", "gpu": "RTX-4090", "count": 1, "site": f"home-{'abc'[i]}"} for i in range(3)],
        "network": {"inter_site": {"bandwidth_gbps": bandwidth_mbps / 1000.0, "latency_ms": latency_ms}}},
        f"<molink {bandwidth_mbps} Mbps>")


def make_plan(cluster, model) -> Plan:
    stages = tuple(PlanStage((f"pc{i}:0",), s) for i, s in enumerate(stages_of(model)))
    return Plan(model.name, cluster.name, "molink-pp3", (PlanReplica("r0", "colocated", stages),))


def extended_micro_batches(cluster, model, plan, batch: int, avg_context: float) -> int:
    """MoLink §4.3: the micro-batch count in N..2N with the best emulated decode throughput."""
    cost = CostModel(cluster, model)
    layout = plan.replicas[0].layout(cluster)
    n = len(layout.stages)
    fns = [lambda b, s=s, last=(i == n - 1): cost.stage_decode_time(s, b, b * avg_context, last)
           for i, s in enumerate(layout.stages)]
    lat, bw = [], []
    for i, s in enumerate(layout.stages):
        nxt = layout.stages[(i + 1) % n]
        la, b = cluster.link(s.devices[0], nxt.devices[0])
        lat.append(la), bw.append(b)
    return choose_micro_batches(max(batch, n), fns, lat, bw, model.hidden * model.dtype_bytes, 4).micro_batches


class _DecodeDelays:
    """Records each decode message's extra delay on the links: delivery − start − (latency +
    bytes/bandwidth), i.e. the time it waited behind other traffic. Measurement only: it wraps
    ``Network.send`` for the duration of one run."""

    def __init__(self, cluster):
        self.cluster, self.delays = cluster, []

    def __enter__(self):
        from hetserve.sim import links
        self._orig = orig = links.Network.send
        rec = self

        def send(net, kind, parts, on_done):
            if kind != "decode" or len(parts) != 1:
                return orig(net, kind, parts, on_done)
            d, e, nbytes = parts[0]
            lat, bw = rec.cluster.link(d, e)
            alone = lat + nbytes / bw

            def done(start, on_done=on_done, alone=alone):
                rec.delays.append(net.loop.now - start - alone)
                on_done(start)
            return orig(net, kind, parts, done)
        links.Network.send = send
        return self

    def __exit__(self, *exc):
        from hetserve.sim import links
        links.Network.send = self._orig


def run(cluster, model, wl, transmission: str, micro_batches: int, overhead_s: float = 0.0,
        penalty: float = 0.0) -> Row:
    plan = make_plan(cluster, model)
    t0 = time.perf_counter()
    with _DecodeDelays(cluster) as rec:
        res = simulate(plan, cluster, model, wl, SimOptions(transmission=transmission, pipeline="detailed",
                                                            micro_batches=micro_batches, link_overhead_s=overhead_s,
                                                            link_competing_penalty=penalty))
    keep = res.arrival >= WARMUP_S
    d = np.asarray(rec.delays) * 1e3 if rec.delays else np.array([np.nan])
    return Row(float(np.mean(res.ttft[keep])), float(np.mean(res.tpot[keep])), float(np.mean(res.e2e[keep])),
               micro_batches, time.perf_counter() - t0, float(np.mean(d)), float(np.percentile(d, 99)))


def workload(rate: float, minutes: float):
    base = load_workload("azure-conv").filter_lengths(max_input=2048, max_output=1024)
    return base.with_rate(rate).window(0.0, WARMUP_S + 60.0 * minutes)
