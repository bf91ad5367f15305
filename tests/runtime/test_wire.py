"""The runtime's wire format and handshake, without processes: what decodes, what is refused and
before what is allocated, who gets through the handshake."""

from __future__ import annotations

import gc
import os
import pickle
import shutil
import socket
import struct
import subprocess
import threading
import time

import pytest
import torch

from hetserve.runtime.workers.auth import (HandshakeError, LinkSecurity, TLSFiles, accept_handshake, connect_handshake,
                                   deployment_secret, read_secret_file)
from hetserve.runtime.layout import ReplicaSpec, WorkerSpec
from hetserve.runtime.workers.transport import SocketTransport
from hetserve.runtime.workers.wire import (MalformedMessage, Message, Reassembly, decode, encode, pack_data, unpack_data)

SECURITY = LinkSecurity(b"k" * 32)


def _payload(msg: Message) -> bytearray:
    return bytearray(b"".join(encode(msg)))


def _header_payload(header: dict, tail: bytes = b"") -> bytearray:
    data = pack_data(header)
    return bytearray(struct.pack(">I", len(data)) + data + tail)


def test_plain_data_and_layout_records_round_trip():
    w = WorkerSpec("m0:0", "r0", "both", 0, 1, (0, 4), 0, 1, "m0:0", None, (0, 2), "cpu")
    layout = ReplicaSpec("r0", "both", ((w,),))
    meta = {"seqs": [(1, 0, 3, [0, 1], (0.7, 1.0, None, 0))], 7: "int key", "layout": [layout],
            "x": float("inf"), "b": True}
    got = unpack_data(pack_data(meta))
    assert got == {**meta, "seqs": [[1, 0, 3, [0, 1], [0.7, 1.0, None, 0]]]}  # tuples arrive as lists
    assert got["layout"][0] == layout and hash(got["layout"][0]) == hash(layout)  # records as they were
    meta = got
    got = decode(_payload(Message("peers", meta, {"t": torch.arange(6).reshape(2, 3)}, "engine")))
    assert got.meta == meta and got.src == "engine" and torch.equal(got.tensors["t"], torch.arange(6).reshape(2, 3))


def test_anything_but_plain_data_cannot_be_sent():
    with pytest.raises(TypeError, match="cannot go on the wire"):
        pack_data({"f": open})  # a function: the old pickle header sent whatever it was given
    with pytest.raises(TypeError):
        encode(Message("step", {"obj": object()}))


@pytest.mark.parametrize("payload, why", [
    (bytearray(struct.pack(">I", 40) + pickle.dumps(("step", {}, "a", []))), "undecodable|header of"),
    (bytearray(b"\x00\x00"), "shorter"),
    (bytearray(struct.pack(">I", 1 << 30)), "header of"),
])
def test_foreign_bytes_are_refused(payload, why):
    with pytest.raises(MalformedMessage, match=why):
        decode(payload)


def test_a_pickled_header_in_the_new_frame_is_refused_without_running():
    data = pickle.dumps(("step", {}, "a", []))
    with pytest.raises(MalformedMessage):
        decode(bytearray(struct.pack(">I", len(data)) + data))


@pytest.mark.parametrize("header, why", [
    ({"kind": "submit", "src": "a", "meta": {}, "tensors": []}, "unknown message kind"),  # posted, never sent
    ({"kind": "step", "src": "a", "meta": [], "tensors": []}, "meta a map"),
    ({"kind": "step", "src": "a", "meta": {}}, "map of kind"),
    ({"kind": "step", "src": "a", "meta": {}, "tensors": [["t", "object", [1], 8]]}, "dtype"),
    ({"kind": "step", "src": "a", "meta": {}, "tensors": [["t", "float32", [-1], 4]]}, "dtype"),
    ({"kind": "step", "src": "a", "meta": {}, "tensors": [["t", "float32", [4], 8]]}, "8 bytes for shape"),
    ({"kind": "step", "src": "a", "meta": {}, "tensors": [["t", "float32", [1 << 40], 1 << 42]]}, "runs past"),
])
def test_headers_no_sender_writes_are_refused(header, why):
    with pytest.raises(MalformedMessage, match=why):
        decode(_header_payload(header))


def test_bytes_after_the_last_tensor_and_unknown_records_are_refused():
    with pytest.raises(MalformedMessage, match="after the last tensor"):
        decode(_payload(Message("step")) + b"x")
    import msgpack

    forged = msgpack.ExtType(2, pack_data(["Popen", {"args": "touch x"}]))
    with pytest.raises(MalformedMessage, match="unknown record"):
        unpack_data(msgpack.packb({"a": forged}))


