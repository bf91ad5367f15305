"""The memo of KV hand-off prices by pair kind (``planner.kv_pairs``) must give every pair what
pricing its own transfers gives — capacity bit for bit, loads on the same resources in the same
order — on a pool where machines of one GPU type differ in NIC, in-box link, site and pipe, and
one machine pair has a dedicated link; and pairs of one kind on other machines must hit it."""

import random

from hetserve.cost.layout import ReplicaLayout, StageLayout
from hetserve.planner import PlanOptions
from hetserve.planner.context import PlanContext
from hetserve.specs.cluster import cluster_from_dict


def _pool():
    machines = []
    for site in ("a", "b", "c", "d"):
        for i in range(3):
            machines.append({"name": f"{site}{i}", "gpu": "A100-SXM-80G", "count": 4, "site": site})
    machines[1]["nic"] = {"bandwidth_gbps": 25, "latency_ms": 0.3}  # one slower NIC in site a
    machines[4]["intra"] = {"bandwidth_gbps": 64, "latency_ms": 0.05}  # one PCIe box in site b
    return cluster_from_dict({
        "name": "kv-kinds", "machines": machines,
        "network": {"intra_site": {"bandwidth_gbps": 100, "latency_ms": 0.2},
                    "inter_site": {"bandwidth_gbps": 3, "latency_ms": 15},
                    "links": [{"between": ["a", "b"], "bandwidth_gbps": 12, "latency_ms": 15},
                              {"between": ["c0", "d0"], "bandwidth_gbps": 40, "latency_ms": 2}]},
    })


def _layout(rng: random.Random, by_machine: dict[str, list[int]], num_layers: int, taken: set[int]) -> ReplicaLayout:
    """One or two stages of TP 1, 2 or 4 on one or two random machines (devices not in ``taken``)."""
    stages, cut = [], rng.choice((num_layers, num_layers // 3))
    for layers in ((0, cut), (cut, num_layers)) if cut < num_layers else ((0, num_layers),):
        free = [ds for ds in by_machine.values() if len(set(ds) - taken) >= 4]
        devs = sorted(set(rng.choice(free)) - taken)[:rng.choice((1, 2, 4))]
        taken.update(devs)
        stages.append(StageLayout(tuple(devs), layers))
    return ReplicaLayout(tuple(stages))


def test_pair_kinds_price_as_their_transfers(llama7b, azure):
    cluster = _pool()
    ctx = PlanContext(cluster, llama7b, azure, PlanOptions())
    by_machine: dict[str, list[int]] = {}
    for d in cluster.devices:
        by_machine.setdefault(d.machine, []).append(d.index)
    rng, kinds, checked = random.Random(0), ctx._kv_kinds, 0
    for _ in range(1500):
        taken: set[int] = set()
        src = _layout(rng, by_machine, llama7b.num_layers, taken)
        dst = _layout(rng, by_machine, llama7b.num_layers, taken)
        want = ctx._kv_priced(src, dst)
        got = kinds.price(src, dst, lambda: ctx._kv_priced(src, dst))
        assert got[0] == want[0], (src, dst)
        assert list(got[1].items()) == list(want[1].items()), (src, dst)
        checked += 1
    assert len(kinds._memo) < checked * 3 // 4  # many pairs were of a kind already priced
