"""Aladdin's performance models (§3): one ``PerformanceModel`` per replica, fitted to the analytic
cost model, shared by replicas of identical shape."""

from __future__ import annotations

from typing import Mapping

from hetserve.cost.fitted import PerformanceModel
from hetserve.specs.workload import SLO


def _layout_key(cost, layout) -> tuple:
    devs = cost.cluster.devices
    ids = list(layout.devices)
    sub = tuple(tuple((float(cost.cluster.latency[a, b]), float(cost.cluster.bandwidth[a, b])) for b in ids)
                for a in ids)
    return tuple((tuple(devs[d].gpu.name for d in s.devices), s.layers) for s in layout.stages) + (sub,)


def models_from_cost(cost, layouts: Mapping[str, object], slo: SLO | None = None,
                     **fit_kwargs) -> dict[str, PerformanceModel]:
    """A ``PerformanceModel`` per replica fitted to the analytic cost model (``layouts``: replica id
    -> ``ReplicaLayout``). With an ATGT target, decode is fitted on iterations up to 1.5× it (the
    region placement decides in). Replicas of identical shape share one fit."""
    from hetserve.cost.fitted import fit_from_cost_model

    if slo is not None and slo.tpot_s is not None:
        fit_kwargs.setdefault("max_decode_s", 1.5 * slo.tpot_s)

    cache: dict[tuple, PerformanceModel] = {}
    out = {}
    for rid, layout in layouts.items():
        key = _layout_key(cost, layout)
        if key not in cache:
            cache[key] = fit_from_cost_model(cost, layout, **fit_kwargs)
        out[rid] = cache[key]
    return out
