"""Lay a plan out for the runtime, checking it against the checkpoint and the cluster.

``local_devices`` says which torch device each plan device's worker uses on this host;
``build_layout(plan, cluster, cfg, device_of)`` returns the ``ReplicaSpec`` records of ``layout.py``
after checking (PlanError, naming the replica and stage, otherwise):

- the structural checks every engine shares (``planner.validate.check_runnable``): stages cover
  ``[0, num_layers)`` of the checkpoint in order, TP degrees divide the heads, KV heads and FFN
  width, no device is used twice, some replica runs prefill and some decode, KV routes join
  prefill to decode replicas.

Inside a stage, the leader (TP rank 0) is the device with the lowest latency to the neighbouring
stages' devices (HexGen §3.2): only leaders exchange activations between stages.

``check_memory`` checks that every worker's weights and activation buffers fit its device's memory in
the cluster file and returns, per replica, how many KV tokens fit beside them (the planner's rule). Parameter and KV sizes come from the cost
model (``device_weight_bytes``, ``device_kv_bytes_per_token``): one formula for planner, simulator
and runtime; embeddings and LM head sit on stage leaders only.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Iterable, Mapping

from hetserve.cost.layout import kv_head_range
from hetserve.cost.device_memory import (device_activation_bytes, device_kv_bytes_per_token, device_weight_bytes,
                                         kv_tokens_fit)
from hetserve.cost.efficiency import Efficiency
from hetserve.errors import PlanError
from hetserve.planner.plan import Plan, PlanReplica
from hetserve.planner.validate import check_runnable
from hetserve.runtime.layout import ReplicaSpec, WorkerSpec
from hetserve.runtime.model.config import ArchConfig
from hetserve.specs.cluster import Cluster
from hetserve.specs.model import DTYPE_BYTES, ModelSpec



# ----------------------------------------------------------------------------- memory


def model_spec(cfg: ArchConfig, dtype_bytes: int) -> ModelSpec:
    """The cost model's view of the checkpoint, at the dtype the runtime loads it in."""
    return ModelSpec(cfg.raw.get("_name_or_path") or cfg.arch, cfg.arch, cfg.num_layers, cfg.hidden_size,
                     cfg.num_heads, cfg.num_kv_heads, cfg.ffn_size, cfg.vocab_size, cfg.max_positions,
                     dtype_bytes, cfg.tie_word_embeddings, cfg.head_dim)


def worker_weight_bytes(spec: ModelSpec, w: WorkerSpec) -> float:
    """Bytes of the weights worker ``w`` loads (the cost model's formula)."""
    return device_weight_bytes(spec, w.layers[1] - w.layers[0], w.tp_world, w.is_first, w.is_last, w.is_leader)


def worker_kv_bytes_per_token(spec: ModelSpec, w: WorkerSpec) -> float:
    return device_kv_bytes_per_token(spec, w.layers[1] - w.layers[0], w.tp_world)


def check_memory(layout: tuple[ReplicaSpec, ...], cluster: Cluster, cfg: ArchConfig, dtype: str,
                 memory_fraction: float = Efficiency.usable_memory) -> dict[str, int]:
    """Per replica, the most KV tokens every worker can hold beside its weights and activation
    buffers within ``memory_fraction`` of its device's memory: the planner's memory rule
    (``cost/device_memory.py``) with the runtime's fraction as its usable memory. PlanError if the
    weights and buffers alone do not fit."""
    spec = model_spec(cfg, DTYPE_BYTES[dtype])
    eff = Efficiency(usable_memory=memory_fraction)
    act = device_activation_bytes(spec, eff.activation_buffers, eff.activation_tokens)
    fit: dict[str, int] = {}
    for r in layout:
        tokens = None
        for w in r.workers:
            dev = cluster.device(w.name)
            held = worker_weight_bytes(spec, w) + act
            n = kv_tokens_fit(dev.memory_bytes, memory_fraction, held, worker_kv_bytes_per_token(spec, w))
            if n < 0:
                raise PlanError(
                    f"replica {r.id} stage {w.stage} on device {w.name} ({dev.gpu.name}, "
                    f"{dev.memory_bytes / 1e9:.1f} GB): its weights and activation buffers need {held / 1e9:.2f} GB, "
                    f"more than {memory_fraction:.0%} of the device's memory; use more layers' worth of devices or a "
                    f"higher TP degree")
            n = min(int(n), 1 << 40) if n != float("inf") else 1 << 40
            tokens = n if tokens is None else min(tokens, n)
        fit[r.id] = int(tokens)
    return fit


