"""The receiving side of KV hand-offs on a decode worker: pieces written into the pool on the
receiving thread, duplicates and abandoned hand-offs dropped, a piece that cannot be written
refused so its request re-runs.

Pieces of one hand-off arrive on one receiving thread per sender. A piece that comes twice (a
device channel resending what it had delivered) is dropped and counted: counted twice, it would
report a hand-off complete with a piece missing. Once the coordinator abandons a hand-off
(``kv_cancel``: its sender died or left the plan) none of its pieces writes any more, so its
blocks can go to another request: each piece is checked and written under one lock.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

import torch

from hetserve.runtime.workers.kv_pool import KVPool, slots_of
from hetserve.runtime.workers.transport import Priority
from hetserve.runtime.workers.wire import ENGINE, Message

log = logging.getLogger(__name__)
KV_DONE_KEPT = 4096  # hand-offs remembered as complete (or abandoned), to drop their pieces that come again
KV_NOT_INSTALLED = "KV piece not installed: hand-off"  # the log line's fixed words: a GPU check greps for them


class KVReceiver:
    """Installs the KV pieces sent to worker ``name`` (layers ``layers``, KV heads ``heads``, global
    ids, half-open) into ``pool``; ``written(slots)`` is told of every write (the step runner's
    mirrors of the pool); ``send(dst, msg, priority)`` reaches the coordinator."""

    def __init__(self, name: str, layers: tuple[int, int], heads: tuple[int, int], pool: KVPool, block_size: int,
                 send: Callable[..., None], written: Callable[[torch.Tensor], None], device: torch.device):
        self.name, self.layers, self.heads = name, layers, heads
        self.pool, self.block_size, self.send, self.written = pool, block_size, send, written
        self.received: dict[int, set[tuple]] = {}  # per hand-off, its pieces in so far: (sender, layers, heads)
        self.done: dict[int, None] = {}  # the latest hand-offs completed here, oldest first
        self.cancelled: dict[int, None] = {}  # the latest hand-offs the coordinator abandoned
        self.duplicates = 0  # pieces dropped as already received
        self.fenced = 0  # pieces of abandoned hand-offs that arrived after all and were dropped
        self._lock = threading.Lock()
        # on a GPU a piece is copied into the pool on its own stream: the copy need not wait for the
        # step in flight, and the receiving thread waits for its own copy only (never the device)
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def on_piece(self, msg: Message) -> None:
        """A ``kv`` message: installed, or refused (the receiving thread must live on for later pieces)."""
        try:
            self.install(msg)
        except Exception as exc:  # noqa: BLE001 - any failure to write is a refusal, not the thread's end
            self.refuse(msg, exc)

    def install(self, msg: Message) -> None:
        """Write a received piece into the pool; tell the coordinator ``kv_ready`` once the hand-off's
        pieces for this worker are all in."""
        m = msg.meta
        seq, piece = m["seq"], (msg.src, tuple(m["layers"]), tuple(m["heads"]))
        layers = slice(m["layers"][0] - self.layers[0], m["layers"][1] - self.layers[0])
        heads = slice(m["heads"][0] - self.heads[0], m["heads"][1] - self.heads[0])
        with self._lock:
            if seq in self.cancelled:
                self.fenced += 1
                return
            if seq in self.done or piece in self.received.get(seq, ()):
                self.duplicates += 1
                return
            slots = slots_of(m["table"], m["num_tokens"], self.block_size)
            if self.stream is None:
                self.pool.write(layers, heads, slots, msg.tensors["kv"])
            else:
                kv = msg.tensors["kv"]
                if kv.is_cuda:  # a device channel's piece: after what this thread's stream waits for (its
                    # receive or IPC copy); a piece from the host (socket, gloo) waits for nothing here
                    self.stream.wait_stream(torch.cuda.current_stream(self.device))
                # the stream's temporaries are freed only after the wait below
                with torch.cuda.stream(self.stream):
                    self.pool.write(layers, heads, slots, msg.tensors["kv"])
                self.stream.synchronize()  # the bytes are in place before the coordinator hears so
            self.written(slots)
            got = self.received.setdefault(seq, set())
            got.add(piece)
            complete = len(got) == m["expect"]
            if complete:
                self.received.pop(seq)
                _remember(self.done, seq)
        if complete:
            self.send(ENGINE, Message("kv_ready", {"seq": seq, "worker": self.name}))

    def refuse(self, msg: Message, exc: Exception) -> None:
        """A piece that could not be written (a device error, a malformed table): the coordinator
        re-runs its request from the prompt and fences the hand-off's blocks, as for a sender's
        refusal; its other pieces are dropped when they come (``kv_cancel``)."""
        seq = msg.meta.get("seq")
        log.warning("%s: %s %s from %s (%s: %s); refused, its request re-runs", self.name, KV_NOT_INSTALLED,
                    seq, msg.src, type(exc).__name__, exc)
        if type(seq) is not int:
            return  # no hand-off of the coordinator's: nothing to re-run
        try:
            self.send(ENGINE, Message("kv_refused", {"seq": seq, "worker": self.name,
                                                     "reason": f"{KV_NOT_INSTALLED}: {exc}"[:500]}))
        except ConnectionError:
            pass  # this endpoint is closing

    def cancel(self, seq: int) -> None:
        """The coordinator abandoned hand-off ``seq`` and will give its blocks to other requests once
        every receiver says so: from here on its pieces still on their way (a dead sender's socket
        may deliver after it is gone) are dropped, not written."""
        with self._lock:
            self.received.pop(seq, None)
            _remember(self.cancelled, seq)
        self.send(ENGINE, Message("kv_cancelled", {"seq": seq, "worker": self.name}), Priority.CONTROL)


def _remember(seen: dict[int, None], seq: int) -> None:
    """Add hand-off ``seq`` to ``seen``, forgetting the oldest past ``KV_DONE_KEPT``."""
    seen[seq] = None
    if len(seen) > KV_DONE_KEPT:
        del seen[next(iter(seen))]
