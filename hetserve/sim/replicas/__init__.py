"""Simulated replicas: they hold state; the policies decide; the cost model prices.

* ``PrefillReplica`` (``prefill.py``) — FIFO prompts batched to a token budget and the KV left;
  pipeline stages overlap; it keeps each prompt's KV until the decode side pulled it.
* ``DecodeReplica`` (``decode.py``) — admits finished prefills when their KV fits, pulls the KV over
  the links, runs them with continuous batching (``DecodeBatch``).
* ``ColocatedReplica`` (``colocated.py``) — prefill and decode on one replica.
* ``Decoding`` (``decoding.py``) — the continuous batching both share; KV admission is a strategy
  object (``kv.py``: ``ReserveKV`` / ``PagedKV``).

Replicas see the simulation only through ``hetserve.sim.env.ReplicaEnv``. Times come only from the
cost model: ``stage_prefill_time`` / ``prefill_time`` for prompts, ``decode_step_time`` for decode
iterations, ``kv_transfer_pairs`` + links for KV.
"""

from hetserve.sim.replicas.base import Replica
from hetserve.sim.replicas.colocated import ColocatedReplica
from hetserve.sim.replicas.decode import DecodeReplica
from hetserve.sim.replicas.decoding import Decoding
from hetserve.sim.replicas.kv import PagedKV, ReserveKV
from hetserve.sim.replicas.prefill import PrefillReplica

__all__ = ["Replica", "PrefillReplica", "DecodeReplica", "ColocatedReplica", "Decoding", "ReserveKV", "PagedKV"]
