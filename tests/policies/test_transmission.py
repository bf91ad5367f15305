"""Transmission policies on one link: each test would fail if the policy were plain FIFO."""

import math

import pytest

from hetserve.policies.base import DecodeTiming, LinkInfo, TransferView
from hetserve.policies.transmission import (
    TRANSMISSION_POLICIES, FairTransmission, MoLinkTransmission, SerialTransmission, available_time,
    choose_micro_batches, emulate_pipeline, make_transmission, round_trip_time)

MBPS100 = 100e6 / 8  # bytes/s
LINK = LinkInfo(latency_s=0.03, bandwidth=MBPS100)


def big_prefill(i=1, t=0.0):
    return TransferView(i, "prefill", 10e6, 10e6, t)


def decode(i, t):
    return TransferView(i, "decode", 8192, 8192, t)


def test_registry_names():
    assert set(TRANSMISSION_POLICIES) == {"serial", "fair", "molink"}
    assert make_transmission("molink").name == "molink"
    with pytest.raises(ValueError, match="unknown transmission"):
        make_transmission("nope")


def test_serial_is_fifo_and_whole():
    pending = [decode(2, 1.0), big_prefill(1, 0.0), decode(3, 0.5)]
    alloc = SerialTransmission().schedule(pending, LINK, 1.0)
    assert not alloc.concurrent
    assert [s.id for s in alloc.sends] == [1, 3, 2]  # by enqueue time
    assert alloc.sends[0].nbytes == 10e6  # the whole message, not a chunk


def test_fair_shares_concurrently():
    pending = [big_prefill(1, 0.0), decode(2, 1.0)]
    alloc = FairTransmission().schedule(pending, LINK, 1.0)
    assert alloc.concurrent
    assert {s.id for s in alloc.sends} == {1, 2}
    assert all(s.nbytes == p.remaining_bytes for s, p in zip(alloc.sends, pending))


def test_molink_sends_decode_queued_behind_prefill_first():
    pol = MoLinkTransmission()
    pending = [big_prefill(1, 0.0), decode(2, 0.5)]  # the decode arrived later
    alloc = pol.schedule(pending, LINK, 0.5)
    assert [s.id for s in alloc.sends] == [2]
    assert pol.wait == 1


def test_molink_counts_each_decode_win_once():
    pol = MoLinkTransmission()
    pending = [big_prefill(1, 0.0), decode(2, 0.5)]
    pol.schedule(pending, LINK, 0.5)
    pol.schedule(pending, LINK, 0.51)  # asked again while the same decode is in flight
    assert pol.wait == 1


def test_molink_anti_starvation_serves_prefill_after_n_decode_wins():
    pol = MoLinkTransmission(max_wait=30)
    prefill = big_prefill(1, 0.0)
    for k in range(30):
        alloc = pol.schedule([prefill, decode(100 + k, 1.0 + k)], LINK, 1.0 + k)
        assert alloc.sends[0].id == 100 + k
    # the 31st decision goes to the starving prefill, whole, although a decode is waiting
    alloc = pol.schedule([prefill, decode(200, 40.0)], LINK, 40.0)
    assert alloc.sends[0].id == 1
    assert alloc.sends[0].nbytes == prefill.remaining_bytes
    assert pol.wait == 0


def test_molink_chunks_bulk_to_the_decode_window():
    pol = MoLinkTransmission()
    alloc = pol.schedule([big_prefill()], LINK, 0.0, next_decode_in_s=0.1)
    assert alloc.sends[0].nbytes == pytest.approx(0.1 * MBPS100)
    assert alloc.sends[0].nbytes < 10e6  # a chunk, not the whole 10 MB


def test_molink_chunk_never_below_floor():
    pol = MoLinkTransmission(min_chunk_s=0.002)
    alloc = pol.schedule([big_prefill()], LINK, 0.0, next_decode_in_s=0.0)
    assert alloc.sends[0].nbytes == pytest.approx(0.002 * MBPS100)


def test_available_time_three_cases():
    # case 1: a decode batch starts exactly now -> T_a = T_d
    w = available_time(5.0, DecodeTiming(exec_start_s=5.0, exec_duration_s=0.2))
    assert (w.case, w.available_s) == (1, pytest.approx(0.2))
    # case 2: started 0.05 s ago -> T_a = t_s + T_d - t_c
    w = available_time(5.05, DecodeTiming(exec_start_s=5.0, exec_duration_s=0.2))
    assert (w.case, w.available_s) == (2, pytest.approx(0.15))
    # case 3: nothing executing; B1 returns at t_p + T_o + T_m
    w = available_time(5.3, DecodeTiming(exec_start_s=None, iteration_first_done_s=5.1, round_trip_s=0.6))
    assert (w.case, w.available_s) == (3, pytest.approx(0.4))
    assert w.available_s > 0.2  # larger than case 1, as the paper says


def test_molink_chunk_follows_the_case():
    sizes = []
    for timing, now in [(DecodeTiming(5.0, 0.2), 5.0), (DecodeTiming(5.0, 0.2), 5.05),
                        (DecodeTiming(None, 0.0, 5.1, 0.6), 5.3)]:
        pol = MoLinkTransmission()
        link = LinkInfo(0.03, MBPS100, decode=timing)
        sizes.append(pol.schedule([big_prefill()], link, now).sends[0].nbytes)
    assert sizes == [pytest.approx(0.2 * MBPS100), pytest.approx(0.15 * MBPS100), pytest.approx(0.4 * MBPS100)]


def test_round_trip_formula():
    # 3 servers, 10 ms compute each, 30 ms per hop, 100 Mbps; 4 tokens of 8 KiB activations, 2 B ids
    t = round_trip_time([0.01] * 3, [0.03] * 3, [MBPS100] * 3, 8192, 2, 4)
    expect = 0.03 + 0.09 + 2 * 8192 * 4 / MBPS100 + 2 * 4 / MBPS100
    assert t == pytest.approx(expect)


def test_micro_batches_searched_in_n_to_2n_and_more_help_on_slow_links():
    stage = [lambda b: 0.010 + 0.0005 * b] * 3
    slow = choose_micro_batches(32, stage, [0.03] * 3, [MBPS100] * 3, act_bytes_per_seq=8192)
    assert [m for m, _ in slow.table] == [3, 4, 5, 6]
    assert 3 <= slow.micro_batches <= 6
    assert slow.micro_batches > 3  # 30 ms hops leave bubbles that extra micro-batches fill
    assert slow.tokens_per_s > dict(slow.table)[3]
    # an ideal network: m = N already keeps every server busy; extra micro-batches only add overhead
    fast = choose_micro_batches(32, stage, [0.0] * 3, [1e15] * 3, act_bytes_per_seq=8192)
    assert fast.micro_batches == 3


def test_emulated_pipeline_matches_hand_count():
    # one server, no network: each iteration is one stage time at the full batch
    tps = emulate_pipeline(8, 1, [lambda b: 0.1], [0.0], [math.inf], 0, 0, iterations=4)
    assert tps == pytest.approx(8 / 0.1)
