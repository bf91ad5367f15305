"""Lay a plan out for the runtime, checking it against the checkpoint and the cluster.

``build_layout(plan, cluster, cfg, device_of)`` returns the ``ReplicaSpec`` records of ``layout.py``
after checking (PlanError, naming the replica and stage, otherwise):

- every replica's stages cover ``[0, num_layers)`` of the checkpoint, in order;
- every stage's TP degree divides the heads, KV heads and FFN width; no device is used twice;
- some replica runs prefill and some runs decode; KV routes join prefill to decode replicas.

Inside a stage, the leader (TP rank 0) is the device with the lowest latency to the neighbouring
stages' devices (HexGen §3.2): only leaders exchange activations between stages.

``check_memory`` checks that every worker's weights fit its device's memory in the cluster file and
returns, per replica, how many KV tokens fit beside them.
"""

from __future__ import annotations

from hetserve.errors import PlanError
from hetserve.planner.plan import Plan, PlanReplica
from hetserve.runtime.layout import ReplicaSpec, WorkerSpec
from hetserve.runtime.model.config import ArchConfig
from hetserve.specs.cluster import Cluster

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


# ----------------------------------------------------------------------------- memory


def worker_weight_bytes(cfg: ArchConfig, w: WorkerSpec, dtype_bytes: int) -> int:
    """Bytes of the weights worker ``w`` loads (its TP shard of its layers, embeddings/head if leader)."""
    H, F, D, t = cfg.hidden_size, cfg.ffn_size, cfg.head_dim, w.tp_world
    if cfg.arch == "llama":
        attn = H * (cfg.num_heads + 2 * cfg.num_kv_heads) * D + cfg.num_heads * D * H
        per_layer = (attn + 3 * H * F) // t + 2 * H
        embed = cfg.vocab_size * H
        head = cfg.vocab_size * H + H
    else:
        P = cfg.word_embed_proj_dim
        per_layer = (4 * H * H + 2 * H * F + 3 * H + F) // t + 2 * H + 4 * H  # + out/fc2 bias, 2 LNs
        embed = cfg.vocab_size * P + (cfg.max_positions + 2) * H + (P * H if P != H else 0)
        head = cfg.vocab_size * P + 2 * H + (P * H if P != H else 0)
    n = per_layer * (w.layers[1] - w.layers[0])
    if w.is_leader and w.is_first:
        n += embed
    if w.is_leader and w.is_last:
        n += head
    return n * dtype_bytes


def worker_kv_bytes_per_token(cfg: ArchConfig, w: WorkerSpec, dtype_bytes: int) -> int:
    heads = w.kv_heads[1] - w.kv_heads[0]
    return 2 * (w.layers[1] - w.layers[0]) * heads * cfg.head_dim * dtype_bytes


def check_memory(layout: tuple[ReplicaSpec, ...], cluster: Cluster, cfg: ArchConfig, dtype: str,
                 memory_fraction: float = 0.9) -> dict[str, int]:
    """Per replica, the most KV tokens every worker can hold after its weights (PlanError if weights alone don't fit)."""
    nbytes = DTYPE_BYTES[dtype]
    fit: dict[str, int] = {}
    for r in layout:
        tokens = None
        for w in r.workers:
            dev = cluster.device(w.name)
            budget = dev.memory_bytes * memory_fraction
            weights = worker_weight_bytes(cfg, w, nbytes)
            if weights > budget:
                raise PlanError(
                    f"replica {r.id} stage {w.stage} on device {w.name} ({dev.gpu.name}, "
                    f"{dev.memory_bytes / 1e9:.1f} GB): its weights need {weights / 1e9:.2f} GB, more than "
                    f"{memory_fraction:.0%} of the device's memory; use more layers' worth of devices or a higher TP degree")
            per_token = worker_kv_bytes_per_token(cfg, w, nbytes)
            n = int((budget - weights) // per_token) if per_token else 1 << 40
            tokens = n if tokens is None else min(tokens, n)
        fit[r.id] = int(tokens)
    return fit


# ----------------------------------------------------------------------------- building


def build_layout(plan: Plan, cluster: Cluster, cfg: ArchConfig, device_of: dict[str, str],
                 source: str = "plan") -> tuple[ReplicaSpec, ...]:
    """Check ``plan`` against the checkpoint ``cfg`` and ``cluster``; return the runtime layout."""
    seen: set[str] = set()
    replicas = []
    for r in plan.replicas:
        _check_replica(r, cfg, cluster, seen, source)
        replicas.append(_replica_spec(r, cluster, cfg, device_of))
    roles = {r.role for r in plan.replicas}
    if not roles & {"prefill", "colocated"}:
        raise PlanError(f"{source}: no replica can run prefill (roles: {sorted(roles)})")
    if not roles & {"decode", "colocated"}:
        raise PlanError(f"{source}: no replica can run decode (roles: {sorted(roles)})")
    ids = {r.id for r in plan.replicas}
    for k in plan.kv_routes:
        if k.src not in ids or plan.replica(k.src).role != "prefill":
            raise PlanError(f"{source}: kv route from {k.src!r}: not a prefill replica of the plan")
        if k.dst not in ids or plan.replica(k.dst).role != "decode":
            raise PlanError(f"{source}: kv route to {k.dst!r}: not a decode replica of the plan")
    if "prefill" in roles and "decode" not in roles:
        raise PlanError(f"{source}: prefill replicas need at least one decode replica to hand their KV to")
    return tuple(replicas)


def _check_replica(r: PlanReplica, cfg: ArchConfig, cluster: Cluster, seen: set[str], source: str) -> None:
    end = 0
    for i, s in enumerate(r.stages):
        if s.layers[0] != end or s.layers[1] <= s.layers[0]:
            raise PlanError(f"{source}: replica {r.id} stage {i} has layers {list(s.layers)}; "
                            f"expected a non-empty range starting at {end}")
        end = s.layers[1]
        for d in s.devices:
            if not cluster.has_device(d):
                raise PlanError(f"{source}: replica {r.id} uses device {d!r}, which cluster {cluster.name!r} lacks")
            if d in seen:
                raise PlanError(f"{source}: device {d!r} appears twice in the plan")
            seen.add(d)
        t = s.tp
        for what, n in (("attention heads", cfg.num_heads), ("KV heads", cfg.num_kv_heads), ("FFN width", cfg.ffn_size)):
            if n % t:
                raise PlanError(f"{source}: replica {r.id} stage {i} has TP degree {t}, which does not divide "
                                f"the model's {n} {what}")
    if end != cfg.num_layers:
        raise PlanError(f"{source}: replica {r.id} covers layers [0, {end}) but the checkpoint has "
                        f"{cfg.num_layers} layers")


def _replica_spec(r: PlanReplica, cluster: Cluster, cfg: ArchConfig, device_of: dict[str, str]) -> ReplicaSpec:
    n = len(r.stages)
    ordered = []
    for i, s in enumerate(r.stages):
        neighbours = [d for j in (i - 1, i + 1) if 0 <= j < n for d in r.stages[j].devices]
        ordered.append(_leader_first(s.devices, neighbours, cluster))
    stages = []
    for i, (s, devices) in enumerate(zip(r.stages, ordered)):
        t = len(devices)
        per = cfg.num_kv_heads // t
        nxt = ordered[i + 1][0] if i + 1 < n else None
        stages.append(tuple(
            WorkerSpec(name=d, replica=r.id, role=r.role, stage=i, num_stages=n, layers=tuple(s.layers),
                       tp_rank=k, tp_world=t, leader=devices[0], next_leader=nxt,
                       kv_heads=(k * per, (k + 1) * per), device=device_of[d])
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
