"""Attacks on the runtime's sockets, shared by the tests that aim them at a served plan's endpoints."""

from __future__ import annotations

import os
import socket
import struct
import time

from hetserve.runtime.workers.wire import CHUNK_HEADER


class Exploit:
    """Unpickling this runs a shell command that creates ``path``: the old wire's remote code execution."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


def old_framing(payload: bytes) -> bytes:
    """What the runtime's sockets used to accept: a name, a chunk header, a pickled header."""
    name = b"engine"
    header = struct.pack(">I", len(payload)) + payload
    return struct.pack(">H", len(name)) + name + CHUNK_HEADER.pack(1, 0, len(header), len(header)) + header


def send_and_close(address, data: bytes) -> None:
    with socket.create_connection(address, timeout=5) as s:
        try:
            s.sendall(data)
            s.settimeout(2)
            while s.recv(4096):  # until the endpoint closes the connection
                pass
        except OSError:
            pass


def trickle(address, seconds: float) -> None:
    """A slow client: one byte a second."""
    try:
        with socket.create_connection(address, timeout=5) as s:
            for _ in range(int(seconds)):
                s.sendall(b"H")
                time.sleep(1.0)
    except OSError:
        pass  # closed by the endpoint: what should happen


def attack(address, marker: str) -> None:
    """The old wire's code execution and a frame without the handshake, at one endpoint."""
    import pickle

    send_and_close(address, old_framing(pickle.dumps(("step", {}, "engine", [Exploit(marker)]))))
    send_and_close(address, CHUNK_HEADER.pack(1, 0, 8, 8) + bytes(8))
