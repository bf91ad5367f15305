"""Shaped links and the transmission scheduler in the data path (hetserve.runtime.links.network).

``LinkSchedule`` is driven with an explicit clock (exact times); ``ShapedLink`` and the transport
adapter run in real time, so those tests check only delivery order, never durations.
"""

from __future__ import annotations

import math
import threading

import pytest

from hetserve.policies.transmission import make_transmission
from hetserve.runtime.links.factory import LinkSchedulerFactory, merge_stats
from hetserve.runtime.links.clock import DecodeArrivalPredictor, LinkSchedule
from hetserve.runtime.links.network import LinkNetwork, LinkStats, ShapedLink
from hetserve.specs.cluster import load_cluster

BW = 12.5e6  # 100 Mbit/s in bytes/s
LAT = 0.030


def run_until_idle(s: LinkSchedule, t: float = 0.0, limit: int = 100_000) -> dict[int, float]:
    """Advance a schedule event by event; returns id -> delivery time."""
    out: dict[int, float] = {}
    for _ in range(limit):
        nxt = s.next_event_s()
        if nxt is None:
            return out
        out.update(s.advance(nxt))
    raise AssertionError("schedule did not drain")


def test_one_message_takes_latency_plus_bytes_over_bandwidth():
    s = LinkSchedule(LAT, BW, make_transmission("serial"))
    assert s.put(1, "prefill", 1.25e6, now=0.0) == []
    assert run_until_idle(s) == {1: pytest.approx(LAT + 0.1)}
    assert s.bytes_sent["prefill"] == pytest.approx(1.25e6) and s.busy_s == pytest.approx(0.1)


def test_zero_byte_message_pays_only_latency():
    s = LinkSchedule(LAT, BW, make_transmission("serial"))
    assert s.put(1, "decode", 0, now=1.0) == [(1, 1.0 + LAT)]


def test_serial_decode_waits_behind_a_prefill():
    s = LinkSchedule(LAT, BW, make_transmission("serial"))
    s.put(1, "prefill", 1.25e6, now=0.0)  # 100 ms on the wire
    s.advance(0.01)
    s.put(2, "decode", 1000, now=0.01)
    done = run_until_idle(s)
    assert done[1] == pytest.approx(0.1 + LAT)
    assert done[2] == pytest.approx(0.1 + 1000 / BW + LAT)
    assert s.queueing_s["decode"] == pytest.approx(0.09)


def test_fair_shares_the_link_and_keeps_per_kind_order_out_of_the_schedule():
    s = LinkSchedule(0.0, 1000.0, make_transmission("fair"))
    s.put(1, "prefill", 1000, now=0.0)
    s.put(2, "decode", 500, now=0.0)
    done = run_until_idle(s)
    assert done[2] == pytest.approx(1.0)  # half the link each: 500 bytes in 1 s
    assert done[1] == pytest.approx(1.5)  # then the whole link for the last 500


def test_molink_decode_overtakes_a_chunked_prefill():
    s = LinkSchedule(LAT, BW, make_transmission("molink"), next_decode_in=lambda now: 0.0)
    s.put(1, "prefill", 1.25e6, now=0.0)  # sent in chunks of min_chunk_s (2 ms) of link time
    s.advance(0.0101)
    s.put(2, "decode", 1000, now=0.0101)
    done = run_until_idle(s)
    chunk_end = math.ceil(0.0101 / 0.002) * 0.002  # the chunk on the wire is not pre-empted
    assert done[2] == pytest.approx(chunk_end + 1000 / BW + LAT, abs=1e-6)
    assert done[1] == pytest.approx(0.1 + 1000 / BW + LAT, abs=1e-6)  # prefill loses only the decode's bytes
    assert s.bytes_sent["prefill"] == pytest.approx(1.25e6)


def test_molink_anti_starvation_sends_prefill_under_a_stream_of_decodes():
    pol = make_transmission("molink", max_wait=3)
    s = LinkSchedule(0.0, 1000.0, pol, next_decode_in=lambda now: 0.0)
    s.put(100, "prefill", 50, now=0.0)
    t, mid = 0.0, 0
    # keep a decode message queued at every decision: prefill still progresses
    for _ in range(200):
        mid += 1
        s.put(mid, "decode", 1, now=t)
        nxt = s.next_event_s()
        done = dict(s.advance(nxt))
        t = nxt
        if 100 in done:
            break
    assert 100 in done


def test_decode_arrival_predictor():
    p = DecodeArrivalPredictor()
    assert p(0.0) == 0.0
    for t in (0.0, 0.1, 0.25):
        p.observe(t)
    assert p(0.3) == pytest.approx(0.05)  # last + min gap - now
    assert p(1.0) == 0.0  # overdue
    assert p(10.0) == 0.0  # history too old


