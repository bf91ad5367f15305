"""Moving messages (metadata + tensors) between runtime endpoints, with a priority class per message.

One small interface, ``Transport``:

    send(peer, message, priority)   queue a message for a named peer; returns at once
    recv(timeout) -> Message | None the next message that arrived for this endpoint
    on_message                      optional hook run on the receiving thread (True: consumed)
    post(message)                   put a message into this endpoint's own inbox (wake-ups)
    address / set_address(peer, address) / close()

Two implementations: ``SocketTransport`` (TCP on one bound address, one connection per ordered pair of
endpoints, used between processes) and ``InProcTransport`` (queues inside one process, for tests of
coordinator logic without processes).

The send path is where the serving layer plugs in transmission scheduling and link shaping,
without the engine changing:

    send() -> encode (a snapshot of the tensors) -> LinkScheduler.push(Outgoing)   [per peer]
    sender thread: chunk = LinkScheduler.pop(); LinkShaper.delay(src, dst, len(chunk)); write(chunk)

A ``LinkScheduler`` decides which queued message's bytes go next on one link and may cut messages
into chunks (MoLink-style decode-first with chunked prefill/KV traffic); the wire format carries
``(message id, offset, total)`` per chunk and the receiver reassembles, so chunks of different
messages may interleave. The default ``PriorityScheduler`` sends whole messages, highest priority
class first, FIFO within a class. Messages of one class between one pair arrive in send order; the
engine relies on nothing stronger.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import pickle
import queue
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Callable, Protocol

import torch


class Priority(IntEnum):
    """Priority classes, most urgent first (smaller value = sent earlier)."""

    CONTROL = 0  # start-up, shutdown, acknowledgements, results
    DECODE = 1  # activations of decode-only steps: on the critical path of every output token
    PREFILL = 2  # activations of steps that contain prompt processing
    KV = 3  # KV-cache hand-off from a prefill replica to a decode replica


@dataclass
class Message:
    kind: str
    meta: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    src: str = ""  # filled in by the transport on send


# ----------------------------------------------------------------------------- encoding


def encode(msg: Message) -> list[memoryview]:
    """Message -> buffers [header, tensor bytes...]; tensors are copied, so the caller may reuse them."""
    specs, bufs = [], []
    for name, t in msg.tensors.items():
        t = t.detach().to("cpu", copy=True).contiguous()
        specs.append((name, str(t.dtype).removeprefix("torch."), tuple(t.shape), t.numel() * t.element_size()))
        bufs.append(memoryview(t.view(torch.uint8).reshape(-1).numpy()) if t.numel() else memoryview(b""))
    header = pickle.dumps((msg.kind, msg.meta, msg.src, specs), protocol=pickle.HIGHEST_PROTOCOL)
    return [memoryview(struct.pack(">I", len(header)) + header)] + bufs


def decode(payload: bytearray) -> Message:
    (hlen,) = struct.unpack_from(">I", payload, 0)
    kind, meta, src, specs = pickle.loads(memoryview(payload)[4:4 + hlen])
    offset, tensors = 4 + hlen, {}
    for name, dtype, shape, nbytes in specs:
        dt = getattr(torch, dtype)
        if nbytes:
            raw = torch.frombuffer(payload, dtype=torch.uint8, count=nbytes, offset=offset)
            tensors[name] = raw.view(dt).reshape(shape)
        else:
            tensors[name] = torch.empty(shape, dtype=dt)
        offset += nbytes
    return Message(kind, meta, tensors, src)


# ----------------------------------------------------------------------------- scheduling hooks


@dataclass
class Outgoing:
    """One encoded message waiting for a link."""

    msg_id: int
    priority: int
    buffers: list[memoryview]
    nbytes: int
    enqueued_at: float


@dataclass
class Chunk:
    msg_id: int
    offset: int  # byte offset of ``data`` inside the message
    total: int  # message size in bytes
    data: bytes | memoryview


class LinkScheduler(Protocol):
    """Orders what goes on one link (one ordered pair of endpoints). Thread-safe."""

    def push(self, item: Outgoing) -> None: ...

    def pop(self, timeout: float | None = None) -> Chunk | None:
        """Next chunk to write, blocking up to ``timeout`` seconds; None if nothing is queued."""

    def pending_bytes(self) -> int: ...


class LinkShaper(Protocol):
    """Emulates a link: seconds to wait before ``nbytes`` go from ``src`` to ``dst`` (e.g. α + n/β)."""

    def delay(self, src: str, dst: str, nbytes: int) -> float: ...


class PriorityScheduler:
    """Whole messages, most urgent class first, FIFO within a class."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, Outgoing]] = []
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._bytes = 0

    def push(self, item: Outgoing) -> None:
        with self._cv:
            heapq.heappush(self._heap, (item.priority, next(self._seq), item))
            self._bytes += item.nbytes
            self._cv.notify()

    def pop(self, timeout: float | None = None) -> Chunk | None:
        with self._cv:
            if not self._heap and not self._cv.wait_for(lambda: bool(self._heap), timeout):
                return None
            _, _, item = heapq.heappop(self._heap)
            self._bytes -= item.nbytes
        data = b"".join(item.buffers) if len(item.buffers) > 1 else item.buffers[0]
        return Chunk(item.msg_id, 0, item.nbytes, data)

    def pending_bytes(self) -> int:
        return self._bytes