def test_reassembly_checks_every_chunk_before_allocating():
    r = Reassembly(max_message_bytes=1000)
    with pytest.raises(MalformedMessage, match="bound"):
        r.chunk(1, 0, 1 << 40, 10)
    with pytest.raises(MalformedMessage, match="a chunk of"):
        r.chunk(1, 990, 1000, 20)
    r.chunk(2, 0, 100, 60)
    r.complete(2, 60)
    with pytest.raises(MalformedMessage, match="announced as 100 and 200"):
        r.chunk(2, 60, 200, 40)
    with pytest.raises(MalformedMessage, match="more bytes than announced"):
        r.chunk(2, 0, 100, 60)  # the same bytes again
    view = r.chunk(2, 60, 100, 40)
    view[:] = b"y" * 40
    assert r.complete(2, 40) is not None and not r.partial


def test_handshake_lets_the_secret_in_and_keeps_others_out():
    def run(client_security):
        a, b = socket.socketpair()
        server = {}
        t = threading.Thread(target=lambda: server.update(result=_try(accept_handshake, a, SECURITY)))
        t.start()
        client = _try(connect_handshake, b, client_security, "w0")
        t.join()
        a.close(), b.close()
        return server["result"], client

    assert run(SECURITY) == ("w0", None)
    name, client = run(LinkSecurity(b"x" * 32))
    assert isinstance(name, HandshakeError) and isinstance(client, HandshakeError)


def test_a_silent_or_trickling_peer_is_dropped_at_the_handshake_deadline():
    a, b = socket.socketpair()
    b.sendall(b"HSV1")  # then nothing
    with pytest.raises(HandshakeError, match="timed out"):
        accept_handshake(a, LinkSecurity(b"k" * 32, handshake_timeout_s=0.3))
    a.close(), b.close()


def test_refused_connections_leave_no_thread_behind():
    """Each connection gets a reading thread; once it is refused, nothing of it stays with the endpoint,
    however many a peer opens."""
    def threads() -> int:
        gc.collect()
        return sum(type(o) is threading.Thread for o in gc.get_objects())

    b = SocketTransport("b", SECURITY)
    try:
        before = threads()
        for i in range(1, 301):
            with socket.create_connection(b.address) as s:
                s.sendall(b"GET / HTTP/1.1\r\n\r\n" + b"x" * 64)  # wrong greeting: refused at once
                s.recv(64)
            while b.rejected["handshake"] < i:  # one at a time: never "busy"
                time.sleep(0.001)
        while any(t.name == "b-read" for t in threading.enumerate()):
            time.sleep(0.01)
        assert threads() < before + 10
    finally:
        b.close()


def test_a_flood_of_silent_connections_does_not_keep_a_peer_out():
    """Every handshake slot held by a silent connection (an attacker reconnecting every few seconds):
    a peer holding the secret still gets in, the oldest silent one closed to make room."""
    from hetserve.runtime.workers.transport import MAX_UNAUTHENTICATED

    patient = LinkSecurity(SECURITY.secret, handshake_timeout_s=120)  # no slot frees itself meanwhile
    a, b = SocketTransport("a", SECURITY), SocketTransport("b", patient)
    silent = [socket.create_connection(b.address) for _ in range(MAX_UNAUTHENTICATED)]
    try:
        for s in silent:  # each accepted and in its handshake: b's greeting came
            s.settimeout(10)
            assert s.recv(1)
        a.set_address("b", b.address)
        a.send("b", Message("result", {"n": 1}))
        got = b.recv(timeout=10)
        assert got is not None and got.kind == "result", (got, a.recv(timeout=0.1))
        assert b.rejected["busy"] == 1
        silent[0].settimeout(4)  # the oldest, shut by b: its greeting, then the end of the stream
        while chunk := silent[0].recv(64):
            assert len(chunk) <= 64
    finally:
        for s in silent:
            s.close()
        a.close()
        b.close()


def test_a_link_replaced_or_refused_leaves_no_connection_open():
    """A peer that restarts elsewhere (``set_address`` to a new address) gets a new link: the old
    link's connection is closed, not kept for the endpoint's life; nor does a refused handshake keep one."""
    a, b1, b2 = SocketTransport("a", SECURITY), SocketTransport("b", SECURITY), SocketTransport("b", SECURITY)
    rogue = SocketTransport("b", LinkSecurity(b"x" * 32))
    try:
        a.set_address("b", b1.address)
        a.send("b", Message("result", {"n": 1}))
        assert b1.recv(timeout=10).kind == "result"
        assert len(a._socks) == 1
        a.set_address("b", b2.address)  # b restarted: its new endpoint
        a.send("b", Message("result", {"n": 2}))
        assert b2.recv(timeout=10).kind == "result"
        deadline = time.monotonic() + 10  # the old link's loop notices within its 0.5 s poll
        while len(a._socks) > 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(a._socks) == 1, a._socks
        a.set_address("b", rogue.address)  # a peer without the secret: the handshake fails
        a.send("b", Message("result", {"n": 3}))
        assert a.recv(timeout=10).kind == "link_error"
        deadline = time.monotonic() + 10
        while len(a._socks) > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not a._socks, a._socks
    finally:
        for t in (a, b1, b2, rogue):
            t.close()


