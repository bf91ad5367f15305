"""What the cost model prices on the links between replicas and stages: a prefill replica's KV
hand-off to a decode replica, and the bytes KV and PP hand-offs put on the cluster's shared
resources (NICs, site pipes) for the planner's capacity nodes.

The KV moves layer-matched and TP-shard-matched (``cost.layout.kv_pieces``, the pieces the runtime
moves too): all device pairs send at once, sharing the NICs and pipes on their paths (max-min
fair, ``cost.network``), and the last part delivered ends the hand-off (HexGen-2 §3.2, Appendix A,
with docs/design.md's shared links). ``TransferCosts`` is a part of ``cost.analytic.CostModel``: it
reads the model, the cluster and ``p2p_time`` from it.
"""

from __future__ import annotations

from hetserve.cost.layout import ReplicaLayout, kv_pieces
from hetserve.cost.network import concurrent_time


class TransferCosts:
    """The KV hand-off and shared-resource methods of ``CostModel``."""

    def kv_transfer_pairs(self, src: ReplicaLayout, dst: ReplicaLayout, tokens: float):
        """Yield (src device, dst device, bytes) for moving ``tokens`` tokens of KV.

        The pieces are ``cost.layout.kv_pieces`` (the runtime moves the same ones): layers [a, b)
        held by a prefill stage go to the decode stage(s) holding them; within a layer range, the
        prefill TP shard holding KV heads [h0, h1) sends to every decode shard it overlaps, the bytes
        scaled by the heads they share.
        """
        m = self.model
        per_head_layer = tokens * m.kv_bytes_per_token_per_layer / m.num_kv_heads
        pieces = kv_pieces([(s.layers, s.tp) for s in src.stages], [(s.layers, s.tp) for s in dst.stages],
                           m.num_kv_heads)
        for si, i, di, k, (lo, hi), (h0, h1) in pieces:
            yield src.stages[si].devices[i], dst.stages[di].devices[k], (hi - lo) * (h1 - h0) * per_head_layer

    def _kv_per_pair(self, src: ReplicaLayout, dst: ReplicaLayout, tokens: float) -> dict[tuple[int, int], float]:
        per_pair: dict[tuple[int, int], float] = {}
        for d, e, nbytes in self.kv_transfer_pairs(src, dst, tokens):
            if d != e:
                per_pair[(d, e)] = per_pair.get((d, e), 0.0) + nbytes
        return per_pair

    def kv_transfer_time(self, src: ReplicaLayout, dst: ReplicaLayout, tokens: float) -> float:
        """All device pairs send at once, sharing the NICs / pipes on their paths (max-min
        fair, ``cost.network``); the last part delivered finishes the hand-off. Never less than
        the slowest pair alone (``kv_transfer_time_uncontended``, the old per-pair formula)."""
        transfers = self.kv_transfers(src, dst, tokens)
        return concurrent_time(transfers) if transfers else 0.0

    def kv_transfers(self, src: ReplicaLayout, dst: ReplicaLayout, tokens: float) -> list:
        """``(Path, bytes)`` of every device pair of the hand-off: what ``kv_transfer_time`` prices
        (the planner memoises it by the transfers' shape, ``PlanContext.kv_capacity``)."""
        path = self.cluster.path
        return [(path(d, e), b) for (d, e), b in self._kv_per_pair(src, dst, tokens).items()]

    def kv_transfer_time_uncontended(self, src: ReplicaLayout, dst: ReplicaLayout, tokens: float) -> float:
        """The per-pair lower bound: every pair as if alone on its own link."""
        return max((self.p2p_time(d, e, b) for (d, e), b in self._kv_per_pair(src, dst, tokens).items()),
                   default=0.0)

    def kv_resource_bytes(self, src: ReplicaLayout, dst: ReplicaLayout, tokens: float) -> dict:
        """Bytes one request's KV (``tokens`` tokens) puts on each shared resource (NIC, pipe,
        dedicated link) going from ``src`` to ``dst``: {Resource: bytes}."""
        out: dict = {}
        for (d, e), b in self._kv_per_pair(src, dst, tokens).items():
            for r in self.cluster.path(d, e).resources:
                if r.shared:
                    out[r] = out.get(r, 0.0) + b
        return out

    def pp_resource_bytes(self, layout: ReplicaLayout, tokens: float) -> dict:
        """Bytes ``tokens`` tokens of activations put on each shared resource when they cross
        the replica's stage boundaries (over the fastest pair, as ``pp_handoff_time``), plus TP
        all-reduces of stages that span machines: {Resource: bytes}."""
        m = self.model
        act = tokens * m.hidden * m.dtype_bytes
        out: dict = {}
        for a, b in zip(layout.stages, layout.stages[1:]):
            d, e = min(((d, e) for d in a.devices for e in b.devices), key=lambda p: self.p2p_time(*p, act))
            if d != e:
                for r in self.cluster.path(d, e).resources:
                    if r.shared:
                        out[r] = out.get(r, 0.0) + act
        for s in layout.stages:
            if len({self.cluster.devices[d].machine for d in s.devices}) > 1:
                # two all-reduces per layer, each two supersteps of chunks to every other member
                chunk = act / s.tp
                for d in s.devices:
                    for e in s.devices:
                        if d != e:
                            for r in self.cluster.path(d, e).resources:
                                if r.shared:
                                    out[r] = out.get(r, 0.0) + 4 * s.num_layers * chunk
        return out
