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
class first, FIFO within a class (the hooks: ``link_scheduling.py``). Messages of one class between one pair arrive in send order; the
engine relies on nothing stronger.

What crosses a socket is data, never code: the message format and its checks are
``hetserve.runtime.workers.wire``, and no byte of a message is read before the peer has proved it holds the
deployment's secret (``hetserve.runtime.workers.auth``). ``docs/security.md`` is the threat model.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import queue
import socket
import ssl
import threading
import time
from enum import IntEnum
from typing import Any, Callable

from hetserve.runtime.workers.auth import (HandshakeCut, HandshakeError, HandshakeSlots, LinkSecurity,
                                           PendingConnection, accept_handshake, connect_handshake)
from hetserve.runtime.workers.link_scheduling import LinkScheduler, LinkShaper, Outgoing, PriorityScheduler
from hetserve.runtime.workers.wire import (CHUNK_HEADER, MalformedMessage, Message, Reassembly, check_sender, decode,
                                          encode, read_exact, read_into)


class Priority(IntEnum):
    """Priority classes, most urgent first (smaller value = sent earlier)."""

    CONTROL = 0  # start-up, shutdown, acknowledgements, results
    DECODE = 1  # activations of decode-only steps: on the critical path of every output token
    PREFILL = 2  # activations of steps that contain prompt processing
    KV = 3  # KV-cache hand-off from a prefill replica to a decode replica


# ----------------------------------------------------------------------------- interface


class Transport:
    """Base: named endpoint with an inbox. Subclasses implement ``send``."""

    def __init__(self, name: str):
        self.name = name
        self._inbox: queue.Queue[Message] = queue.Queue()
        self.closed = False
        # optional hook run on the receiving thread; returning True consumes the message (no inbox hop)
        self.on_message: Callable[[Message], bool] | None = None
        # optional hook run first, on the receiving thread: the messages to deliver now, in order. A
        # device channel (device_channel.py) fills in tensors that travelled beside the socket and
        # consumes its own acknowledgements.
        self.receive_hook: Callable[[Message], list[Message]] | None = None

    def _deliver(self, msg: Message) -> None:
        for m in (self.receive_hook(msg) if self.receive_hook is not None else (msg,)):
            if self.on_message is None or not self.on_message(m):
                self._inbox.put(m)

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

MAX_UNAUTHENTICATED = 64  # connections still in their handshake; one more closes the oldest (HandshakeSlots)
# A link's connection that fails before any byte of a message was sent, in a way that may pass (the
# peer not listening yet, or its handshake cut by a flood of connections: see HandshakeSlots), is
# tried again after 0.05 s, then twice as long each time up to 1 s, for this long before link_error.
CONNECT_PATIENCE_S = 5.0
HANDLING_FAILED = "handling failed for a message"  # the log line's fixed words: a GPU check greps for them
log = logging.getLogger("hetserve.runtime.workers.transport")


