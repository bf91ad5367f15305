"""Where Aladdin's misses come from (issue 12): the ``stalls`` section of experiment 3.

``stall_diagnosis`` runs one pool with every replica's iterations traced and every overflow
placement (no worker feasible) logged, and counts the misses that decoded through an overflow
prompt; ``section_stalls`` prints that over the trace windows for JSQ and for Aladdin with either
overflow rule, on JSQ's pool. A per-request diagnosis with its own tracing of the simulator, kept
apart from the figure sections in ``aladdin_figures.py``, which calls it.
"""

from __future__ import annotations

import numpy as np

from aladdin_setting import Setting, aladdin, trace_windows
from hetserve.capacity.simulated import attainment, run_pool
from hetserve.capacity.workers import min_workers
from hetserve.specs.workload import Workload


def stall_diagnosis(s: Setting, wl: Workload, n: int, g: int, policy) -> dict:
    """One run on ``n`` workers with every replica's iterations traced: the requests that miss
    TTFT or ATGT, how many of them decoded through a prompt that Aladdin placed as an overflow (no
    worker feasible), and how often an overflow went to the same worker as the overflow before."""
    from hetserve.capacity.simulated import build_pool
    from hetserve.policies.placement import PolicyContext, make_placement
    from hetserve.sim.simulator import SimOptions, Simulator

    pool = build_pool(s.model, s.gpu, n, g, intra=s.intra)
    over: list[tuple[int, str]] = []  # (request id, worker) of each overflow placement, in order
    if policy == "jsq":
        pol = make_placement("jsq", PolicyContext.for_plan(pool.plan, pool.cluster, s.model, slo=s.slo, cost=pool.cost))
    else:
        pol = policy(pool)
        choose = pol.choose

        def traced(request, cands, now):
            k = pol.stats["overflow"]
            x = choose(request, cands, now)
            if pol.stats["overflow"] > k:
                over.append((request.id, x))
            return x
        pol.choose = traced
    opts = SimOptions(placement=pol, slo=s.slo, kv_admission=s.kv, prefill_mode=s.prefill_mode)
    sim = Simulator(pool.plan, pool.cluster, s.model, wl, opts, pool.cost)
    for rep in sim.replicas:
        rep.trace = []  # (start, end, decoding requests, prompts) of every iteration
    res = sim.run()
    traces = {rep.id: rep.trace for rep in sim.replicas}
    overflowed = {rid for rid, _ in over}
    miss = ~(np.isfinite(res.t_finish) & (res.ttft <= s.slo.ttft_s) & (res.atgt <= s.slo.tpot_s))
    stalled = 0
    for i in np.flatnonzero(miss):
        its = traces[res.prefill_replica[i]]
        stalled += any(t[1] > res.t_first[i] and t[0] < res.t_finish[i] and (i in t[2] or not t[2])
                       and overflowed.intersection(t[3])
                       for t in its)
    return {"misses": int(miss.sum()), "ttft": int((res.ttft > s.slo.ttft_s).sum()), "stalled": stalled,
            "overflows": len(over), "repeat": sum(a[1] == b[1] for a, b in zip(over, over[1:]))}


def section_stalls(s: Setting, points: list[tuple[str, float]], g: int, windows: int) -> None:
    """Why Aladdin fell behind JSQ on the same plan (issue 12): per-request diagnosis over the
    windows for JSQ and for Aladdin with either overflow rule, on JSQ's pool."""
    print(f"### Where Aladdin's misses come from: {windows} windows of {s.requests} requests, JSQ's pool\n")
    print("| trace | rate | workers | policy | misses (TTFT) | misses that decoded through an overflow "
          "prompt | overflow placements | overflow to the same worker as the one before |")
    print("|---|---|---|---|---|---|---|---|")
    names = {"sharegpt": "ShareGPT, Poisson", "azure": "Azure conv (bursty, held out)"}
    for key, rate in points:
        wls = trace_windows(s, key, rate, windows)
        fluid = s.fluid(rate, g, "colocated")

        def jsq_ok(n):
            return np.mean([attainment(run_pool(s.model, s.gpu, wl, s.slo, "jsq", n, g, intra=s.intra,
                                                kv_admission=s.kv, prefill_mode=s.prefill_mode), s.slo)
                            for wl in wls]) >= s.target
        n = min_workers(jsq_ok, 1, fluid, 4 * fluid + 8)
        for name, pol in (("JSQ", "jsq"), ("Aladdin, overflow to the least loaded (before)",
                                           aladdin(s.slo, overflow="least_loaded")),
                          ("Aladdin, overflow to the least overdraft of (d) (now)", aladdin(s.slo))):
            tot: dict[str, int] = {}
            for wl in wls:
                for k, v in stall_diagnosis(s, wl, n, g, pol).items():
                    tot[k] = tot.get(k, 0) + v
            over = f"{tot['overflows']}" if pol != "jsq" else "—"
            rep = f"{tot['repeat']} ({100 * tot['repeat'] / max(1, tot['overflows'] - len(wls)):.0f}%)" \
                if pol != "jsq" else "—"
            stalled = f"{tot['stalled']}" if pol != "jsq" else "—"
            print(f"| {names[key]} | {rate:g} | {n} | {name} | {tot['misses']} ({tot['ttft']}) | {stalled} | {over} | "
                  f"{rep} |", flush=True)
    print()
