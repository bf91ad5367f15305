"""The device channel between workers (``runtime/workers/device_channel.py``) on CPU, over gloo.

Two processes move activations and KV pieces through a pair's group and get bit-identical tensors;
a header that disagrees with what the receiver expects is refused before anything is allocated and
the message arrives once, by socket; a peer killed mid-transfer makes the receiver give up within
the channel's timeout; a transfer never acknowledged goes by socket; which pairs get which channel.
The engine over channels, every plan shape and its faults: ``test_channel_engine.py``.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
import torch.multiprocessing as mp

from hetserve.runtime.workers.auth import LinkSecurity
from hetserve.runtime.workers.channel_pairs import ChannelPeer, channel_pairs
from hetserve.runtime.workers.device_channel import ACK, DeviceChannel
from hetserve.runtime.workers.rendezvous import BoundStore
from hetserve.runtime.workers.transport import InProcHub, Priority, SocketTransport
from hetserve.runtime.workers.wire import Message
from tests.runtime import channel_peer
from tests.runtime.channel_peer import GROUP, HIDDEN, expectations, payloads

SECRET = b"c" * 32
TIMEOUT_S = 3.0


class Pair:
    """This process as worker "b", the other end ("a", ``channel_peer.peer_main``) in a child process."""

    def __init__(self, scenario: str, timeout_s: float = TIMEOUT_S, seen_step: threading.Event | None = None):
        self.store = BoundStore("127.0.0.1")
        self.transport = SocketTransport("b", LinkSecurity(SECRET))
        self.channel = DeviceChannel(self.transport, (ChannelPeer("a", "gloo", GROUP, 1),), "cpu",
                                     timeout_s=timeout_s)
        self.channel.expect.update(expectations())
        if seen_step is not None:  # set before the peer starts: its header may come at once
            rule = self.channel.expect["step"]
            self.channel.expect["step"] = lambda meta: (seen_step.set(), rule(meta))[1]
        ctx = mp.get_context("spawn")
        self.proc = ctx.Process(target=channel_peer.peer_main, daemon=True,
                                args=(SECRET, self.store.address, self.transport.address, scenario, timeout_s))
        self.proc.start()
        ready = self.transport.recv(timeout=60)
        assert ready is not None and ready.kind == "ready", ready
        self.transport.set_address("a", tuple(ready.meta["address"]))
        self.channel.connect(self.store.address, "127.0.0.1")

    def close(self) -> None:
        self.channel.close()
        self.transport.close()
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)
        self.store.close()


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_gloo_channel_moves_activations_and_kv_bit_identical_and_a_refused_header_goes_by_socket():
    pair = Pair("payloads")
    try:
        sent = payloads()
        got = [pair.transport.recv(timeout=30) for _ in range(len(sent) + 2)]
        assert all(m is not None for m in got), got
        for (kind, meta, tensors, _), m in zip(sent, got):
            assert m.kind == kind and m.meta == {k: list(v) if isinstance(v, tuple) else v for k, v in meta.items()}
            assert set(m.tensors) == set(tensors) and all(_same_bits(m.tensors[n], t) for n, t in tensors.items())
        stats = pair.channel.stats()
        assert stats["channel_in_transfers"] == len(sent)  # every one of them came by the channel
        # the lying header (6 rows where its metadata says 5) was refused, then the socket brought it, once
        lie, after = got[len(sent):]
        assert lie.meta.get("lie") and lie.tensors["hidden"].shape == (6, HIDDEN) and "dc_resend" not in lie.meta
        assert after.meta.get("after") and torch.equal(after.tensors["hidden"], torch.zeros(2, HIDDEN))
        assert stats["refused"] == 1 and pair.transport.recv(timeout=0.3) is None
        pair.transport.send("a", Message("shutdown"))
        report = pair.transport.recv(timeout=30)
        assert report.kind == "result"
        sender = report.meta["stats"]
        assert sender["channel_transfers"] == len(sent) + 1 and sender["resent"] == 1
        assert sender["socket_transfers"] == 1 and sender["failed"] == 1  # later transfers by socket
    finally:
        pair.close()


def test_a_peer_killed_mid_transfer_fails_the_receive_within_the_timeout():
    receiving = threading.Event()
    pair = Pair("header_then_die", seen_step=receiving)
    try:
        assert receiving.wait(30), "the header never came"
        os.kill(pair.proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        while not pair.channel.stats().get("failed") and time.monotonic() - killed < 3 * TIMEOUT_S + 10:
            time.sleep(0.01)
        assert pair.channel.stats().get("failed") == 1, "the receive is still waiting"
        assert time.monotonic() - killed < 3 * TIMEOUT_S + 5  # the timeout with a loaded machine's slack, never a hang
        left = pair.transport.recv(timeout=0.2)  # nothing half-received is delivered (the nack finds no peer)
        assert left is None or left.kind == "link_error", left
        assert pair.channel.links["a"].broken
    finally:
        pair.close()


# ----------------------------------------------------------------------------- in one process


class _Work:
    def wait(self, timeout=None):
        return True


class _SilentGroup:
    """A pair's group whose sends go nowhere: the receiver never acknowledges."""

    def send(self, tensors, dst, tag):
        return _Work()


