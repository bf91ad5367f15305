"""The per-replica tables ``plan`` (and ``describe plan``) and ``simulate`` print. Up to
``MAX_ROWS`` replicas, a row each; past it (a fleet's hundreds), a row per kind of replica (the
same role, GPUs and stages, and in a plan the same capacity) with its count, first ids and the
spread of its figures, so the table stays a page long. Every replica's own figures stay in the
plan file and in summary.json."""

from __future__ import annotations

from hetserve.cli.cluster_report import MAX_ROWS  # one rule for when a fleet's rows are grouped
from hetserve.listing import some


def stages_text(replica) -> str:
    return " → ".join(f"TP{s.tp}×{s.layers[1] - s.layers[0]}" for s in replica.stages)


def gpus_text(replica, cluster) -> str:
    """``4× H100-SXM-80G`` (``2× H100-SXM-80G + 2× A100-SXM-80G`` for a mixed replica); the count
    alone where the cluster does not hold the devices."""
    if cluster is None or not all(cluster.has_device(d) for d in replica.devices):
        return str(len(replica.devices))
    counts: dict[str, int] = {}
    for d in replica.devices:
        g = cluster.device(d).gpu.name
        counts[g] = counts.get(g, 0) + 1
    return " + ".join(f"{n}× {g}" for g, n in counts.items())


def _grouped(keys: dict[str, tuple]) -> dict[tuple, list[str]]:
    out: dict[tuple, list[str]] = {}
    for rid, key in keys.items():
        out.setdefault(key, []).append(rid)
    return out


def _spread(values: list[float], fmt: str) -> str:
    lo, hi = min(values), max(values)
    return format(lo, fmt) if format(lo, fmt) == format(hi, fmt) else f"{format(lo, fmt)}–{format(hi, fmt)}"


def plan_table(plan, title: str, caption: str | None, devices_text):
    """The plan's replicas: ``devices_text(replica)`` fills the devices column of a listed row."""
    from rich.table import Table

    per = plan.estimate.get("replicas", {}) if plan.estimate else {}

    def req(info: dict, key: str) -> str:
        return f"{info[key]:,.0f}" if key in info else "–"

    grouped = len(plan.replicas) > MAX_ROWS
    if grouped:
        caption = (f"{len(plan.replicas):,} replicas, a row per kind (role, stages, GPUs, capacity): capacity "
                   f"per replica, flow of the kind in all (each replica's in the plan file)"
                   + (f"; {caption}" if caption else ""))
    t = Table(title=title, caption=caption)
    for col in ("replicas" if grouped else "replica", "role", "GPUs" if grouped else "devices",
                "stages (TP×layers)", "capacity req/T", "flow req/T"):
        t.add_column(col, justify="right" if "req" in col else "left")
    if not grouped:
        for r in plan.replicas:
            info = per.get(r.id, {})
            t.add_row(r.id, r.role, devices_text(r), stages_text(r), req(info, "capacity_requests_per_period"),
                      req(info, "flow_requests_per_period"))
        return t
    keys = {r.id: (r.role, len(r.devices), stages_text(r), req(per.get(r.id, {}), "capacity_requests_per_period"))
            for r in plan.replicas}
    for (role, n, stages, capacity), ids in _grouped(keys).items():
        flows = [per.get(i, {}).get("flow_requests_per_period") for i in ids]
        flow = f"{sum(flows):,.0f}" if all(isinstance(f, (int, float)) for f in flows) else "–"
        t.add_row(some(ids), role, str(n), stages, capacity, flow)
    return t


def sim_replica_table(replicas: dict, kinds: dict[str, str] | None = None):
    """summary.json's ``replicas`` as a table; ``kinds`` (replica id -> its GPUs and stages, from the
    plan): how a fleet's replicas are grouped (without it, by role and GPU count)."""
    from rich.table import Table

    # a continuous batch under light load still holds a request nearly all the time: say so, or
    # 1.00 reads as saturated
    caption = ("busy: share of the run with a request in hand (not how full its batches were); "
               "KV: share of the pool in use")
    grouped = len(replicas) > MAX_ROWS
    if grouped:
        caption = (f"{len(replicas):,} replicas, a row per kind (role, GPUs, stages): requests in all, busy and "
                   f"KV mean from the kind's lowest to its highest, KV peak its highest (each replica's in "
                   f"summary.json); " + caption)
    t = Table(caption=caption)
    numeric = {"requests", "busy", "KV mean", "KV peak"} | (set() if grouped else {"GPUs"})
    for col in ("replicas" if grouped else "replica", "role", "GPUs", "requests", "busy", "KV mean", "KV peak"):
        # figures whole, never cut to "0.00–0.…"; a GPU name folds rather than lose its end
        t.add_column(col, justify="right" if col in numeric else "left", no_wrap=col in numeric, overflow="fold")
    if not grouped:
        for rid, r in replicas.items():
            t.add_row(rid, r["role"], str(r["devices"]), str(r["requests"]), f"{r['utilisation']:.2f}",
                      f"{r['kv_mean_use']:.2f}", f"{r['kv_peak_use']:.2f}")
        return t
    keys = {rid: (r["role"], (kinds or {}).get(rid) or str(r["devices"])) for rid, r in replicas.items()}
    for (role, gpus), ids in _grouped(keys).items():
        rs = [replicas[i] for i in ids]
        t.add_row(some(ids), role, gpus, f"{sum(r['requests'] for r in rs):,}",
                  _spread([r["utilisation"] for r in rs], ".2f"), _spread([r["kv_mean_use"] for r in rs], ".2f"),
                  f"{max(r['kv_peak_use'] for r in rs):.2f}")
    return t
