"""The runtime's view of a plan: which worker holds which layers and KV heads, and who talks to whom.

Plain, picklable records shipped to every worker (built and checked by ``deployment.build_layout``):
a ``ReplicaSpec`` is a pipeline of stages, each a tuple of ``WorkerSpec`` in TP-rank order, rank 0
being the stage leader. Worker ``k`` of a TP-``t`` stage holds KV heads ``[k*n/t, (k+1)*n/t)``.

``kv_transfers(src, dst)`` lists the pieces of a prefill -> decode KV hand-off: for every pair of
workers, the layers and KV heads they share (layer-matched, re-sharded across different TP degrees).
Kept free of planner imports: worker processes import it at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetserve.planner.plan import HasRole



@dataclass(frozen=True)
class WorkerSpec:
    name: str  # device name, "machine:i"; also the transport endpoint name
    replica: str
    role: str
    stage: int
    num_stages: int
    layers: tuple[int, int]  # half-open, global layer ids
    tp_rank: int
    tp_world: int
    leader: str  # this stage's leader
    next_leader: str | None  # next stage's leader; None on the last stage
    kv_heads: tuple[int, int]  # half-open range of global KV heads held
    device: str  # torch device, "cpu" or "cuda:k"

    @property
    def is_leader(self) -> bool:
        return self.tp_rank == 0

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1


@dataclass(frozen=True)
class ReplicaSpec(HasRole):
    id: str
    role: str
    stages: tuple[tuple[WorkerSpec, ...], ...]  # stages[s][tp_rank]

    @property
    def workers(self) -> tuple[WorkerSpec, ...]:
        return tuple(w for s in self.stages for w in s)

    @property
    def entry(self) -> str:
        """Leader of the first stage: where steps enter the pipeline."""
        return self.stages[0][0].name


@dataclass(frozen=True)
class KVTransfer:
    src: str  # prefill worker
    dst: str  # decode worker
    layers: tuple[int, int]  # global layer range both hold
    heads: tuple[int, int]  # global KV head range both hold


def kv_transfers(src: ReplicaSpec, dst: ReplicaSpec) -> list[KVTransfer]:
    """Pieces of a hand-off from ``src`` to ``dst``: every (src worker, dst worker) overlap.

    Together the pieces cover every (layer, KV head) exactly once per destination worker's share.
    Running time O(|src workers| * |dst workers|).
    """
    out = []
    for a in src.workers:
        for b in dst.workers:
            lo, hi = max(a.layers[0], b.layers[0]), min(a.layers[1], b.layers[1])
            h0, h1 = max(a.kv_heads[0], b.kv_heads[0]), min(a.kv_heads[1], b.kv_heads[1])
            if lo < hi and h0 < h1:
                out.append(KVTransfer(a.name, b.name, (lo, hi), (h0, h1)))
    return out