# ----------------------------------------------------------------------------- interface


class Transport:
    """Base: named endpoint with an inbox. Subclasses implement ``send``."""

    def __init__(self, name: str):
        self.name = name
        self._inbox: queue.Queue[Message] = queue.Queue()
        self.closed = False
        # optional hook run on the receiving thread; returning True consumes the message (no inbox hop)
        self.on_message: Callable[[Message], bool] | None = None

    def _deliver(self, msg: Message) -> None:
        if self.on_message is None or not self.on_message(msg):
            self._inbox.put(msg)

    @property
    def address(self) -> Any:
        raise NotImplementedError

    def set_address(self, peer: str, address: Any) -> None:
        raise NotImplementedError

    def send(self, peer: str, msg: Message, priority: Priority = Priority.CONTROL) -> None:
        raise NotImplementedError

    def recv(self, timeout: float | None = None) -> Message | None:
        try:
            return self._inbox.get(timeout=timeout)
        except queue.Empty:
            return None

    def post(self, msg: Message) -> None:
        msg.src = msg.src or self.name
        self._inbox.put(msg)

    def close(self) -> None:
        self.closed = True


# ----------------------------------------------------------------------------- in-process


class InProcHub:
    """Registry of in-process endpoints (one per test)."""

    def __init__(self) -> None:
        self.endpoints: dict[str, InProcTransport] = {}

    def endpoint(self, name: str) -> "InProcTransport":
        ep = InProcTransport(name, self)
        self.endpoints[name] = ep
        return ep


class InProcTransport(Transport):
    """Delivers to another endpoint of the same hub at once, through the same encode/decode as sockets."""

    def __init__(self, name: str, hub: InProcHub):
        super().__init__(name)
        self.hub = hub
        self.sent: list[tuple[str, str, Priority]] = []  # (peer, kind, priority), for tests

    @property
    def address(self) -> str:
        return self.name

    def set_address(self, peer: str, address: Any) -> None:
        pass

    def send(self, peer: str, msg: Message, priority: Priority = Priority.CONTROL) -> None:
        msg.src = self.name
        self.sent.append((peer, msg.kind, priority))
        payload = bytearray(b"".join(encode(msg)))
        self.hub.endpoints[peer]._deliver(decode(payload))


# ----------------------------------------------------------------------------- sockets

_CHUNK_HEADER = struct.Struct(">QQQI")  # msg_id, offset, total, chunk length
_HELLO = struct.Struct(">H")


