"""Worker configuration (Aladdin §4.1, Eq. 6): how many GPUs one tensor-parallel worker gets.

For each candidate TP degree N_g the worker's KV pool M (memory left after the weights) holds
M / m_r requests, m_r the average KV demand per request (l_in + l_out / 2 tokens over its life).
Its decode batch is the smallest of that, the engine's cap on running sequences (``max_batch``) and
the largest batch whose iteration still meets the ATGT target; per-GPU throughput is then ``batch / (N_g · t_iter(batch))`` — the min of the two
terms of Eq. 6. Iteration times come from the analytic cost model (which carries Eq. 5's compute
scaling and the all-reduce cost). A degree whose single-prompt TTFT misses the SLO, or whose
weights do not fit, is marked infeasible.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from hetserve.cost.analytic import CostModel
from hetserve.cost.efficiency import Efficiency
from hetserve.cost.layout import ReplicaLayout, StageLayout
from hetserve.cost.prefill_batch import PrefillBatch
from hetserve.errors import InfeasibleError
from hetserve.policies.batching import DEFAULT_BATCHING
from hetserve.specs.cluster import Cluster, cluster_from_dict
from hetserve.specs.model import ModelSpec
from hetserve.specs.workload import SLO

DEFAULT_DEGREES = (1, 2, 4, 8)


@dataclass(frozen=True)
class WorkerOption:
    gpus: int
    feasible: bool
    # what bounds the batch: "kv", "seqs" (the engine's max_batch), "atgt"; or why infeasible:
    # "memory" (the weights do not fit), "ttft" (one prompt misses the SLO)
    limit: str
    kv_capacity_tokens: float
    batch: int
    iteration_s: float
    tokens_per_s: float  # output tokens/s of one worker
    tokens_per_s_per_gpu: float
    ttft_s: float  # one mean-length prompt on an idle worker
    # seconds of worker time per mean-length prompt when prompts are batched to the engine's token
    # budget (the simulator's and the runtime's prefill batching): the prompt throughput's inverse
    prompt_s: float = 0.0


def homogeneous_cluster(gpu_name: str, count: int, per_machine: int = 8, intra: dict | None = None) -> Cluster:
    """``count`` GPUs of one type, ``per_machine`` to a box; in-box links ``intra``
    (``{"bandwidth_gbps", "latency_ms"}``) or the GPU's default, 100 Gbps between boxes."""
    machines, left, k = [], count, 0
    while left > 0:
        n = min(per_machine, left)
        machines.append({"name": f"m{k}", "gpu": gpu_name, "count": n, **({"intra": intra} if intra else {})})
        left, k = left - n, k + 1
    return cluster_from_dict({"name": f"{count}x{gpu_name}", "machines": machines,
                              "network": {"intra_site": {"bandwidth_gbps": 100, "latency_ms": 0.5}}},
                             f"<{gpu_name} pool>")


def tp_layout(cluster: Cluster, gpus: int, gpu_name: str | None = None, num_layers: int = 1) -> ReplicaLayout | None:
    """One TP group of ``gpus`` devices of one type inside one machine (None if no box has them)."""
    for devs in cluster.machines.values():
        picked = [d.index for d in devs if gpu_name is None or d.gpu.name == gpu_name]
        if len(picked) >= gpus:
            return ReplicaLayout((StageLayout(tuple(picked[:gpus]), (0, num_layers)),))
    return None


def largest_batch(cost: CostModel, layout: ReplicaLayout, avg_context: float, limit_s: float, cap: int) -> int:
    """Largest batch ≤ ``cap`` whose decode iteration at ``avg_context`` takes ≤ ``limit_s``
    (binary search; 0 if even one sequence is too slow)."""
    lo, hi = 0, cap
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if cost.decode_step_time(layout, mid, mid * avg_context) <= limit_s:
            lo = mid
        else:
            hi = mid - 1
    return lo


