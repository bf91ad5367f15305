"""Link sharing: Allocation semantics (sequential vs concurrent), re-asking, delivery latency.

The policies here are defined in the test so the link entity is checked against the protocol
alone, not against one implementation of it.
"""

import pytest

from hetserve.policies.base import Allocation, Send
from hetserve.sim.events import EventLoop
from hetserve.sim.links import Network

import numpy as np

BW, LAT = 1e9, 0.01


class Serial:
    name = "serial-test"

    def schedule(self, pending, link, now, next_decode_in_s=None):
        order = sorted(pending, key=lambda t: (t.enqueued_s, t.id))
        return Allocation(tuple(Send(t.id, t.remaining_bytes) for t in order))


class Fair:
    name = "fair-test"

    def schedule(self, pending, link, now, next_decode_in_s=None):
        return Allocation(tuple(Send(t.id, t.remaining_bytes) for t in pending), concurrent=True)


class DecodeFirstChunks:
    """Decode messages whole and first; bulk in 1 MB chunks (a toy MoLink)."""
    name = "chunks-test"

    def __init__(self):
        self.calls = 0

    def schedule(self, pending, link, now, next_decode_in_s=None):
        self.calls += 1
        dec = [t for t in pending if t.kind == "decode"]
        if dec:
            return Allocation((Send(dec[0].id, dec[0].remaining_bytes),))
        t = min(pending, key=lambda t: t.id)
        return Allocation((Send(t.id, min(1e6, t.remaining_bytes)),))


def net(policy):
    loop = EventLoop()
    lat = np.array([[0, LAT], [LAT, 0]])
    bw = np.array([[np.inf, BW], [BW, np.inf]])
    return loop, Network(lat, bw, lambda: policy, loop)


def send_at(loop, network, t, kind, nbytes, done, name):
    loop.schedule(t, 1, lambda _: network.send(kind, [(0, 1, nbytes)], lambda s: done.__setitem__(name, loop.now)))


def test_alone_is_alpha_plus_bytes_over_beta():
    done = {}
    loop, n = net(Fair())
    send_at(loop, n, 0.0, "kv", 5e8, done, "a")
    loop.run()
    assert done["a"] == pytest.approx(LAT + 0.5)


def test_serial_queues_and_fair_shares():
    for policy, expect in ((Serial(), {"a": LAT + 1.0, "b": LAT + 2.0}), (Fair(), {"a": LAT + 2.0, "b": LAT + 2.0})):
        done = {}
        loop, n = net(policy)
        send_at(loop, n, 0.0, "kv", 1e9, done, "a")
        send_at(loop, n, 0.0, "kv", 1e9, done, "b")
        loop.run()
        assert done == pytest.approx(expect)


def test_fair_rebalances_when_a_transfer_arrives_mid_way():
    done = {}
    loop, n = net(Fair())
    send_at(loop, n, 0.0, "kv", 1e9, done, "a")  # alone for 0.5 s (half sent), then shares
    send_at(loop, n, 0.5, "kv", 2e8, done, "b")  # 0.2 GB at half speed: 0.4 s
    loop.run()
    assert done["b"] == pytest.approx(0.9 + LAT)
    assert done["a"] == pytest.approx(1.2 + LAT)  # 0.5 + 0.4 (shared) + 0.3 (alone)


def test_sequential_send_is_not_preempted_but_chunks_let_decode_through():
    # serial: a decode message behind a 1 GB KV waits for all of it
    done = {}
    loop, n = net(Serial())
    send_at(loop, n, 0.0, "kv", 1e9, done, "kv")
    send_at(loop, n, 0.1, "decode", 1e3, done, "dec")
    loop.run()
    assert done["dec"] == pytest.approx(1.0 + 1e-6 + LAT)
    # decode-first with 1 MB chunks: it waits at most one chunk (1 ms)
    done = {}
    policy = DecodeFirstChunks()
    loop, n = net(policy)
    send_at(loop, n, 0.0, "kv", 1e9, done, "kv")
    send_at(loop, n, 0.1, "decode", 1e3, done, "dec")
    loop.run()
    assert 0.1 + LAT < done["dec"] <= 0.1 + 1e-3 + 1e-6 + LAT + 1e-12
    assert done["kv"] == pytest.approx(1.0 + 1e-6 + LAT)  # nothing lost: the link never idles
    assert policy.calls >= 1000  # re-asked after every chunk


def test_transfer_over_several_links_completes_with_the_last_part():
    loop = EventLoop()
    lat = np.zeros((3, 3))
    bw = np.full((3, 3), 1e9)
    n = Network(lat, bw, Fair, loop)
    seen = []
    loop.schedule(0.0, 1, lambda _: n.send("kv", [(0, 1, 1e8), (0, 2, 3e8), (0, 1, 1e8)], lambda s: seen.append(loop.now)))
    loop.run()
    assert seen == [pytest.approx(0.3)]  # (0,1) carries 0.2 GB merged, (0,2) 0.3 GB: the slower decides


def test_a_policy_that_sends_nothing_is_reported():
    class Idle:
        name = "idle"

        def schedule(self, pending, link, now, next_decode_in_s=None):
            return Allocation(())

    loop, n = net(Idle())
    loop.schedule(0.0, 1, lambda _: n.send("kv", [(0, 1, 10.0)], lambda s: None))
    with pytest.raises(ValueError, match="sent nothing"):
        loop.run()


def test_fair_sharing_far_from_time_zero_makes_progress():
    """Residual bytes must not shrink below the clock's resolution and stall the link (regression)."""
    done = {}
    loop, n = net(Fair())
    sizes = {"a": 1e9 / 3, "b": 1e9 / 7, "c": 1e9 / 11, "d": 123456.789}
    for i, (name, size) in enumerate(sizes.items()):
        send_at(loop, n, 1e7 + i * 1e-4, "kv", size, done, name)
    loop.run()
    assert set(done) == set(sizes)
    assert max(done.values()) == pytest.approx(1e7 + sum(sizes.values()) / BW + LAT, abs=1e-6)
    assert loop.events < 100
