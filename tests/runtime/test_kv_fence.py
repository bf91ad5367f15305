"""An abandoned KV hand-off cannot write into blocks another request has been given.

When a hand-off's sender dies (or leaves the plan) while its decode replica lives, pieces the
sender already wrote to its sockets may still arrive. The coordinator keeps the hand-off's blocks
taken until every receiving worker confirms that it drops the hand-off's pieces from then on
(``kv_cancel`` -> ``kv_cancelled``); the workers check and write each piece under one lock, so no
piece lands after the confirmation. Tested on the real receiver (``workers/kv_receiver.py``) with stand-ins for what it talks
to; ``test_channel_engine`` kills senders mid-hand-off on the real engine.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import torch

from hetserve.runtime.kv_cache import BlockManager
from hetserve.runtime.recovery import Recovery
from hetserve.runtime.workers.kv_pool import KVPool
from hetserve.runtime.workers.kv_receiver import KVReceiver
from hetserve.runtime.workers.wire import ENGINE, Message
from hetserve.runtime.workers.worker import Worker

BLOCK = 4


class Sent(list):
    def send(self, dst, msg, priority=None):
        self.append((dst, msg.kind, dict(msg.meta)))


def _receiver() -> KVReceiver:
    """A decode worker's receiver for layers 0-2 and KV heads 0-1, its pool zeroed; what it sends to
    the coordinator is kept in ``.sent``."""
    sent = Sent()
    r = KVReceiver("m0:1", (0, 2), (0, 1), KVPool(2, 8 * BLOCK, 1, 4, torch.float32, "cpu"), BLOCK, sent.send,
                   lambda slots: None, torch.device("cpu"))  # no step runs here: nothing mirrors the pool
    r.sent = sent
    return r


def _worker(receiver: KVReceiver) -> Worker:
    """A worker as its receiving thread sees it: only the dispatch of messages is under test."""
    w = Worker.__new__(Worker)
    w.kv, w.spec = receiver, SimpleNamespace(name=receiver.name)
    return w


def _piece(transfer: int, table: list[int], value: float, src: str = "m0:0") -> Message:
    msg = Message("kv", {"seq": transfer, "layers": [0, 2], "heads": [0, 1], "table": table, "num_tokens": 3,
                         "expect": 1}, {"kv": torch.full((2, 2, 3, 1, 4), value)})
    msg.src = src
    return msg


def test_a_cancelled_handoffs_late_piece_is_dropped_and_the_next_owner_keeps_its_blocks():
    w = _receiver()
    assert _worker(w)._on_message(Message("kv_cancel", {"seq": 7}, src=ENGINE)) is True
    assert w.sent == [(ENGINE, "kv_cancelled", {"seq": 7, "worker": "m0:1"})]
    w.install(_piece(8, [2], 1.0))  # the blocks' next owner
    w.install(_piece(7, [2], 9.0))  # the abandoned hand-off's piece, arriving after all
    assert w.fenced == 1 and w.duplicates == 0
    assert torch.all(w.pool.read(slice(0, 2), slice(0, 1), torch.arange(2 * BLOCK, 2 * BLOCK + 3)) == 1.0)
    assert [k for _, k, _ in w.sent] == ["kv_cancelled", "kv_ready"]  # only hand-off 8 completes


def test_only_the_coordinator_cancels_a_handoff():
    w = _receiver()
    _worker(w)._on_message(Message("kv_cancel", {"seq": 7}, src="m0:2"))
    w.install(_piece(7, [2], 9.0))
    assert w.fenced == 0 and [k for _, k, _ in w.sent] == ["kv_ready"]


def _coordinator():
    """The state ``Recovery`` reads: one live decode replica d0 of two workers, 8 blocks."""
    blocks = BlockManager(8, BLOCK)
    loop = SimpleNamespace(
        schedulers={"d0": SimpleNamespace(alive=True, blocks=blocks)},
        replicas={"d0": SimpleNamespace(workers=[SimpleNamespace(name="m0:2"), SimpleNamespace(name="m0:3")])},
        fenced={}, fences_opened=0, transport=Sent())
    for name in ("_fence", "_on_kv_cancelled"):
        setattr(loop, name, getattr(Recovery, name).__get__(loop))
    return loop, blocks


def test_abandoned_blocks_stay_taken_until_every_receiver_confirms():
    loop, blocks = _coordinator()
    table = blocks.allocate(2 * BLOCK)
    free = blocks.num_free_blocks
    loop._fence(SimpleNamespace(dst="d0", dst_table=table, transfer=5))
    assert sorted(dst for dst, kind, meta in loop.transport if kind == "kv_cancel" and meta == {"seq": 5}) == [
        "m0:2", "m0:3"]
    loop._on_kv_cancelled(5, "m0:2")
    assert blocks.num_free_blocks == free  # one receiver may still write a late piece
    loop._on_kv_cancelled(5, "m0:3")
    assert blocks.num_free_blocks == free + 2 and not loop.fenced
    loop._on_kv_cancelled(5, "m0:3")  # a repeat changes nothing
    assert blocks.num_free_blocks == free + 2


def test_a_piece_that_cannot_be_written_is_refused_so_its_request_reruns_and_later_pieces_install():
    """A device error while a piece is written (a CUDA call failing on the receiving thread) must
    not end that thread: the piece's hand-off is refused (the coordinator re-runs the request and
    fences its blocks) and the sender's next pieces are still written."""
    w = _receiver()
    real = w.pool.write
    w.pool.write = lambda *a: (_ for _ in ()).throw(RuntimeError("CUDA error: an illegal memory access"))
    assert _worker(w)._on_message(_piece(7, [2], 9.0)) is True
    refused = [(dst, meta) for dst, kind, meta in w.sent if kind == "kv_refused"]
    assert [(dst, meta["seq"], meta["worker"]) for dst, meta in refused] == [(ENGINE, 7, "m0:1")]
    assert "KV piece not installed" in refused[0][1]["reason"] and 7 not in w.received
    w.pool.write = real
    _worker(w)._on_message(_piece(8, [3], 1.0))
    assert [k for _, k, _ in w.sent] == ["kv_refused", "kv_ready"]


