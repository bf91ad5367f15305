"""The other end of the device-channel tests: a worker-like process ("a") that sends to the test ("b").

``payloads()`` makes the same tensors in both processes (seeded): activations of a decode and of a
prompt step in three dtypes, and KV pieces of a hand-off from a TP-2 prefill stage to the first
stage of a two-stage decode replica, read from a seeded pool as the worker's hand-off reads them.
"""

from __future__ import annotations

import time

import torch

from hetserve.runtime.layout import ReplicaSpec, WorkerSpec, kv_transfers
from hetserve.runtime.workers.auth import LinkSecurity
from hetserve.runtime.workers.channel_pairs import ChannelPeer
from hetserve.runtime.workers.device_channel import DeviceChannel
from hetserve.runtime.workers.kv_pool import KVPool, slots_of
from hetserve.runtime.workers.transport import Priority, SocketTransport
from hetserve.runtime.workers.wire import DTYPES, Message

HIDDEN, HEADS, HEAD_DIM, BLOCK = 64, 4, 8, 16
GROUP = "channel/test/a|b"


def _replica(rid: str, role: str, stages) -> ReplicaSpec:
    out = []
    for s, (names, layers) in enumerate(stages):
        t = len(names)
        out.append(tuple(WorkerSpec(n, rid, role, s, len(stages), layers, k, t, names[0], None,
                                    (k * HEADS // t, (k + 1) * HEADS // t), "cpu") for k, n in enumerate(names)))
    return ReplicaSpec(rid, role, tuple(out))


PREFILL = _replica("p", "prefill", [(("a", "x"), (0, 4))])  # TP 2: "a" holds KV heads 0-1
DECODE = _replica("d", "decode", [(("b",), (0, 3)), (("y", "z"), (3, 4))])  # "b" holds layers 0-2, every head


def payloads() -> list[tuple[str, dict, dict[str, torch.Tensor], Priority]]:
    """(kind, meta, tensors, priority) of every transfer the sender makes, the same in both processes."""
    g = torch.Generator().manual_seed(7)
    out = []
    for rows, dtype in ((1, "float32"), (37, "bfloat16"), (512, "float16")):
        h = torch.randn(rows, HIDDEN, generator=g).to(DTYPES[dtype])
        out.append(("step", {"rows": rows, "dtype": dtype}, {"hidden": h}, Priority.DECODE))
    (piece,) = [p for p in kv_transfers(PREFILL, DECODE) if p.src == "a" and p.dst == "b"]
    for tokens, dtype in ((37, "float32"), (1, "bfloat16")):
        pool = KVPool(4, 8 * BLOCK, 2, HEAD_DIM, DTYPES[dtype], "cpu")
        pool.k.copy_(torch.randn(pool.k.shape, generator=g))
        pool.v.copy_(torch.randn(pool.v.shape, generator=g))
        table = [5, 2, 7][: (tokens + BLOCK - 1) // BLOCK]
        kv = pool.read(slice(*piece.layers), slice(piece.heads[0], piece.heads[1]),
                       slots_of(table, tokens, BLOCK))
        meta = {"layers": piece.layers, "heads": piece.heads, "num_tokens": tokens, "dtype": dtype,
                "table": [1, 3, 0][: len(table)]}
        out.append(("kv", meta, {"kv": kv}, Priority.KV))
    return out


def expectations() -> dict:
    """What the receiver accepts for each kind, from the message's metadata (as a worker would)."""
    def step(m):
        return {"hidden": (DTYPES[m["dtype"]], (m["rows"], HIDDEN))}

    def kv(m):
        shape = (m["layers"][1] - m["layers"][0], 2, m["num_tokens"], m["heads"][1] - m["heads"][0], HEAD_DIM)
        return {"kv": (DTYPES[m["dtype"]], shape)}

    return {"step": step, "kv": kv}


def peer_main(secret: bytes, store_address, receiver_address, scenario: str, timeout_s: float) -> None:
    torch.set_num_threads(1)
    transport = SocketTransport("a", LinkSecurity(secret))
    transport.set_address("b", receiver_address)
    channel = DeviceChannel(transport, (ChannelPeer("b", "gloo", GROUP, 0),), "cpu", timeout_s=timeout_s)
    transport.send("b", Message("ready", {"address": list(transport.address)}))
    channel.connect(store_address, "127.0.0.1")
    if scenario == "payloads":
        for kind, meta, tensors, priority in payloads():
            channel.send("b", Message(kind, meta, tensors), priority)
        # a header that says 6 rows where its metadata says 5: refused, then sent by socket
        channel.send("b", Message("step", {"rows": 5, "dtype": "float32", "lie": True},
                                  {"hidden": torch.ones(6, HIDDEN)}), Priority.DECODE)
        deadline = time.monotonic() + timeout_s + 10
        while not channel.stats().get("failed") and time.monotonic() < deadline:
            time.sleep(0.01)
        channel.send("b", Message("step", {"rows": 2, "dtype": "float32", "after": True},
                                  {"hidden": torch.zeros(2, HIDDEN)}), Priority.DECODE)
        while (msg := transport.recv(timeout=60)) is not None and msg.kind != "shutdown":
            pass
        transport.send("b", Message("result", {"stats": channel.stats()}))
        transport.flush(5.0)
    elif scenario == "header_then_die":
        # the header of transfer 0 goes out, its bytes never do: the test kills this process meanwhile
        header = {"seq": 0, "tensors": [["hidden", "float32", [4, HIDDEN], 4 * HIDDEN * 4]]}
        transport.send("b", Message("step", {"rows": 4, "dtype": "float32", "dc": header}), Priority.CONTROL)
        time.sleep(120)