class SocketTransport(Transport):
    """TCP endpoint on ``host`` (default 127.0.0.1; one address, never all interfaces), on a port the OS
    picks or the first free one of ``ports`` (``rendezvous.listen_socket``). ``listen=False``: an
    endpoint that only sends (a worker telling the engine why it could not listen).

    Every connection is authenticated (``hetserve.runtime.workers.auth``: the deployment's secret, a
    challenge-response handshake, TLS when ``security.tls`` is set) before a message byte is read, and
    every chunk and message is checked (``hetserve.runtime.workers.wire``) before memory is allocated for it.
    Each message must name as its sender the name the connection's handshake carried
    (``wire.check_sender``): every endpoint sends under its own name, so one connection speaks for
    one endpoint. A connection that fails any of these is closed, logged (the first time per
    reason) and counted in ``rejected``; the endpoint lives on.

    Threads: one acceptor, one reader per incoming connection, one sender per peer this endpoint
    sends to. ``scheduler_factory(src, dst)`` makes the ``LinkScheduler`` of each outgoing link;
    ``shaper`` (optional) delays each chunk.
    """

    def __init__(self, name: str, security: LinkSecurity, host: str = "127.0.0.1",
                 scheduler_factory: Callable[[str, str], LinkScheduler] | None = None,
                 shaper: LinkShaper | None = None, ports=None, listen: bool = True):
        from hetserve.runtime.workers.rendezvous import check_bind_address, listen_socket

        super().__init__(name)
        self.security = security
        self._server_tls = security.tls.server_context() if security.tls and listen else None
        self._client_tls = security.tls.client_context() if security.tls else None
        bind = check_bind_address(host, f"endpoint {name}'s bind address")
        self._listener = listen_socket(bind, ports, f"endpoint {name}") if listen else None
        self._host = host
        self._addresses: dict[str, tuple[str, int]] = {}
        self._links: dict[str, LinkScheduler] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._scheduler_factory = scheduler_factory or (lambda src, dst: PriorityScheduler())
        self.shaper = shaper
        self._threads: list[threading.Thread] = []
        self._threads_lock = threading.Lock()
        self._socks: set[socket.socket] = set()  # open connections, closed with the endpoint
        self._unsent = 0  # messages pushed and not yet fully written
        self._unsent_cv = threading.Condition()
        self._handshaking = HandshakeSlots(MAX_UNAUTHENTICATED)
        self.rejected: collections.Counter[str] = collections.Counter()  # reason -> connections closed
        if self._listener is not None:
            self._spawn(self._accept_loop, f"{name}-accept")

    @property
    def address(self) -> tuple[str, int]:
        if self._listener is None:
            raise ConnectionError(f"endpoint {self.name} only sends: it has no address")
        return self._listener.getsockname()[:2]

    def set_address(self, peer: str, address: tuple[str, int]) -> None:
        address = tuple(address)
        with self._lock:
            if self._addresses.get(peer) not in (None, address):
                # the peer was restarted (a re-planned replica on a device that came back): a new link
                self._links.pop(peer, None)
            self._addresses[peer] = address

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
            if self._listener is not None:
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
        with self._threads_lock:  # not self._lock: _link spawns while holding it
            # only the threads still running are kept: every connection, a refused one included, has
            # its reader, and a list of them all grew by a thread per connection for the endpoint's life
            self._threads = [x for x in self._threads if x.is_alive()] + [t]

    def _link(self, peer: str) -> LinkScheduler:
        with self._lock:
            link = self._links.get(peer)
            if link is None:
                if peer not in self._addresses:
                    raise ConnectionError(f"{self.name}: no address known for peer {peer!r}")
                link = self._links[peer] = self._scheduler_factory(self.name, peer)
                self._spawn(self._send_loop, f"{self.name}->{peer}", peer, link)
            return link

    def _connect(self, peer: str) -> socket.socket:
        """A connection to ``peer`` on which this end and the peer have proved they hold the secret."""
        sock = socket.create_connection(self._addresses[peer], timeout=10)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._client_tls is not None:
                sock = self._client_tls.wrap_socket(sock)
            self._socks.add(sock)
            connect_handshake(sock, self.security, self.name)
        except BaseException:
            self._drop(sock)  # a refused handshake leaves no connection open
            raise
        return sock

    def _connect_patiently(self, peer: str, link: LinkScheduler) -> socket.socket | None:
        """``_connect``, tried again with back-off for up to ``CONNECT_PATIENCE_S`` while ``link`` is
        still the peer's (None once it is not: replaced, or the endpoint closed); the last error then."""
        delay, give_up = 0.05, time.monotonic() + CONNECT_PATIENCE_S
        while True:
            try:
                return self._connect(peer)
            except (HandshakeCut, ConnectionRefusedError, ConnectionResetError, TimeoutError, ssl.SSLEOFError):
                if time.monotonic() + delay > give_up:  # a refused proof or certificate is not tried again
                    raise
            time.sleep(delay)
            delay = min(2 * delay, 1.0)
            if self.closed or self._links.get(peer) is not link:
                return None

    def _send_loop(self, peer: str, link: LinkScheduler) -> None:
        sock = None
        try:
            sock = self._connect_patiently(peer, link)
            if sock is None:  # replaced or closed while it tried: nothing of it is left to end
                return
            while not self.closed and self._links.get(peer) is link:
                chunk = link.pop(timeout=0.5)
                if chunk is None:
                    continue
                if self.shaper is not None:
                    wait = self.shaper.delay(self.name, peer, len(chunk.data))
                    if wait > 0:
                        time.sleep(wait)
                sock.sendall(CHUNK_HEADER.pack(chunk.msg_id, chunk.offset, chunk.total, len(chunk.data)))
                sock.sendall(chunk.data)
                if chunk.offset + len(chunk.data) == chunk.total:
                    with self._unsent_cv:
                        self._unsent -= 1
                        self._unsent_cv.notify_all()
        except OSError as exc:  # HandshakeError and ssl.SSLError included
            if not self.closed:
                self.post(Message("link_error", {"peer": peer, "error": repr(exc)}))
        finally:
            # the link is over (replaced: its peer restarted elsewhere; or broken): its connection
            # goes with it, or every restart of a peer kept one more socket open for good
            if sock is not None:
                self._drop(sock)

    def _accept_loop(self) -> None:
        while not self.closed:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            conn = PendingConnection(sock)
            evicted = self._handshaking.admit(conn)
            if evicted is not None:  # shut, not only closed: that wakes its reader's wait at once
                self._reject("busy", f"more than {MAX_UNAUTHENTICATED} connections in their handshake: the oldest")
                with contextlib.suppress(OSError):
                    evicted.sock.shutdown(socket.SHUT_RDWR)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._socks.add(sock)
            self._spawn(self._read_loop, f"{self.name}-read", conn)

    def _authenticate(self, conn: PendingConnection) -> tuple[socket.socket, str]:
        """The connection after TLS (if any) and the handshake, and the name the peer proved it under;
        HandshakeError or OSError otherwise."""
        sock = conn.sock
        try:
            if self._server_tls is not None:
                sock.settimeout(self.security.handshake_timeout_s)
                self._socks.discard(sock)
                sock = conn.sock = self._server_tls.wrap_socket(sock, server_side=True)
                self._socks.add(sock)
            return sock, accept_handshake(sock, self.security)
        except BaseException:
            self._drop(sock)  # the TLS-wrapped socket, where wrapping succeeded
            raise
        finally:
            self._handshaking.release(conn)

    def _read_loop(self, conn: PendingConnection) -> None:
        try:
            sock, peer = self._authenticate(conn)
        except (HandshakeError, ssl.SSLError, OSError) as exc:
            if not self.closed and not conn.evicted:  # an evicted one was counted as busy
                self._reject("handshake", repr(exc))
            self._drop(conn.sock)
            return
        frames = Reassembly(self.security.max_message_bytes)
        try:
            while True:
                header = CHUNK_HEADER.unpack(read_exact(sock, CHUNK_HEADER.size))
                view = frames.chunk(*header)
                read_into(sock, view)
                payload = frames.complete(header[0], header[3])
                if payload is not None:
                    msg = decode(payload)
                    check_sender(msg, peer)  # a message under another name than the handshake's is refused
                    self._deliver_guarded(msg)
        except MalformedMessage as exc:
            self._reject("malformed", str(exc))
        except (OSError, EOFError):
            pass
        self._drop(sock)

    def _deliver_guarded(self, msg: Message) -> None:
        """Deliver ``msg``; a hook that raises loses this message only, not the connection: its
        reading thread goes on with the peer's next messages (the hooks answer for what they
        lose: a worker refuses a KV piece it could not write, and its request re-runs)."""
        try:
            self._deliver(msg)
        except MalformedMessage:
            raise  # a message no peer of this deployment sends: the connection is closed, as for bad bytes
        except Exception as exc:  # noqa: BLE001 - whatever else a hook raises
            log.warning("%s: %s %r from %s (%s: %s)", self.name, HANDLING_FAILED, msg.kind, msg.src,
                        type(exc).__name__, exc, exc_info=True)

    def _drop(self, sock: socket.socket) -> None:
        self._socks.discard(sock)
        try:
            sock.close()
        except OSError:
            pass

    def _reject(self, reason: str, detail: str) -> None:
        with self._lock:
            self.rejected[reason] += 1
            first = self.rejected[reason] == 1
        (log.warning if first else log.debug)("%s: closed a connection (%s): %s%s", self.name, reason, detail,
                                              "; later ones are logged at debug level" if first else "")