def test_a_piece_on_a_gpu_is_written_on_the_install_stream_and_waits_for_it_not_the_device(monkeypatch):
    """A device-wide synchronize on a receiving thread waits for the step in flight and breaks a
    CUDA graph another thread captures; the install waits for its own stream only. A piece already
    on the device first waits for what the receiving thread's stream waits for (its receive); a
    piece from the host waits for nothing (not the step in flight on that shared stream)."""
    w = _receiver()
    events = []

    class Stream:
        def synchronize(self):
            events.append("stream synchronized")

        def wait_stream(self, other):
            events.append(f"after {other}")

    @contextlib.contextmanager
    def on(stream):
        events.append("on install stream" if isinstance(stream, Stream) else "on another stream")
        yield
        events.append("off")

    real = w.pool.write
    w.pool.write = lambda *a: (events.append("write"), real(*a))
    w.stream = Stream()  # the GPU's install stream; the pool stays a CPU one
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: events.append("DEVICE synchronized"))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "the receiving thread's stream")
    w.install(_piece(8, [2], 1.0))  # from the host (socket, gloo): nothing on the device to wait for
    assert events == ["on install stream", "write", "off", "stream synchronized"]
    events.clear()

    class OnDevice(torch.Tensor):  # a device channel's piece, as the receiver sees it
        is_cuda = True
    piece = _piece(9, [3], 2.0)
    piece.tensors["kv"] = piece.tensors["kv"].as_subclass(OnDevice)
    w.install(piece)
    assert events == ["after the receiving thread's stream", "on install stream", "write", "off", "stream synchronized"]
    assert [k for _, k, _ in w.sent] == ["kv_ready", "kv_ready"]