def _collect_order(link: ShapedLink, sends: list[tuple[str, float, str]], timeout_s: float = 10.0) -> list[str]:
    order: list[str] = []
    done = threading.Event()

    def deliver(tag: str):
        def fn():
            order.append(tag)
            if len(order) == len(sends):
                done.set()
        return fn

    for tag, nbytes, kind in sends:
        link.send(nbytes, kind, deliver(tag))
    assert done.wait(timeout_s), f"only {order} delivered"
    link.close()
    return order


@pytest.mark.parametrize("policy, expected", [("serial", ["p", "d"]), ("molink", ["d", "p"])])
def test_shaped_link_real_time_order(policy, expected):
    link = ShapedLink("a:0", "b:0", 0.001, 1e6, make_transmission(policy))
    assert _collect_order(link, [("p", 3e5, "prefill"), ("d", 100, "decode")]) == expected
    st = link.stats()
    assert st.bytes_sent["prefill"] == pytest.approx(3e5) and st.messages["decode"] == 1


def test_shaped_link_keeps_order_within_a_kind_under_fair_sharing():
    link = ShapedLink("a:0", "b:0", 0.0, 1e6, make_transmission("fair"))
    assert _collect_order(link, [("big", 2e5, "prefill"), ("small", 10, "prefill"), ("d", 10, "decode")]) == \
        ["d", "big", "small"]


def test_link_network_uses_the_cluster_pair_and_counts_unshaped_links():
    cluster = load_cluster("molink-3x4090")
    net = LinkNetwork(cluster, policy="molink", shape=True)
    link = net.link("pc0:0", "pc1:0")
    assert link.path.latency_s == pytest.approx(0.030) and link.path.bandwidth == pytest.approx(BW)
    got = threading.Event()
    net.send("pc0:0", "pc1:0", 10, "decode", got.set)
    assert got.wait(5)
    flat = LinkNetwork(cluster, policy="serial", shape=False)
    hit = []
    flat.send("pc0:0", "pc1:0", 123, "kv", lambda: hit.append(1))
    assert hit == [1] and flat.stats()[0].bytes_sent["kv"] == 123
    merged = merge_stats([net.stats(), [LinkStats.from_dict(net.stats()[0].to_dict())]])
    assert merged[0].messages["decode"] == 2
    net.close()
    with pytest.raises(ValueError, match="unknown transmission policy"):
        LinkNetwork(cluster, policy="nope")


def test_transport_hook_reorders_by_class_over_real_sockets():
    """The engine's SocketTransport with the picklable factory in its ``scheduler_factory`` hook."""
    import pickle
    import time

    import torch
    from hetserve.runtime.workers.auth import LinkSecurity
    from hetserve.runtime.workers.transport import Priority, SocketTransport
    from hetserve.runtime.workers.wire import Message

    cluster = load_cluster("molink-3x4090")
    security = LinkSecurity.fresh()

    def order(policy: str) -> tuple[list[str], float]:
        # 50 Mbit/s, 60 ms; a copy through pickle, as a worker process gets it
        factory = pickle.loads(pickle.dumps(LinkSchedulerFactory(cluster, policy, time_scale=0.5)))
        a = SocketTransport("pc0:0", security, scheduler_factory=factory)
        b = SocketTransport("pc1:0", security, scheduler_factory=factory)
        try:
            a.set_address("pc1:0", b.address)
            t0 = time.monotonic()
            a.send("pc1:0", Message("step", {"tag": "prefill"}, {"x": torch.zeros(250_000)}), Priority.PREFILL)  # 1 MB
            a.send("pc1:0", Message("step", {"tag": "decode"}, {"x": torch.zeros(64)}), Priority.DECODE)
            gap = time.monotonic() - t0
            got = [b.recv(timeout=10) for _ in range(2)]
            assert all(m is not None for m in got)
            st = {(s.src, s.dst): s for s in factory.process_stats()}[("pc0:0", "pc1:0")]
            assert st.bytes_sent["prefill"] > 1e6 and st.messages["decode"] == 1
            return [m.meta["tag"] for m in got], gap
        finally:
            a.close()
            b.close()
            factory.close()

    orders = {}
    for policy in ("serial", "molink"):
        # the decode can only overtake if it reaches the link while the prefill is on the emulated wire
        # (160 ms for 1 MB at 6.25 MB/s): a round whose sends were further apart proves nothing, run it again
        for _ in range(3):
            orders[policy], gap = order(policy)
            if gap < 0.1:
                break
    assert orders == {"serial": ["prefill", "decode"], "molink": ["decode", "prefill"]}