def _endpoints(timeout_s: float = 5.0, max_bytes: int | None = None):
    hub = InProcHub()
    a, b = hub.endpoint("a"), hub.endpoint("b")
    ca = DeviceChannel(a, (ChannelPeer("b", "gloo", GROUP, 0),), "cpu", timeout_s=timeout_s)
    cb = DeviceChannel(b, (ChannelPeer("a", "gloo", GROUP, 1),), "cpu", timeout_s=timeout_s, max_bytes=max_bytes)
    cb.expect.update(expectations())
    return a, b, ca, cb


@pytest.mark.parametrize("tensors", [
    [["hidden", "float32", [6, HIDDEN], 6 * HIDDEN * 4]],  # a row more than the metadata says
    [["hidden", "float16", [5, HIDDEN], 5 * HIDDEN * 2]],  # another dtype
    [["hidden", "float32", [1 << 40, HIDDEN], (1 << 40) * HIDDEN * 4]],  # 2^48 bytes: nothing allocated
    [["hidden", "float32", [5, HIDDEN], 7]],  # a byte count that does not fit the shape
    [["hidden", "pickle", [5, HIDDEN], 0]],  # a dtype off the list
    [],  # no tensor at all
])
def test_a_header_that_disagrees_with_the_expectation_is_refused_before_allocating(tensors):
    a, b, _, cb = _endpoints()
    acks = []
    a.receive_hook, a.on_message = None, lambda m: acks.append(m) or True  # "a" sees the raw acknowledgements
    a.send("b", Message("step", {"rows": 5, "dtype": "float32", "dc": {"seq": 0, "tensors": tensors}}))
    assert b.recv(timeout=0.05) is None and cb.stats() == {"refused": 1}
    assert [(m.kind, m.meta["seq"], m.meta["ok"]) for m in acks] == [(ACK, 0, False)]
    assert cb.links["a"].awaiting == {0}
    # the sender's socket resend is delivered, once
    a.send("b", Message("step", {"rows": 5, "dtype": "float32", "dc_resend": 0}, {"hidden": torch.ones(5, HIDDEN)}))
    a.send("b", Message("step", {"rows": 5, "dtype": "float32", "dc_resend": 0}, {"hidden": torch.ones(5, HIDDEN)}))
    got = b.recv(timeout=0.05)
    assert got is not None and got.meta == {"rows": 5, "dtype": "float32"} and b.recv(timeout=0.05) is None
    assert cb.stats() == {"refused": 1, "resends_taken": 1, "resends_dropped": 1}


