"""How one replica is laid out on devices: the shape the cost model prices.

A ``ReplicaLayout`` is a pipeline of ``StageLayout``s; each stage is a TP group (device indices
into ``Cluster.devices``) holding a half-open layer range. Invariants (checked in
``__post_init__``): a stage has at least one device and one layer; a replica's stages are
contiguous from layer 0, and no device appears twice.
"""

from __future__ import annotations

from dataclasses import dataclass


def micro_batches_of(configured: int | None, stages: int) -> int:
    """Steps a pipeline of ``stages`` runs at once: the configured count, else one per stage (MoLink
    §4.3's N, which fills every stage once the batch has as many sequences)."""
    return configured or stages


@dataclass(frozen=True)
class StageLayout:
    devices: tuple[int, ...]  # device indices; TP degree = len(devices)
    layers: tuple[int, int]  # [start, end)

    def __post_init__(self) -> None:
        if not self.devices:
            raise ValueError("a stage needs at least one device")
        if not (0 <= self.layers[0] < self.layers[1]):
            raise ValueError(f"stage layers {self.layers} must be a non-empty half-open range")

    @property
    def tp(self) -> int:
        return len(self.devices)

    @property
    def num_layers(self) -> int:
        return self.layers[1] - self.layers[0]


@dataclass(frozen=True)
class ReplicaLayout:
    stages: tuple[StageLayout, ...]

    def __post_init__(self) -> None:
        if not self.stages:
            raise ValueError("a replica needs at least one stage")
        if self.stages[0].layers[0] != 0:
            raise ValueError("the first stage must start at layer 0")
        for a, b in zip(self.stages, self.stages[1:]):
            if a.layers[1] != b.layers[0]:
                raise ValueError(f"stages {a.layers} and {b.layers} leave a gap or overlap")
        flat = [d for s in self.stages for d in s.devices]
        if len(flat) != len(set(flat)):
            raise ValueError("a device appears twice in one replica")

    @property
    def num_layers(self) -> int:
        return self.stages[-1].layers[1]

    @property
    def devices(self) -> tuple[int, ...]:
        return tuple(d for s in self.stages for d in s.devices)

    def stage_of_layer(self, layer: int) -> StageLayout:
        for s in self.stages:
            if s.layers[0] <= layer < s.layers[1]:
                return s
        raise IndexError(layer)


# ----------------------------------------------------------------------------- KV hand-off pairing
# One rule for which prefill shard sends which layers and KV heads to which decode shard: the cost
# model prices it (``CostModel.kv_transfer_pairs``), the runtime moves it (``runtime.layout.kv_transfers``).


def kv_head_range(rank: int, tp: int, num_kv_heads: int) -> tuple[int, int]:
    """KV heads ``[lo, hi)`` that TP rank ``rank`` of a ``tp``-way stage holds."""
    return rank * num_kv_heads // tp, (rank + 1) * num_kv_heads // tp


def kv_pieces(src: list[tuple[tuple[int, int], int]], dst: list[tuple[tuple[int, int], int]],
              num_kv_heads: int) -> list[tuple[int, int, int, int, tuple[int, int], tuple[int, int]]]:
    """Pieces of a prefill -> decode KV hand-off between two pipelines given as ``[(layers, tp), ...]``
    per stage: ``(src stage, src rank, dst stage, dst rank, layers, heads)`` for every pair of shards
    holding a common layer range and KV-head range (layer-matched, re-sharded across TP degrees).
    Together the pieces cover every (layer, KV head) once per destination shard.
    Running time O(shards of src x shards of dst)."""
    out = []
    for si, ((a0, a1), tp_a) in enumerate(src):
        for di, ((b0, b1), tp_b) in enumerate(dst):
            lo, hi = max(a0, b0), min(a1, b1)
            if lo >= hi:
                continue
            for i in range(tp_a):
                ha = kv_head_range(i, tp_a, num_kv_heads)
                for k in range(tp_b):
                    hb = kv_head_range(k, tp_b, num_kv_heads)
                    h0, h1 = max(ha[0], hb[0]), min(ha[1], hb[1])
                    if h0 < h1:
                        out.append((si, i, di, k, (lo, hi), (h0, h1)))
    return out
