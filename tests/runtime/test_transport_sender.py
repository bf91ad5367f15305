"""A message speaks for the endpoint its connection's handshake named (``wire.check_sender``): one
that claims another sender, in ``src`` or in ``meta["worker"]``, is refused as malformed and its
connection closed; honest peers' messages, on their own connections, arrive as before."""

from __future__ import annotations

import math
import socket
import time

import pytest

from hetserve.runtime.links.network import LinkStats
from hetserve.runtime.links.reports import LinkReports, link_report
from hetserve.runtime.workers.auth import LinkSecurity, connect_handshake
from hetserve.runtime.workers.transport import SocketTransport
from hetserve.runtime.workers.wire import CHUNK_HEADER, ENGINE, MalformedMessage, Message, check_sender, encode

SECURITY = LinkSecurity(b"s" * 32)


class Counters:
    """A link scheduler hook with one link's counters: what a worker's report carries."""

    def __init__(self, src: str, kv: float):
        self.stats = LinkStats(src, "m9:0", 0.001, math.inf)
        self.stats.bytes_sent["kv"] = kv

    def process_stats(self):
        return [self.stats]


def _connect_as(address, name: str) -> socket.socket:
    """A connection that proved the secret under ``name``; what it sends is written as given."""
    sock = socket.create_connection(address, timeout=5)
    connect_handshake(sock, SECURITY, name)
    return sock


def _write(sock: socket.socket, msg: Message, msg_id: int = 1) -> None:
    payload = b"".join(encode(msg))
    sock.sendall(CHUNK_HEADER.pack(msg_id, 0, len(payload), len(payload)) + payload)


def _until(cond, timeout_s: float = 10.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end and not cond():
        time.sleep(0.01)
    return cond()


@pytest.mark.parametrize("msg, why", [
    (Message("heartbeat", {"worker": "b"}, src="a"), "naming worker 'b' on a connection of 'a'"),
    (Message("links", {"pid": 1, "links": []}, src="b"), "from 'b' on a connection of 'a'"),
])
def test_a_message_under_another_name_than_its_connections_is_malformed(msg, why):
    with pytest.raises(MalformedMessage, match=why):
        check_sender(msg, "a")
    check_sender(Message("heartbeat", {"worker": "a"}, src="a"), "a")  # its own name: fine
    check_sender(Message("step", {}, src=ENGINE), ENGINE)  # no worker named: src alone


def test_a_peer_authenticated_as_a_cannot_speak_for_b_and_honest_peers_go_on():
    engine = SocketTransport(ENGINE, SECURITY)
    reports = LinkReports(lambda: {"a", "b"})
    engine.on_message = reports.handle
    honest = SocketTransport("a", SECURITY, listen=False)  # as a worker's endpoint sends: under its own name
    forger = _connect_as(engine.address, "a")
    try:
        honest.set_address(ENGINE, engine.address)
        # a links report and a heartbeat for b, on a connection that proved itself as a
        forged = link_report(Counters("b-link", 1e9), 4242)
        forged.src = "b"
        _write(forger, forged)
        assert _until(lambda: engine.rejected["malformed"] == 1)
        assert forger.recv(1) == b""  # the connection is closed, as for any malformed message
        second = _connect_as(engine.address, "a")
        _write(second, Message("heartbeat", {"worker": "b", "rejected": {}}, src="a"))
        assert _until(lambda: engine.rejected["malformed"] == 2)
        second.close()
        assert reports.entries("b") == 0 and reports.merged([], live={"a", "b"}) == []
        assert engine.recv(timeout=0.2) is None  # the heartbeat never reached the loop either
        # the honest peer's report and heartbeat arrive, under its own name
        honest.send(ENGINE, link_report(Counters("a-link", 7.0), 1))
        honest.send(ENGINE, Message("heartbeat", {"worker": "a", "rejected": {}}))
        beat = engine.recv(timeout=10)
        assert beat.kind == "heartbeat" and beat.src == "a" and beat.meta["worker"] == "a"
        assert _until(lambda: reports.entries("a") == 1)
        (link,) = reports.merged([], live={"a", "b"})
        assert (link.src, link.bytes_sent["kv"]) == ("a-link", 7.0)
        assert engine.rejected["malformed"] == 2  # the honest messages were not refused
    finally:
        forger.close()
        honest.close()
        engine.close()
