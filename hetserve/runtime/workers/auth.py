"""Who may talk to a runtime endpoint: a deployment secret, a challenge-response handshake, optional TLS.

Every connection between the engine and its workers starts with a handshake, before a single
message byte is read. Both ends hold the deployment's secret; neither sends it:

    server -> client   MAGIC | server nonce (32 bytes)
    client -> server   MAGIC | client nonce (32) | >H name length | name | HMAC(secret, client proof)
    server -> client   HMAC(secret, server proof)

with each proof binding both nonces and the client's name (``_proof``), so a recorded exchange
cannot be replayed and neither side can be impersonated without the secret. The server drops a
connection whose handshake is wrong or not complete within ``handshake_timeout_s`` (a slow client
holds one thread for that long, no more); the client sends nothing until the server has proved
itself. Comparisons are constant-time.

The secret is made fresh per deployment (``deployment_secret``) and handed to the workers the engine
starts (through the process spawn or Ray, never the runtime's own sockets). ``HETSERVE_SECRET_FILE``
(a file only its owner may read) or ``HETSERVE_SECRET`` (hex) fix it instead, for processes started
by hand. TLS (``TLSFiles``: certificate, key and the CA that signed every peer's certificate) encrypts
links that leave a machine; both ends present a certificate.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
import ssl
import stat
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

MAGIC = b"HSV1"
NONCE_BYTES = 32
MIN_SECRET_BYTES = 16
SECRET_ENV = "HETSERVE_SECRET"
SECRET_FILE_ENV = "HETSERVE_SECRET_FILE"
# the largest message a peer may announce, unless the deployment says otherwise: a KV hand-off of a
# long prompt of a large model (a 32k-token prompt of a 70B model's layers held by one worker) fits
DEFAULT_MAX_MESSAGE_BYTES = 8 << 30

_NAME_LEN = struct.Struct(">H")
_MAC_BYTES = hashlib.sha256().digest_size


class HandshakeError(ConnectionError):
    """A peer that did not prove it holds the deployment's secret (or spoke something else)."""


class HandshakeCut(HandshakeError):
    """A handshake that ended unfinished (closed or timed out): no proof was refused, so a later
    try may pass (the peer closed it to make room, or was busy)."""


@dataclass(frozen=True)
class TLSFiles:
    """PEM files for TLS on the runtime's links: this process's certificate and key, and the CA bundle
    every peer's certificate must chain to (peers are checked by certificate, not by host name:
    they are addressed by IP)."""

    cert: str
    key: str
    ca: str

    def __post_init__(self) -> None:
        for what in ("cert", "key", "ca"):
            path = Path(getattr(self, what))
            if not path.is_file():
                raise ValueError(f"TLS {what} file {str(path)!r} does not exist")

    def _context(self, purpose: ssl.Purpose) -> ssl.SSLContext:
        ctx = ssl.create_default_context(purpose, cafile=self.ca)
        ctx.load_cert_chain(self.cert, self.key)
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_REQUIRED  # both directions: a client without a certificate is refused
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        return ctx

    def server_context(self) -> ssl.SSLContext:
        return self._context(ssl.Purpose.CLIENT_AUTH)

    def client_context(self) -> ssl.SSLContext:
        return self._context(ssl.Purpose.SERVER_AUTH)


@dataclass(frozen=True)
class LinkSecurity:
    """What every endpoint of one deployment shares: the secret, TLS files if any, and the bounds on
    what a peer may send."""

    secret: bytes = field(repr=False)
    tls: TLSFiles | None = None
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    handshake_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if not isinstance(self.secret, bytes) or len(self.secret) < MIN_SECRET_BYTES:
            raise ValueError(f"the deployment secret must be at least {MIN_SECRET_BYTES} bytes")
        if self.max_message_bytes < 1 or self.handshake_timeout_s <= 0:
            raise ValueError("max_message_bytes and handshake_timeout_s must be positive")

    @staticmethod
    def fresh(**kwargs) -> "LinkSecurity":
        return LinkSecurity(deployment_secret(), **kwargs)


def deployment_secret() -> bytes:
    """The secret from ``$HETSERVE_SECRET_FILE`` or ``$HETSERVE_SECRET`` (hex), else 32 fresh random bytes."""
    path = os.environ.get(SECRET_FILE_ENV)
    if path:
        return read_secret_file(Path(path))
    text = os.environ.get(SECRET_ENV)
    if text:
        try:
            secret = bytes.fromhex(text.strip())
        except ValueError:
            raise ValueError(f"${SECRET_ENV} must be hex (e.g. from `openssl rand -hex 32`)") from None
        return _long_enough(secret, f"${SECRET_ENV}")
    return secrets.token_bytes(32)


def read_secret_file(path: Path) -> bytes:
    """A hex secret from ``path``, refused if anyone but its owner may read or write the file."""
    try:
        mode = path.stat().st_mode
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"secret file {str(path)!r}: {exc.strerror}") from None
    if not owner_only(mode):
        raise ValueError(f"secret file {str(path)!r} has mode {stat.S_IMODE(mode):o}: others may read it; "
                         f"`chmod 600 {path}`")
    try:
        secret = bytes.fromhex(text.strip())
    except ValueError:
        raise ValueError(f"secret file {str(path)!r} must hold hex (e.g. `openssl rand -hex 32 > {path}`)") from None
    return _long_enough(secret, f"secret file {str(path)!r}")