# ----------------------------------------------------------------------------- building


def local_devices(names: Iterable[str], cluster: Cluster, n_gpu: int,
                  running: Mapping[str, str] | None = None) -> dict[str, str]:
    """Each plan device's torch device where every worker runs on this host (``cpu`` without GPUs).

    A device ``running`` already has (a re-plan: the workers' current torch devices) keeps its GPU;
    every other one, in the cluster's order, takes the GPU here that holds the fewest so far. So a
    plan's devices get distinct GPUs while there are enough (a pool of several machines run on one
    box spreads over it), and a re-plan never moves a kept worker (``elastic.py``)."""
    names = list(names)
    if not n_gpu:
        return {d: "cpu" for d in names}
    running = running or {}
    out = {d: running[d] for d in names if d in running}
    held = Counter(int(v.rpartition(":")[2]) for v in running.values() if v.startswith("cuda:"))
    for d in sorted((d for d in names if d not in out), key=lambda d: cluster.device(d).index):
        gpu = min(range(n_gpu), key=lambda g: (held[g], g))
        out[d] = f"cuda:{gpu}"
        held[gpu] += 1
    return out


def build_layout(plan: Plan, cluster: Cluster, cfg: ArchConfig, device_of: dict[str, str],
                 source: str = "plan", checkpoint: str | None = None) -> tuple[ReplicaSpec, ...]:
    """Check ``plan`` against the checkpoint ``cfg`` (read from the folder ``checkpoint``, which the
    errors name) and ``cluster`` (the planner's one set of plan checks, ``check_runnable``); return
    the runtime layout."""
    # only shapes matter to the checks; the checkpoint stands for the plan's model, whatever its name
    spec = model_spec(cfg, DTYPE_BYTES["float32"])
    name = f"the checkpoint {checkpoint}" if checkpoint else f"the checkpoint ({spec.name})"
    check_runnable(plan, cluster, dataclasses.replace(spec, name=name), source)
    return tuple(_replica_spec(r, cluster, cfg, device_of) for r in plan.replicas)


def _replica_spec(r: PlanReplica, cluster: Cluster, cfg: ArchConfig, device_of: dict[str, str]) -> ReplicaSpec:
    n = len(r.stages)
    ordered = []
    for i, s in enumerate(r.stages):
        neighbours = [d for j in (i - 1, i + 1) if 0 <= j < n for d in r.stages[j].devices]
        ordered.append(_leader_first(s.devices, neighbours, cluster))
    stages = []
    for i, (s, devices) in enumerate(zip(r.stages, ordered)):
        t = len(devices)
        nxt = ordered[i + 1][0] if i + 1 < n else None
        stages.append(tuple(
            WorkerSpec(name=d, replica=r.id, role=r.role, stage=i, num_stages=n, layers=tuple(s.layers),
                       tp_rank=k, tp_world=t, leader=devices[0], next_leader=nxt,
                       kv_heads=kv_head_range(k, t, cfg.num_kv_heads), device=device_of[d])
            for k, d in enumerate(devices)))
    return ReplicaSpec(r.id, r.role, tuple(stages))


def _leader_first(devices: tuple[str, ...], neighbours: list[str], cluster: Cluster) -> tuple[str, ...]:
    """Devices with the one of lowest total latency to ``neighbours`` first (ties: plan order)."""
    if len(devices) == 1 or not neighbours:
        return tuple(devices)
    idx = [cluster.device(d).index for d in neighbours]

    def cost(d: str) -> float:
        i = cluster.device(d).index
        return float(sum(cluster.latency[i, j] for j in idx))

    leader = min(devices, key=cost)
    return (leader,) + tuple(d for d in devices if d != leader)