def test_headers_beyond_the_deployment_bound_or_of_unexpected_kinds_are_refused():
    header = {"seq": 0, "tensors": [["hidden", "float32", [5, HIDDEN], 5 * HIDDEN * 4]]}  # 1,280 bytes
    for msg in (Message("step", {"rows": 5, "dtype": "float32", "dc": header}),
                Message("result", {"dc": header})):  # a kind that carries no tensors here
        a, b, _, cb = _endpoints(max_bytes=1000)
        a.send("b", msg)
        assert b.recv(timeout=0.05) is None and cb.stats() == {"refused": 1}


def test_a_transfer_never_acknowledged_goes_by_socket_and_so_do_later_ones():
    _, b, ca, _ = _endpoints(timeout_s=0.3)
    ca.links["b"].group = _SilentGroup()
    threading.Thread(target=ca._watch, daemon=True).start()
    b.receive_hook = None  # "b" plays a receiver that never answers
    h = torch.randn(3, HIDDEN)
    assert ca.send("b", Message("step", {"rows": 3, "dtype": "float32"}, {"hidden": h}), Priority.DECODE) == "channel"
    header = b.recv(timeout=1)
    assert header.meta["dc"]["seq"] == 0 and not header.tensors
    resent = b.recv(timeout=3)  # after the timeout, the same message by socket
    assert resent is not None and resent.meta["dc_resend"] == 0 and torch.equal(resent.tensors["hidden"], h)
    assert ca.send("b", Message("step", {"rows": 3, "dtype": "float32"}, {"hidden": h})) == "socket"
    stats = ca.stats()
    assert stats["failed"] == 1 and stats["resent"] == 1 and stats["socket_transfers"] == 1
    ca.close()


def test_a_transfer_given_up_keeps_its_channel_send_until_acknowledged_or_twice_the_timeout(monkeypatch):
    """A late receiver still gets the channel's bytes (gloo drops a send whose work is freed)."""
    import types

    from hetserve.runtime.workers import device_channel

    # the channel's clock moves only when the test moves it: a stalled test thread cannot let the
    # watch release the given-up sends before they are looked at
    now = [100.0]
    monkeypatch.setattr(device_channel, "time", types.SimpleNamespace(monotonic=lambda: now[0], sleep=time.sleep))
    _, b, ca, _ = _endpoints(timeout_s=1.0)
    ca.links["b"].group = _SilentGroup()
    threading.Thread(target=ca._watch, daemon=True).start()
    b.receive_hook = None
    for n in range(2):
        ca.send("b", Message("step", {"rows": 3, "dtype": "float32", "n": n}, {"hidden": torch.randn(3, HIDDEN)}))
    assert [b.recv(timeout=5).meta.get("dc_resend") for _ in range(2)] == [None, None]  # the headers
    now[0] = 101.1  # past the timeout: the watch breaks the link and resends both
    assert [b.recv(timeout=5).meta.get("dc_resend") for _ in range(2)] == [0, 1]
    link = ca.links["b"]
    assert sorted(link.given_up) == [0, 1] and all(works for _, works in link.given_up.values())
    ca._on_ack("b", {"seq": 0, "ok": True})  # taken late by the channel: its send is done with
    assert sorted(link.given_up) == [1]
    now[0] = 103.0  # short of twice the timeout after the break (103.1): still kept
    time.sleep(0.2)  # the watch looks every 0.05 s
    assert sorted(link.given_up) == [1]
    now[0] = 103.2  # never acknowledged: released after twice the timeout
    deadline = time.monotonic() + 10
    while link.given_up and time.monotonic() < deadline:
        time.sleep(0.02)
    assert link.given_up == {} and ca.stats()["resent"] == 2
    ca.close()