def worker_options(cluster: Cluster, model: ModelSpec, slo: SLO, mean_input: float, mean_output: float,
                   degrees: Sequence[int] = DEFAULT_DEGREES, gpu_name: str | None = None,
                   efficiency: Efficiency | None = None) -> list[WorkerOption]:
    """Eq. 6 evaluated for every TP degree the cluster can host in one box."""
    cost = CostModel(cluster, model, efficiency)
    m_r = mean_input + mean_output / 2.0  # average KV demand per request over its life (tokens)
    prompt = max(1, round(mean_input))
    # as many mean prompts as one step's token budget takes (the first always gets in)
    per_step = max(1, DEFAULT_BATCHING.token_budget // prompt)
    out = []
    for g in degrees:
        layout = tp_layout(cluster, g, gpu_name, model.num_layers)
        if layout is None:
            continue
        cap_tokens = cost.kv_capacity_tokens(layout)
        ttft = cost.ttft(layout, prompt)
        prompt_s = cost.prefill_time(layout, PrefillBatch.of([prompt] * per_step)) / per_step
        if cap_tokens < mean_input + mean_output:
            out.append(WorkerOption(g, False, "memory", max(cap_tokens, 0.0), 0, 0.0, 0.0, 0.0, ttft, prompt_s))
            continue
        # the engine runs at most max_batch sequences however much KV is free (as the simulator)
        b_kv = min(int(cap_tokens // m_r), cost.eff.max_batch)
        b = b_kv
        limit = "kv" if b_kv < cost.eff.max_batch else "seqs"
        if slo.tpot_s is not None:
            b_slo = largest_batch(cost, layout, m_r, slo.tpot_s, b_kv)
            if b_slo < b_kv:
                b, limit = b_slo, "atgt"
        t = cost.decode_step_time(layout, b, b * m_r) if b > 0 else 0.0
        tps = b / t if t > 0 else 0.0
        feasible = b > 0 and (slo.ttft_s is None or ttft <= slo.ttft_s)
        if slo.ttft_s is not None and ttft > slo.ttft_s:
            limit = "ttft"
        out.append(WorkerOption(g, feasible, limit, cap_tokens, b, t, tps, tps / g, ttft, prompt_s))
    return out


def check_weights_fit(cluster: Cluster, model: ModelSpec, gpu_name: str,
                      degrees: Sequence[int] = DEFAULT_DEGREES) -> None:
    """``best_worker_config``'s refusal where even the largest worker (the most ``gpu_name`` GPUs in
    one box, up to the largest degree) has less usable memory than the weights alone. It reads no
    request, so a command asks it before loading its trace."""
    degree = max((g for g in degrees if tp_layout(cluster, g, gpu_name) is not None), default=0)
    device = next(d for d in cluster.devices if d.gpu.name == gpu_name)
    have = degree * device.memory_bytes * CostModel(cluster, model).eff.usable_memory
    if have < model.weight_bytes:
        raise InfeasibleError(f"no worker of {list(degrees)} GPUs holds {model.name} and any KV cache on "
                              f"{cluster.name}: its weights alone take {model.weight_bytes / 1e9:.0f} GB, {degree} "
                              f"{gpu_name} in one box {have / 1e9:.0f} GB usable")


def best_worker_config(cluster: Cluster, model: ModelSpec, slo: SLO, mean_input: float, mean_output: float,
                       degrees: Sequence[int] = DEFAULT_DEGREES, gpu_name: str | None = None,
                       efficiency: Efficiency | None = None) -> WorkerOption:
    """The feasible degree with the highest per-GPU throughput (ties: fewer GPUs)."""
    every = worker_options(cluster, model, slo, mean_input, mean_output, degrees, gpu_name, efficiency)
    opts = [o for o in every if o.feasible]
    if not opts:
        if all(o.limit == "memory" for o in every):  # not the SLOs: the model does not fit at all
            raise InfeasibleError(f"no worker of {list(degrees)} GPUs holds {model.name} and any KV cache on "
                                  f"{cluster.name}: its weights alone take {model.weight_bytes / 1e9:.0f} GB")
        raise InfeasibleError(f"no worker of {list(degrees)} GPUs serves {model.name} within the SLOs "
                              f"(TTFT {slo.ttft_s}, ATGT {slo.tpot_s}) on {cluster.name}")
    return max(opts, key=lambda o: (o.tokens_per_s_per_gpu, -o.gpus))
