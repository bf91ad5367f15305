"""Which workers share a device channel (device_channel.py moves the bytes), and of which kind.

Each stage leader pairs with the next stage's leader, and each prefill worker with the decode
workers it hands KV pieces to; a pair's kind (one of ``CHANNEL_KINDS``) follows its two devices,
and a CPU and a GPU share none (they keep the socket).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from hetserve.specs.cluster import machine_of

CHANNEL_KINDS = ("gloo", "nccl", "ipc")


@dataclass(frozen=True)
class ChannelPeer:
    """One end of a pair's channel, as the engine hands it to a worker."""

    peer: str  # the other worker's endpoint name
    kind: str  # one of CHANNEL_KINDS
    group: str  # the pair's key prefix in the rendezvous store (unused by ipc)
    rank: int  # this worker's rank in the pair's group: 0 for the lower name


def channel_pairs(layout, tag: str = "0", shaped: bool = False) -> dict[str, tuple[ChannelPeer, ...]]:
    """Per worker, the channels it shares: each stage leader with the next one, and each prefill worker
    with the decode workers it hands KV pieces to. None when links are emulated (``shaped``).

    ``tag`` keeps the store keys of one start-up round apart from another's (an elastic re-plan may
    reuse worker names). Pairs of a CPU and a GPU use the socket; GPUs of different machines, NCCL.
    """
    from hetserve.runtime.layout import kv_transfers

    if shaped:
        return {}
    pairs: set[tuple[str, str]] = set()
    for r in layout:
        pairs.update((a[0].name, b[0].name) for a, b in zip(r.stages, r.stages[1:]))
    for src in layout:
        for dst in layout:
            if src.role == "prefill" and dst.serves_decode:
                pairs.update((p.src, p.dst) for p in kv_transfers(src, dst))
    devices = {w.name: w.device for r in layout for w in r.workers}
    out: dict[str, list[ChannelPeer]] = collections.defaultdict(list)
    for a, b in sorted(tuple(sorted(p)) for p in pairs):
        kind = _kind(a, devices[a], b, devices[b])
        if kind:
            group = f"channel/{tag}/{a}|{b}"
            out[a].append(ChannelPeer(b, kind, group, 0))
            out[b].append(ChannelPeer(a, kind, group, 1))
    return {name: tuple(peers) for name, peers in out.items()}


def _kind(a: str, dev_a: str, b: str, dev_b: str) -> str:
    if dev_a == "cpu" and dev_b == "cpu":
        return "gloo"
    if dev_a.startswith("cuda") and dev_b.startswith("cuda"):
        if machine_of(a) != machine_of(b):
            return "nccl"  # GPUs of different machines: NCCL over the network
        return "ipc" if dev_a == dev_b else "nccl"
    return ""
