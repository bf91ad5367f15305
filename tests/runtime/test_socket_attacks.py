"""Every socket a served plan listens on, attacked as a local user would: no code runs, no process
dies, nothing unbounded is allocated, and requests in flight complete with the tokens they would
have had.

The engine runs a disaggregated plan with every shape the runtime has (a TP 2 prefill replica, a
two-stage decode replica), worker processes and all; the attacks go to the engine's endpoint and
to every worker's.
"""

from __future__ import annotations

import pickle
import random
import socket
import struct
import threading
import time

import pytest

from hetserve.runtime.workers.auth import MAGIC, NONCE_BYTES, HandshakeError, LinkSecurity, connect_handshake
from hetserve.runtime.workers.wire import CHUNK_HEADER
from tests.runtime.attacks import Exploit, old_framing, send_and_close, trickle

PLAN = {"model": "tiny", "cluster": "demo-cpu", "algorithm": "manual", "replicas": [
    {"id": "p0", "role": "prefill", "stages": [{"devices": ["m0:0", "m0:1"], "layers": [0, 4]}]},
    {"id": "d0", "role": "decode", "stages": [{"devices": ["m1:0"], "layers": [0, 2]},
                                              {"devices": ["m1:1"], "layers": [2, 4]}]}],
    "kv_routes": [{"from": "p0", "to": "d0", "weight": 1.0}]}
PROMPTS = [[1, 5, 9, 2], [7] * 20, [3, 4]]
ROUNDS = 2  # of every attack at every endpoint


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from hetserve.planner.plan import Plan
    from hetserve.runtime.engine import Engine
    from hetserve.runtime.engine_config import EngineConfig
    from hetserve.runtime.model.make import make_model

    model = make_model(tmp_path_factory.mktemp("model") / "tiny", "llama", layers=4, hidden=64, heads=4,
                       kv_heads=2, max_positions=256)
    plan = Plan.from_dict(PLAN)
    with Engine.from_plan(plan, "demo-cpu", model, EngineConfig(kv_capacity_tokens=256)) as eng:
        yield eng


def _generate(engine, max_tokens: int = 8):
    from hetserve.runtime.params import SamplingParams

    return engine.generate(PROMPTS, SamplingParams(max_tokens=max_tokens, temperature=0.0), timeout=120)


def test_attacks_on_every_endpoint_run_nothing_and_kill_nothing(engine, tmp_path):
    marker = tmp_path / "pwned"
    endpoints = [engine.transport.address] + list(engine.workers.addresses.values())
    assert len(endpoints) == 5  # the engine and four workers
    before = _generate(engine)
    pids = [p.pid for p in engine.procs.values()]
    rss = {pid: _rss_mb(pid) for pid in pids}

    results = {}
    in_flight = threading.Thread(target=lambda: results.setdefault("tokens", _generate(engine, 24)))
    in_flight.start()
    slow = [threading.Thread(target=trickle, args=(a, 7)) for a in endpoints]  # past the 5 s deadline
    for t in slow:
        t.start()
    exploit = pickle.dumps(("step", {}, "engine", [Exploit(str(marker))]))

    def attack(address, seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(ROUNDS):
            send_and_close(address, old_framing(exploit))
            send_and_close(address, rng.randbytes(rng.randint(1, 4096)))
            # a frame announcing 2^40 bytes, sent as the old wire wanted it
            send_and_close(address, struct.pack(">H", 1) + b"x" + CHUNK_HEADER.pack(1, 0, 1 << 40, 1 << 30))
            # the greeting, then a correct-looking frame without the proof
            send_and_close(address, MAGIC + bytes(NONCE_BYTES) + struct.pack(">H", 1) + b"x" + bytes(32)
                            + CHUNK_HEADER.pack(1, 0, 8, 8) + bytes(8))

    # every endpoint at once: each attack waits for its endpoint to close the connection
    attackers = [threading.Thread(target=attack, args=(a, i)) for i, a in enumerate(endpoints)]
    for t in attackers:
        t.start()
    for t in attackers:
        t.join()
    for t in slow:
        t.join()
    in_flight.join(timeout=120)

    assert not marker.exists()
    assert all(p.is_alive() for p in engine.procs.values())
    assert results["tokens"][:1] and _generate(engine) == before  # in flight and after: served as before
    assert results["tokens"] == _generate(engine, 24)
    grown = {pid: _rss_mb(pid) - rss[pid] for pid in pids}
    assert max(grown.values()) < 64, grown  # nothing of the 2^40 announced was allocated
    deadline = time.monotonic() + 10  # the workers report their refusals with their next heartbeats
    attacks = len(endpoints) * ROUNDS * 4 + len(slow)
    while time.monotonic() < deadline and engine.refused_connections().get("handshake", 0) < attacks:
        time.sleep(0.2)
    assert engine.refused_connections()["handshake"] >= attacks  # every attack, at every endpoint


def test_a_peer_with_the_wrong_secret_is_refused_before_a_message_is_read(engine):
    address = engine.workers.addresses["m1:0"]
    refused = _refused_by(engine, "m1:0")
    with socket.create_connection(address, timeout=5) as s:
        with pytest.raises(HandshakeError):  # the worker closes the connection without proving itself
            connect_handshake(s, LinkSecurity(b"w" * 32), "engine")
    deadline = time.monotonic() + 10  # the worker's count arrives with its next heartbeat
    while time.monotonic() < deadline and _refused_by(engine, "m1:0") == refused:
        time.sleep(0.1)
    assert _refused_by(engine, "m1:0") == refused + 1
    with socket.create_connection(address, timeout=5) as s:  # the right secret gets through
        connect_handshake(s, engine.security, "engine")
    assert all(p.is_alive() for p in engine.procs.values())


def _refused_by(engine, worker: str) -> int:
    return engine.loop.refused.get(worker, {}).get("handshake", 0)


def test_an_authenticated_peer_still_cannot_announce_more_than_the_largest_message(engine):
    """Past the handshake, sizes are checked before memory is allocated: the connection is closed."""
    address = engine.workers.addresses["m1:1"]
    with socket.create_connection(address, timeout=5) as s:
        connect_handshake(s, engine.security, "engine")
        s.sendall(CHUNK_HEADER.pack(1, 0, 1 << 40, 1 << 20))
        s.settimeout(5)
        assert s.recv(1) == b""  # closed
    assert engine.security.max_message_bytes < 1 << 40
    assert all(p.is_alive() for p in engine.procs.values())
    deadline = time.monotonic() + 10  # counted by the worker, reported with its next heartbeat
    while time.monotonic() < deadline and not engine.refused_connections().get("malformed"):
        time.sleep(0.2)
    assert engine.refused_connections().get("malformed") == 1
    assert all(len(tokens) == 8 for tokens in _generate(engine))  # the worker serves on