def owner_only(st_mode: int) -> bool:
    """Whether a file of mode ``st_mode`` is closed to its group and others: the rule for every file
    that holds a secret (the deployment secret, API keys), as ssh holds its key files to it."""
    return not st_mode & (stat.S_IRWXG | stat.S_IRWXO)


def _long_enough(secret: bytes, what: str) -> bytes:
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"{what} holds {len(secret)} bytes; at least {MIN_SECRET_BYTES} are needed")
    return secret


@dataclass(eq=False)
class PendingConnection:
    """A connection in its handshake: its socket (the TLS-wrapped one, once wrapped: the one its reader
    waits on, so the one to shut down) and whether ``HandshakeSlots`` evicted it."""

    sock: socket.socket
    evicted: bool = False


class HandshakeSlots:
    """The connections in their handshake, at most ``limit``: one more evicts the oldest. A peer that
    holds the secret finishes in milliseconds, so the oldest is a silent or trickling one, and a flood
    of those cannot keep a real peer out (refusing the newest did: reconnecting every few seconds held
    every slot)."""

    def __init__(self, limit: int):
        self.limit = limit
        self._held: dict[PendingConnection, None] = {}  # oldest first
        self._lock = threading.Lock()

    def admit(self, conn: PendingConnection) -> PendingConnection | None:
        """Hold ``conn``; the oldest, evicted to make room (its socket to be shut down), or None."""
        with self._lock:
            evicted = None
            if len(self._held) >= self.limit:
                evicted = next(iter(self._held))
                del self._held[evicted]
                evicted.evicted = True
            self._held[conn] = None
            return evicted

    def release(self, conn: PendingConnection) -> None:
        with self._lock:
            self._held.pop(conn, None)

    def __len__(self) -> int:
        return len(self._held)


# ----------------------------------------------------------------------------- handshake


def _proof(secret: bytes, side: bytes, first: bytes, second: bytes, name: bytes) -> bytes:
    return hmac.new(secret, side + first + second + _NAME_LEN.pack(len(name)) + name, hashlib.sha256).digest()


def accept_handshake(sock: socket.socket, security: LinkSecurity) -> str:
    """Server side: the authenticated peer's name; HandshakeError (connection to be closed) otherwise."""
    deadline = time.monotonic() + security.handshake_timeout_s
    server_nonce = secrets.token_bytes(NONCE_BYTES)
    sock.sendall(MAGIC + server_nonce)
    head = _recv_exact(sock, len(MAGIC) + NONCE_BYTES + _NAME_LEN.size, deadline)
    if head[:len(MAGIC)] != MAGIC:
        raise HandshakeError("not a hetserve peer (wrong greeting)")
    client_nonce = head[len(MAGIC):len(MAGIC) + NONCE_BYTES]
    (n,) = _NAME_LEN.unpack_from(head, len(MAGIC) + NONCE_BYTES)
    if n > 256:
        raise HandshakeError(f"a peer name of {n} bytes")
    rest = _recv_exact(sock, n + _MAC_BYTES, deadline)
    name, mac = rest[:n], rest[n:]
    if not hmac.compare_digest(mac, _proof(security.secret, b"client", server_nonce, client_nonce, name)):
        raise HandshakeError("the peer does not hold the deployment's secret")
    sock.sendall(_proof(security.secret, b"server", client_nonce, server_nonce, name))
    sock.settimeout(None)
    return name.decode("utf-8", "replace")


def connect_handshake(sock: socket.socket, security: LinkSecurity, name: str) -> None:
    """Client side: prove this end holds the secret and check the server does; HandshakeError otherwise."""
    deadline = time.monotonic() + security.handshake_timeout_s
    head = _recv_exact(sock, len(MAGIC) + NONCE_BYTES, deadline)
    if head[:len(MAGIC)] != MAGIC:
        raise HandshakeError("the peer is not a hetserve endpoint (wrong greeting)")
    server_nonce, client_nonce, raw = head[len(MAGIC):], secrets.token_bytes(NONCE_BYTES), name.encode()
    sock.sendall(MAGIC + client_nonce + _NAME_LEN.pack(len(raw)) + raw
                 + _proof(security.secret, b"client", server_nonce, client_nonce, raw))
    mac = _recv_exact(sock, _MAC_BYTES, deadline)
    if not hmac.compare_digest(mac, _proof(security.secret, b"server", client_nonce, server_nonce, raw)):
        raise HandshakeError("the peer does not hold the deployment's secret")
    sock.settimeout(None)


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    """``n`` bytes, all of them before ``deadline`` (a client trickling bytes does not reset it)."""
    buf = bytearray()
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise HandshakeCut("handshake timed out")
        sock.settimeout(left)
        try:
            got = sock.recv(n - len(buf))
        except socket.timeout:
            raise HandshakeCut("handshake timed out") from None
        if not got:
            raise HandshakeCut("connection closed during the handshake")
        buf += got
    return bytes(buf)