def test_a_peer_not_listening_yet_is_connected_on_a_later_try():
    """A message sent to a peer's address before its endpoint listens (a worker still starting, or a
    connection closed in its handshake) arrives once it does: the link's connection is tried again
    with back-off, where the first refusal ended the link and lost everything sent on it."""
    from hetserve.runtime.workers.rendezvous import PortRange

    with socket.socket() as probe:  # a port nothing listens on (for now)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    a, b = SocketTransport("a", SECURITY), None
    try:
        a.set_address("b", ("127.0.0.1", port))
        a.send("b", Message("result", {"n": 1}))
        time.sleep(0.3)  # the first connection is refused meanwhile
        b = SocketTransport("b", SECURITY, ports=PortRange(port, port))
        got = b.recv(timeout=10)
        assert got is not None and got.kind == "result" and got.meta == {"n": 1}, (got, a.recv(timeout=0.1))
    finally:
        a.close()
        if b is not None:
            b.close()


def _try(fn, *args):
    try:
        return fn(*args)
    except HandshakeError as exc:
        return exc


def test_secret_from_file_env_or_fresh(tmp_path, monkeypatch):
    monkeypatch.delenv("HETSERVE_SECRET", raising=False)
    monkeypatch.delenv("HETSERVE_SECRET_FILE", raising=False)
    assert len(deployment_secret()) == 32 and deployment_secret() != deployment_secret()
    f = tmp_path / "secret"
    f.write_text("ab" * 32 + "\n")
    f.chmod(0o644)
    with pytest.raises(ValueError, match="mode 644.*chmod 600"):
        read_secret_file(f)
    f.chmod(0o600)
    monkeypatch.setenv("HETSERVE_SECRET_FILE", str(f))
    assert deployment_secret() == bytes.fromhex("ab" * 32)
    monkeypatch.delenv("HETSERVE_SECRET_FILE")
    monkeypatch.setenv("HETSERVE_SECRET", "abcd")
    with pytest.raises(ValueError, match="at least 16"):
        deployment_secret()
    with pytest.raises(ValueError, match="at least 16"):
        LinkSecurity(b"short")
    assert "kkkk" not in repr(SECURITY)  # the secret never reaches a log line


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    # the certificates are made by the openssl command, which every machine of this project has
    # (Debian's base image); without it the test fails here rather than passing untested
    assert shutil.which("openssl"), "the TLS test makes its certificates with the openssl command"
    d = tmp_path_factory.mktemp("tls")

    def run(*args):
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
        "-subj", "/CN=hetserve-test-ca")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "node.key", "-out", "node.csr", "-subj", "/CN=node")
    run("x509", "-req", "-in", "node.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "node.pem", "-days", "2")
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "other.key", "-out", "other.pem", "-days", "2",
        "-subj", "/CN=someone-else")
    return d


def test_tls_links_carry_messages_and_refuse_a_certificate_from_elsewhere(tls_files):
    d = tls_files
    tls = TLSFiles(str(d / "node.pem"), str(d / "node.key"), str(d / "ca.pem"))
    rogue = TLSFiles(str(d / "other.pem"), str(d / "other.key"), str(d / "other.pem"))
    secure = LinkSecurity(b"k" * 32, tls=tls)
    a, b = SocketTransport("a", secure), SocketTransport("b", secure)
    c = SocketTransport("c", LinkSecurity(b"k" * 32, tls=rogue))  # the secret, but not the pool's certificate
    try:
        a.set_address("b", b.address)
        a.send("b", Message("result", {"n": 1}, {"t": torch.ones(3)}))
        got = b.recv(timeout=10)
        assert got.kind == "result" and torch.equal(got.tensors["t"], torch.ones(3))
        c.set_address("b", b.address)
        c.send("b", Message("result", {"n": 2}))
        err = c.recv(timeout=10)
        assert err.kind == "link_error" and b.recv(timeout=0.5) is None
        assert b.rejected["handshake"] == 1
    finally:
        for t in (a, b, c):
            t.close()
    with pytest.raises(ValueError, match="does not exist"):
        TLSFiles(str(d / "missing.pem"), str(d / "node.key"), str(d / "ca.pem"))
    assert os.path.exists(d / "node.pem")
