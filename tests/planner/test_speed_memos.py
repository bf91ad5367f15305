"""The memos that make large searches cheaper must price exactly what the cost model prices:

* stage prices in the layout search (``cost.memo.MemoCost``) are shared between stages on
  different machines only when the formulas read the same of them — same GPUs, memory and links
  inside the TP group;
* KV hand-off times (``PlanContext.kv_capacity``) are shared between pairs of replicas only when
  their transfers have the same shape — bytes, latencies and the bandwidth of every resource
  they cross, shared the same way;
* the colocated cut of a device set (``mixing._colocated_cut``) is shared between device sets of
  the same classes and counts, moved onto their devices.
"""

import itertools

from hetserve.cost.layout import ReplicaLayout, StageLayout
from hetserve.planner import PlanOptions
from hetserve.planner.context import PlanContext
from hetserve.planner.layout.search import LayoutSearch
from hetserve.specs.cluster import cluster_from_dict


def _pool():
    """A100 boxes that differ only in their in-box link or their memory, one L40 box, and three
    sites whose pipes differ only in bandwidth (a–b, b–c) or only in latency (a–b, a–c): each
    memo's key must tell them apart."""
    return cluster_from_dict({
        "name": "memo-keys",
        "machines": [
            {"name": "nv", "gpu": "A100-SXM-80G", "count": 4, "site": "a"},
            {"name": "pcie", "gpu": "A100-SXM-80G", "count": 4, "site": "a",
             "intra": {"bandwidth_gbps": 64, "latency_ms": 0.05}},
            {"name": "small", "gpu": "A100-SXM-80G", "count": 4, "site": "b", "memory_gb": 40},
            {"name": "l40", "gpu": "L40", "count": 4, "site": "b"},
            {"name": "far", "gpu": "A100-SXM-80G", "count": 4, "site": "c"}],
        "network": {"intra_site": {"bandwidth_gbps": 100, "latency_ms": 0.2},
                    "inter_site": {"bandwidth_gbps": 3, "latency_ms": 15},
                    "links": [{"between": ["b", "c"], "bandwidth_gbps": 12, "latency_ms": 15},
                              {"between": ["a", "c"], "bandwidth_gbps": 3, "latency_ms": 40}]},
    })


def _layouts(cluster, machine: str, num_layers: int):
    """Pipelines on one machine's GPUs: 1–2 stages of TP 1, 2 or 4, several layer splits."""
    devs = [d.index for d in cluster.devices if d.machine == machine]
    out = [ReplicaLayout((StageLayout(tuple(devs[:tp]), (0, num_layers)),)) for tp in (1, 2, 4)]
    for tp, cut in itertools.product((1, 2), (num_layers // 3, num_layers // 2)):
        out.append(ReplicaLayout((StageLayout(tuple(devs[:tp]), (0, cut)),
                                  StageLayout(tuple(devs[tp:2 * tp]), (cut, num_layers)))))
    return out


def test_stage_memo_prices_every_layout_as_the_cost_model(llama7b, azure):
    cluster = _pool()
    ctx = PlanContext(cluster, llama7b, azure, PlanOptions())
    memo = ctx.layouts  # its stage prices are memoised
    plain = LayoutSearch(ctx)
    plain.cost = ctx.cost  # the cost model itself
    checked = 0
    # the NVLink box first, so a key that ignored links or memory would hand its prices on
    for machine in ("nv", "pcie", "small", "l40", "far"):
        for layout in _layouts(cluster, machine, llama7b.num_layers):
            for role in ("prefill", "decode", "colocated"):
                want = plain.layout_capacity(layout, role)
                assert memo.layout_capacity(layout, role) == want, (machine, layout, role)
                checked += want > 0
    assert checked > 40
    assert memo.cost._prefill  # the memo was used


def test_kv_time_memo_matches_the_cost_model_for_every_pair(llama7b, azure):
    cluster = _pool()
    ctx = PlanContext(cluster, llama7b, azure, PlanOptions())
    layouts = {m: _layouts(cluster, m, llama7b.num_layers)[:4] for m in ("nv", "pcie", "small", "l40", "far")}
    # pipelines across two boxes: their transfers leave (or enter) through two NICs, not one
    L = llama7b.num_layers
    by = {m: [d.index for d in cluster.devices if d.machine == m] for m in layouts}
    for a, b in (("nv", "pcie"), ("small", "l40"), ("pcie", "far")):
        for tp in (1, 2):
            layouts[a + "+" + b] = [ReplicaLayout((StageLayout(tuple(by[a][:tp]), (0, L // 2)),
                                                   StageLayout(tuple(by[b][:tp]), (L // 2, L))))]
    seen = 0
    # same-site and cross-site pairs over the three pipes: the shapes repeat across machine
    # pairs, the bandwidths and latencies along them do not
    for (ma, src), (mb, dst) in itertools.product(
            [(m, lay) for m, lays in layouts.items() for lay in lays], repeat=2):
        if set(ma.split("+")) & set(mb.split("+")):
            continue
        want = ctx.period_s / ctx.cost.kv_transfer_time(src, dst, ctx.input_tokens)
        assert ctx.kv_capacity(src, dst) == want, (ma, mb, src, dst)
        # the loads come from the same transfers (``PlanContext._kv_pair``), bit for bit
        raw = ctx.cost.kv_resource_bytes(src, dst, ctx.input_tokens)
        assert ctx.kv_load(src, dst) == {r.name: b for r, b in raw.items() if r.name in ctx.resources}
        seen += 1
    assert seen > 100
    assert len(ctx._kv_time_cache) < seen  # shapes were shared


def test_colocated_cut_memo_gives_each_device_set_its_fresh_cut(llama70b, azure):
    from hetserve.planner.search.mixing import _colocated_cut, _colocated_cut_fresh
    from hetserve.planner.pool.evaluator import Evaluator

    cluster = _pool()
    ctx = PlanContext(cluster, llama70b, azure, PlanOptions())
    ev = Evaluator(ctx)
    by = {m: [d.index for d in cluster.devices if d.machine == m] for m in ("nv", "pcie", "small", "l40", "far")}
    sets = []
    for a, b in itertools.combinations(by, 2):
        for na, nb in ((2, 2), (3, 1), (4, 3)):
            # the first and the last devices of each box: one composition, other devices
            sets.append(tuple(sorted(by[a][:na] + by[b][:nb])))
            sets.append(tuple(sorted(by[a][-na:] + by[b][-nb:])))
    sets.append(tuple(range(ctx.num_devices)))  # past the knapsack's size: halved, recursively
    served = 0
    for devices in sets:
        got = sorted(tuple(sorted(ds)) for ds in _colocated_cut(ctx, ev, devices))
        want = sorted(tuple(sorted(ds)) for ds in
                      _colocated_cut_fresh(ctx, Evaluator(ctx), devices, ctx.composition(devices)))
        assert got == want, devices
        assert {d for ds in got for d in ds} <= set(devices)
        served += bool(got)
    assert served > len(sets) // 2
    assert len(ev.colocated_cuts) < len(sets)  # the memo was hit
