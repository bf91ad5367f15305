"""The one link model (hetserve.policies.links): shared resources, and two drivers — the
simulator's (simulated time) and the runtime's (wall time) — that must agree exactly."""

import pytest

from hetserve.policies.links import LinkModel
from hetserve.policies.transmission import make_transmission
from hetserve.runtime.links.clock import WallClockLinks
from hetserve.sim.events import EventLoop
from hetserve.sim.links import Network
from hetserve.specs.cluster import GBPS, cluster_from_dict

POOL = cluster_from_dict({
    "name": "two-sites",
    "machines": [{"name": "a0", "gpu": "L40", "count": 2, "site": "east"},
                 {"name": "a1", "gpu": "L40", "count": 2, "site": "east"},
                 {"name": "b0", "gpu": "L40", "count": 2, "site": "west"}],
    "network": {"intra_site": {"bandwidth_gbps": 8, "latency_ms": 1},
                "inter_site": {"bandwidth_gbps": 2, "latency_ms": 20}}})
A0, A0b, A1, B0 = 0, 1, 2, 4  # device indices: a0:0, a0:1, a1:0, b0:0
NIC = 8 * GBPS  # bytes/s
PIPE = 2 * GBPS


def run(model: LinkModel, sends) -> dict:
    """Feed ``(time, id, kind, src, dst, bytes)`` and run to the end: id -> delivery time."""
    out, pending = {}, sorted(sends)
    while pending or not model.idle:
        nxt = model.next_event_s()
        if pending and (nxt is None or pending[0][0] <= nxt):
            t, mid, kind, a, b, n = pending.pop(0)
            out.update(model.put(mid, kind, POOL.path(a, b), n, t))
        else:
            out.update(model.advance(nxt))
    return out


def test_messages_out_of_one_box_share_its_nic():
    mb = 1e6
    alone = run(LinkModel(lambda: make_transmission("fair")), [(0.0, 1, "kv", A0, A1, mb)])
    assert alone[1] == pytest.approx(0.001 + mb / NIC)  # α + bytes/β, as CostModel.p2p_time
    # a0:0 and a0:1 both send to a1: one NIC out, one NIC in -> half the rate each
    both = run(LinkModel(lambda: make_transmission("fair")),
               [(0.0, 1, "kv", A0, A1, mb), (0.0, 2, "kv", A0b, A1, mb)])
    assert both[1] == pytest.approx(0.001 + 2 * mb / NIC) == both[2]
    # serial at the sending NIC: one after the other
    serial = run(LinkModel(lambda: make_transmission("serial")),
                 [(0.0, 1, "kv", A0, A1, mb), (0.0, 2, "kv", A0b, A1, mb)])
    assert sorted(serial.values()) == pytest.approx([0.001 + mb / NIC, 0.001 + 2 * mb / NIC])
    # across sites the pipe (2 Gbit/s) is narrower than the NIC; a second sender box shares it
    cross = run(LinkModel(lambda: make_transmission("fair")),
                [(0.0, 1, "kv", A0, B0, mb), (0.0, 2, "kv", A1, B0, mb)])
    assert cross[1] == pytest.approx(0.020 + 2 * mb / PIPE) == cross[2]


def test_overhead_and_competing_penalty_parameters():
    mb = 1e6
    plain = [(0.0, 1, "kv", A0, A1, mb), (0.0, 2, "kv", A0b, A1, mb)]
    base = run(LinkModel(lambda: make_transmission("fair")), plain)
    slow = run(LinkModel(lambda: make_transmission("fair"), overhead_s=0.005, competing_penalty=0.5), plain)
    assert slow[1] == pytest.approx(0.001 + 0.005 + 2 * mb / (NIC / 1.5))
    assert slow[1] > base[1]
    # one message alone pays the overhead only
    one = run(LinkModel(lambda: make_transmission("fair"), overhead_s=0.005, competing_penalty=0.5), plain[:1])
    assert one[1] == pytest.approx(0.001 + 0.005 + mb / NIC)


SEQUENCE = [  # (time, id, kind, src, dst, bytes): KV, activations and decode traffic crossing NICs and the pipe
    (0.000, 1, "kv", A0, B0, 4e6), (0.000, 2, "prefill", A0b, A1, 2e6), (0.001, 3, "decode", A0, A1, 2e3),
    (0.002, 4, "kv", A1, B0, 3e6), (0.004, 5, "decode", A0b, B0, 1e3), (0.010, 6, "prefill", B0, A0, 1e6),
    (0.011, 7, "kv", A0, A1, 5e5), (0.030, 8, "decode", A1, A0, 500), (0.031, 9, "kv", A0b, B0, 1e6),
]


def _sim_driver(policy: str) -> dict:
    loop = EventLoop()
    net = Network(POOL.latency, POOL.bandwidth, lambda: make_transmission(policy), loop, paths=POOL.path)
    done = {}
    for t, mid, kind, a, b, n in SEQUENCE:
        loop.schedule(t, 1, lambda _, mid=mid, kind=kind, a=a, b=b, n=n:
                      net.send(kind, [(a, b, n)], lambda _s, mid=mid: done.__setitem__(mid, loop.now)))
    loop.run()
    return done


def _wall_driver(policy: str) -> dict:
    clock = [0.0]
    # the same inputs as the simulator's: no decode predictor (the simulator has none here either)
    drv = WallClockLinks(lambda: make_transmission(policy), clock=lambda: clock[0], thread=False, predict_decode=False)
    done = {}

    def until(t):
        while (w := drv.next_wake_s()) is not None and w <= t:
            clock[0] = w
            for due, fn in drv.poll(w):
                fn()

    for t, mid, kind, a, b, n in SEQUENCE:
        until(t)
        clock[0] = t
        drv.send((POOL.devices[a].name, POOL.devices[b].name), POOL.path(a, b), n, kind,
                 lambda mid=mid: done.__setitem__(mid, clock[0]))
    until(float("inf"))
    return done


@pytest.mark.parametrize("policy", ["fair", "serial", "molink"])
def test_simulator_and_runtime_drivers_agree(policy):
    sim, wall = _sim_driver(policy), _wall_driver(policy)
    assert sorted(sim, key=lambda m: (sim[m], m)) == sorted(wall, key=lambda m: (wall[m], m))
    assert wall == pytest.approx(sim, rel=1e-9, abs=1e-12)
    assert len(sim) == len(SEQUENCE)
