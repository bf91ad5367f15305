"""The runtime's per-replica snapshot: the ``ReplicaState`` fields the simulator fills, from live state.

Built by the coordinator thread after every loop (``replica_snapshots``), published in
``Engine.stats()["replicas"][id]["state"]`` as plain numbers (they cross process boundaries with
the Ray backend), and turned back into ``ReplicaState`` for the policies by ``state_from_stats``.
Field by field, as the simulator's replicas define them (``hetserve.sim.replicas``):

* ``queued_requests`` — prefill-capable: requests placed on this replica and not admitted yet
  (with chunked prefill, also the admitted ones still prefilling, as the simulator counts them);
  decode: hand-offs routed here that wait for room or whose KV is on its way;
* ``running_requests`` — sequences holding KV here and stepping (a prefill replica: its prompts
  in flight);
* ``queued_prefill_tokens`` — prompt tokens of the queued requests (0 on a decode replica);
* ``outstanding_tokens`` — prompt tokens still to prefill here + output tokens still to generate
  (``max_tokens`` − generated: the runtime's prediction is the request's own limit);
* ``context_tokens`` — Σ (prompt + generated) over the running sequences of a decoding replica;
* ``kv_used_tokens`` / ``kv_capacity_tokens`` — the pool's blocks in tokens (a prefill replica's
  real pool, which /metrics shows; the simulator leaves it 0 and Aladdin then reads the cost
  model's pool — the same quantity).

Requests in the shared (unpinned) waiting queue belong to no replica yet and are counted by none.
Pure Python (no torch).
"""

from __future__ import annotations

from typing import Iterable, Mapping

from hetserve.policies.base import ReplicaState
from hetserve.runtime.scheduler import ReplicaScheduler
from hetserve.runtime.sequence import Sequence

FIELDS = ("queued_requests", "running_requests", "queued_prefill_tokens", "outstanding_tokens",
          "context_tokens", "kv_used_tokens", "kv_capacity_tokens")


def _left(seq: Sequence) -> int:
    return max(0, seq.params.max_tokens - len(seq.output))


def _to_prefill(seq: Sequence) -> int:
    return seq.prefill_tokens  # a re-run request re-prefills its output so far too


def replica_snapshots(schedulers: Mapping[str, ReplicaScheduler],
                      handoffs: Iterable[Sequence]) -> dict[str, dict[str, float]]:
    """Replica id -> the snapshot fields. ``handoffs``: sequences between a prefill replica and a
    decode replica (waiting for room or KV in flight), with ``dst`` set once routed."""
    inbound: dict[str, list[Sequence]] = {}
    parked: dict[str, list[Sequence]] = {}  # prefill done, KV still held on the prefill replica
    for seq in handoffs:
        if seq.dst is not None:
            inbound.setdefault(seq.dst, []).append(seq)
        if seq.replica is not None:
            parked.setdefault(seq.replica, []).append(seq)
    out = {}
    for rid, s in schedulers.items():
        # chunked prefill: admitted prompts still prefilling count as queued, as in the simulator
        chunking = list(s.prefilling)
        running = [q for q in list(s.ready) + [q for batch in s.inflight.values() for q in batch] if q not in chunking]
        block = s.blocks.block_size
        kv_used = s.blocks.num_used_blocks * block
        if s.role == "prefill":
            queued = list(s.pinned)
            qtok = sum(_to_prefill(q) for q in queued)
            out[rid] = {"queued_requests": len(queued), "running_requests": len(running),
                        "queued_prefill_tokens": qtok,
                        "outstanding_tokens": float(qtok + sum(_to_prefill(q) for q in running)),
                        "context_tokens": 0, "kv_used_tokens": kv_used,
                        "kv_capacity_tokens": s.blocks.capacity_tokens}
            continue
        if s.role == "colocated":
            qtok = sum(_to_prefill(q) for q in s.pinned)
            queued = list(s.pinned) + chunking
            outstanding = qtok + sum(_left(q) for q in queued)
        else:
            queued = inbound.get(rid, [])
            qtok = 0
            outstanding = sum(_left(q) for q in queued)
        outstanding += sum(_left(q) for q in running)
        out[rid] = {"queued_requests": len(queued), "running_requests": len(running),
                    "queued_prefill_tokens": qtok, "outstanding_tokens": float(outstanding),
                    "context_tokens": sum(len(q.prompt) + len(q.output) for q in running if not q.prefilling),
                    "kv_used_tokens": kv_used, "kv_capacity_tokens": s.blocks.capacity_tokens}
    return out


def state_from_stats(replica_id: str, stats: Mapping) -> ReplicaState:
    """The ``ReplicaState`` of one replica from ``Engine.stats()["replicas"][replica_id]``."""
    st = stats.get("state", {})
    return ReplicaState(replica_id, stats["role"], int(st.get("queued_requests", 0)),
                        int(st.get("running_requests", 0)), int(st.get("queued_prefill_tokens", 0)),
                        float(st.get("outstanding_tokens", 0.0)), int(st.get("context_tokens", 0)),
                        int(st.get("kv_used_tokens", 0)), int(st.get("kv_capacity_tokens", 0)),
                        alive=bool(stats.get("alive", True)), preemptions=int(stats.get("preemptions", 0)))