def test_a_send_during_a_break_goes_after_the_resends():
    a, b, ca, _ = _endpoints()
    ca.links["b"].group = _SilentGroup()
    b.receive_hook = None
    h = torch.randn(3, HIDDEN)
    assert ca.send("b", Message("step", {"rows": 3, "dtype": "float32", "n": 0}, {"hidden": h})) == "channel"
    queuing, carry_on = threading.Event(), threading.Event()
    send = a.send

    def slow_resend(peer, msg, priority=Priority.CONTROL):  # the break is queuing its resend
        if "dc_resend" in msg.meta:
            queuing.set()
            carry_on.wait(5)
        send(peer, msg, priority)

    a.send = slow_resend
    breaking = threading.Thread(target=ca._on_ack, args=("b", {"seq": 0, "ok": False, "error": "refused"}))
    breaking.start()
    assert queuing.wait(5)
    later = threading.Thread(target=ca.send, args=("b", Message("step", {"rows": 3, "dtype": "float32", "n": 1},
                                                                   {"hidden": h})))
    later.start()
    later.join(0.2)
    carry_on.set()
    breaking.join(5)
    later.join(5)
    got = [b.recv(timeout=1) for _ in range(3)]
    assert [m.meta.get("n") for m in got] == [0, 0, 1] and "dc_resend" in got[1].meta
    ca.close()


class _TimingOut:
    """A receive whose peer never sends: gloo's wait raises once its deadline passes."""

    def __init__(self):
        self.deadlines = []

    def recv(self, tensors, src, tag):
        group = self

        class Work:
            def wait(self, timeout=None):
                group.deadlines.append(timeout.total_seconds())
                raise RuntimeError("Timed out waiting for recv operation to complete")

        return Work()


def test_a_silent_peer_fails_the_receive_at_its_deadline():
    a, b, _, cb = _endpoints(timeout_s=0.5)
    group = cb.links["a"].group = _TimingOut()
    cb.links["a"].ready.set()
    header = {"seq": 0, "tensors": [["hidden", "float32", [4, HIDDEN], 4 * HIDDEN * 4]]}
    a.send("b", Message("step", {"rows": 4, "dtype": "float32", "dc": header}))  # InProc: b receives it here
    assert group.deadlines == [0.5] and cb.stats() == {"failed": 1}  # the wait had the channel's deadline
    assert b.recv(timeout=0.05) is None and cb.links["a"].broken


def test_channel_pairs_join_neighbouring_stages_and_kv_pairs_with_the_right_kind():
    from hetserve.runtime.layout import ReplicaSpec

    def on(replica: ReplicaSpec, device) -> ReplicaSpec:
        import dataclasses
        stages = tuple(tuple(dataclasses.replace(w, device=device(w.name)) for w in s) for s in replica.stages)
        return dataclasses.replace(replica, stages=stages)

    layout = (channel_peer.PREFILL, channel_peer.DECODE)
    pairs = channel_pairs(layout, tag="t")
    # stage leaders b -> y; prefill a (KV heads 0-1), x (2-3) -> decode b (every head), y (0-1), z (2-3)
    assert {p.peer for p in pairs["b"]} == {"a", "x", "y"} and {p.peer for p in pairs["a"]} == {"b", "y"}
    assert all(p.kind == "gloo" and p.group.startswith("channel/t/") for ps in pairs.values() for p in ps)
    assert {(p.peer, p.rank) for p in pairs["y"]} == {("a", 1), ("b", 1)} and pairs["z"] == pairs["z"][:1]
    assert channel_pairs(layout, shaped=True) == {}
    gpus = {"a": "cuda:0", "x": "cuda:1", "b": "cuda:0", "y": "cuda:1", "z": "cpu"}
    pairs = channel_pairs((on(layout[0], gpus.get), on(layout[1], gpus.get)))
    kinds = {(n, p.peer): p.kind for n, ps in pairs.items() for p in ps}
    assert kinds[("a", "b")] == "ipc" and kinds[("a", "y")] == "nccl" and ("x", "z") not in kinds
