"""Transports without worker processes: the socket transport (tensors of every dtype, priority
classes, chunked and interleaved messages, shaping), the priority link scheduler and the
in-process hub. Split from ``test_runtime_units.py``, which keeps the model, KV, scheduling and
checkpoint units."""

from __future__ import annotations

import threading
import time
from collections import deque

import torch

from hetserve.runtime.workers.auth import LinkSecurity
from hetserve.runtime.workers.link_scheduling import Chunk, Outgoing, PriorityScheduler
from hetserve.runtime.workers.transport import InProcHub, Priority, SocketTransport
from hetserve.runtime.workers.wire import Message

SECURITY = LinkSecurity(b"s" * 32)  # both ends of every link in these tests hold it


def test_socket_transport_roundtrip_and_priority():
    a, b = SocketTransport("a", SECURITY), SocketTransport("b", SECURITY)
    try:
        a.set_address("b", b.address)
        tensors = {"f": torch.randn(3, 4), "h": torch.randn(5).to(torch.bfloat16), "i": torch.arange(7),
                   "empty": torch.zeros(0, 3)}
        a.send("b", Message("step", {"k": [1, 2], "t": (1, (2, "x")), 3: None}, tensors), Priority.KV)
        got = b.recv(timeout=5)
        assert got.kind == "step" and got.meta == {"k": [1, 2], "t": [1, [2, "x"]], 3: None} and got.src == "a"
        for k, t in tensors.items():
            assert got.tensors[k].dtype == t.dtype and torch.equal(got.tensors[k], t)
        assert a.flush(5)
    finally:
        a.close()
        b.close()


def test_priority_scheduler_sends_urgent_classes_first():
    s = PriorityScheduler()
    for i, p in enumerate([Priority.KV, Priority.PREFILL, Priority.DECODE, Priority.KV]):
        buf = memoryview(bytes([i]))
        s.push(Outgoing(i, int(p), [buf], 1, 0.0))
    assert [s.pop(0).msg_id for _ in range(4)] == [2, 1, 0, 3]
    assert s.pop(0.01) is None


class ChunkingRoundRobin:
    """A LinkScheduler cutting every message into 7-byte chunks, interleaving messages."""

    def __init__(self):
        self.queue, self.cv = deque(), threading.Condition()

    def push(self, item):
        data = b"".join(item.buffers)
        with self.cv:
            self.queue.append([item.msg_id, 0, data])
            self.cv.notify()

    def pop(self, timeout=None):
        with self.cv:
            if not self.cv.wait_for(lambda: bool(self.queue), timeout):
                return None
            entry = self.queue.popleft()
            msg_id, off, data = entry
            chunk = Chunk(msg_id, off, len(data), data[off:off + 7])
            entry[1] += 7
            if entry[1] < len(data):
                self.queue.append(entry)
            return chunk

    def pending_bytes(self):
        return 0


def test_chunked_interleaved_messages_are_reassembled():
    a = SocketTransport("a", SECURITY, scheduler_factory=lambda src, dst: ChunkingRoundRobin())
    b = SocketTransport("b", SECURITY)
    try:
        a.set_address("b", b.address)
        sent = [torch.arange(n, dtype=torch.float32) for n in (1, 50, 9)]
        for i, t in enumerate(sent):
            a.send("b", Message("step", {"i": i}, {"t": t}))
        got = {m.meta["i"]: m.tensors["t"] for m in (b.recv(timeout=5) for _ in sent)}
        for i, t in enumerate(sent):
            assert torch.equal(got[i], t)
    finally:
        a.close()
        b.close()


def test_shaper_delays_sends():
    class Slow:
        def delay(self, src, dst, nbytes):
            return 0.2

    a, b = SocketTransport("a", SECURITY, shaper=Slow()), SocketTransport("b", SECURITY)
    try:
        a.set_address("b", b.address)
        t0 = time.monotonic()
        a.send("b", Message("step"))
        assert b.recv(timeout=5) is not None and time.monotonic() - t0 >= 0.2
    finally:
        a.close()
        b.close()


def test_inproc_transport():
    hub = InProcHub()
    a, b = hub.endpoint("a"), hub.endpoint("b")
    a.send("b", Message("result", {"n": 1}, {"t": torch.ones(2)}), Priority.DECODE)
    m = b.recv(timeout=1)
    assert m.kind == "result" and m.src == "a" and torch.equal(m.tensors["t"], torch.ones(2))
    assert a.sent == [("b", "result", Priority.DECODE)]
    assert b.recv(timeout=0.01) is None


def test_a_hook_that_raises_loses_its_message_only_and_the_connection_reads_on():
    """A receiving hook's unexpected exception (a device error while a worker installs a KV piece)
    must not end the connection's reading thread: the peer's later messages still arrive."""
    a, b = SocketTransport("a", SECURITY), SocketTransport("b", SECURITY)
    seen = []

    def hook(msg):
        seen.append(msg.meta["n"])
        if msg.meta["n"] == 0:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        return False

    b.on_message = hook
    try:
        a.set_address("b", b.address)
        for n in range(3):
            a.send("b", Message("kv", {"n": n}), Priority.KV)
        got = [b.recv(timeout=5) for _ in range(2)]
        assert [m.meta["n"] for m in got if m is not None] == [1, 2] and seen == [0, 1, 2]
        assert not b.rejected  # nothing wrong with the peer or its bytes
    finally:
        a.close()
        b.close()
