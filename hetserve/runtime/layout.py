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

from hetserve.cost.layout import kv_pieces
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
    """Pieces of a hand-off from ``src`` to ``dst``: every (src worker, dst worker) overlap, as the
    cost model prices them (``hetserve.cost.layout.kv_pieces``: one pairing rule for both).

    Together the pieces cover every (layer, KV head) exactly once per destination worker's share.
    Running time O(|src workers| * |dst workers|).
    """
    heads = max(w.kv_heads[1] for w in src.workers)  # the last rank holds the last head
    pieces = kv_pieces([(s[0].layers, len(s)) for s in src.stages], [(s[0].layers, len(s)) for s in dst.stages],
                       heads)
    return [KVTransfer(src.stages[si][i].name, dst.stages[di][k].name, layers, hs)
            for si, i, di, k, layers, hs in pieces]