class SocketTransport(Transport):
    """TCP endpoint on ``host`` (default 127.0.0.1; one address, never all interfaces), port chosen by the OS.

    Threads: one acceptor, one reader per incoming connection, one sender per peer this endpoint
    sends to. ``scheduler_factory(src, dst)`` makes the ``LinkScheduler`` of each outgoing link;
    ``shaper`` (optional) delays each chunk.
    """

    def __init__(self, name: str, host: str = "127.0.0.1",
                 scheduler_factory: Callable[[str, str], LinkScheduler] | None = None,
                 shaper: LinkShaper | None = None):
        from hetserve.runtime.rendezvous import check_bind_address, listen_socket

        super().__init__(name)
        self._listener = listen_socket(check_bind_address(host, f"endpoint {name}'s bind address"))
        self._host = host
        self._addresses: dict[str, tuple[str, int]] = {}
        self._links: dict[str, LinkScheduler] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._scheduler_factory = scheduler_factory or (lambda src, dst: PriorityScheduler())
        self.shaper = shaper
        self._threads: list[threading.Thread] = []
        self._socks: list[socket.socket] = []
        self._unsent = 0  # messages pushed and not yet fully written
        self._unsent_cv = threading.Condition()
        self._spawn(self._accept_loop, f"{name}-accept")

    @property
    def address(self) -> tuple[str, int]:
        return self._listener.getsockname()[:2]

    def set_address(self, peer: str, address: tuple[str, int]) -> None:
        self._addresses[peer] = tuple(address)

    def send(self, peer: str, msg: Message, priority: Priority = Priority.CONTROL) -> None:
        if self.closed:
            raise ConnectionError(f"transport {self.name} is closed")
        msg.src = self.name
        buffers = encode(msg)
        item = Outgoing(next(self._ids), int(priority), buffers, sum(b.nbytes for b in buffers), time.monotonic())
        link = self._link(peer)
        with self._unsent_cv:
            self._unsent += 1
        link.push(item)

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every message sent so far is written to its socket; False on timeout."""
        with self._unsent_cv:
            return self._unsent_cv.wait_for(lambda: self._unsent == 0, timeout)

    def pending_bytes(self, peer: str) -> int:
        link = self._links.get(peer)
        return link.pending_bytes() if link else 0

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self._listener.close()
        except OSError:
            pass
        for s in list(self._socks):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    # ------------------------------------------------------------------ internals
    def _spawn(self, target, name, *args) -> None:
        t = threading.Thread(target=target, args=args, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    def _link(self, peer: str) -> LinkScheduler:
        with self._lock:
            link = self._links.get(peer)
            if link is None:
                if peer not in self._addresses:
                    raise ConnectionError(f"{self.name}: no address known for peer {peer!r}")
                link = self._links[peer] = self._scheduler_factory(self.name, peer)
                self._spawn(self._send_loop, f"{self.name}->{peer}", peer, link)
            return link

    def _send_loop(self, peer: str, link: LinkScheduler) -> None:
        try:
            sock = socket.create_connection(self._addresses[peer], timeout=10)
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._socks.append(sock)
            name = self.name.encode()
            sock.sendall(_HELLO.pack(len(name)) + name)
            while not self.closed:
                chunk = link.pop(timeout=0.5)
                if chunk is None:
                    continue
                if self.shaper is not None:
                    wait = self.shaper.delay(self.name, peer, len(chunk.data))
                    if wait > 0:
                        time.sleep(wait)
                sock.sendall(_CHUNK_HEADER.pack(chunk.msg_id, chunk.offset, chunk.total, len(chunk.data)))
                sock.sendall(chunk.data)
                if chunk.offset + len(chunk.data) == chunk.total:
                    with self._unsent_cv:
                        self._unsent -= 1
                        self._unsent_cv.notify_all()
        except OSError as exc:
            if not self.closed:
                self.post(Message("link_error", {"peer": peer, "error": repr(exc)}))

    def _accept_loop(self) -> None:
        while not self.closed:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._socks.append(sock)
            self._spawn(self._read_loop, f"{self.name}-read", sock)

    def _read_loop(self, sock: socket.socket) -> None:
        partial: dict[int, bytearray] = {}
        received: dict[int, int] = collections.defaultdict(int)
        try:
            (n,) = _HELLO.unpack(_read_exact(sock, _HELLO.size))
            _read_exact(sock, n)  # peer name; messages carry their own src
            while True:
                msg_id, offset, total, length = _CHUNK_HEADER.unpack(_read_exact(sock, _CHUNK_HEADER.size))
                buf = partial.get(msg_id)
                if buf is None:
                    buf = partial[msg_id] = bytearray(total)
                _read_into(sock, memoryview(buf)[offset:offset + length])
                received[msg_id] += length
                if received[msg_id] == total:
                    del partial[msg_id], received[msg_id]
                    self._deliver(decode(buf))
        except (OSError, EOFError):
            return


def _read_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _read_into(sock, memoryview(buf))
    return bytes(buf)


def _read_into(sock: socket.socket, view: memoryview) -> None:
    while view.nbytes:
        got = sock.recv_into(view)
        if not got:
            raise EOFError("connection closed")
        view = view[got:]
