"""Hand-built plans for simulator tests and the benchmark (until the planners exist)."""

from __future__ import annotations

from hetserve.planner.plan import Plan


def _stage(devs, lo, hi):
    return {"devices": list(devs), "layers": [lo, hi]}


def het1_disaggregated() -> Plan:
    """llama-2-70b on hexgen2-het1: A100/H100 prefill, L40/A6000 decode (hand-built)."""
    a100 = [f"a100-0:{i}" for i in range(6)]
    a6k = [f"a6000-0:{i}" for i in range(8)]
    l40 = [f"l40-0:{i}" for i in range(4)]
    return Plan.from_dict({
        "model": "llama-2-70b", "cluster": "hexgen2-het1", "algorithm": "manual",
        "replicas": [
            {"id": "p0", "role": "prefill", "stages": [_stage(a100[:4], 0, 80)]},
            {"id": "p1", "role": "prefill", "stages": [_stage(["h100-0:0", "h100-0:1"], 0, 40),
                                                       _stage(a100[4:], 40, 80)]},
            {"id": "d0", "role": "decode", "stages": [_stage(a6k[:4], 0, 80)]},
            {"id": "d1", "role": "decode", "stages": [_stage(a6k[4:], 0, 80)]},
            {"id": "d2", "role": "decode", "stages": [_stage(l40, 0, 80)]},
        ],
        "kv_routes": [{"from": "p0", "to": "d0", "weight": 0.4}, {"from": "p0", "to": "d2", "weight": 0.6},
                      {"from": "p1", "to": "d1", "weight": 0.7}, {"from": "p1", "to": "d2", "weight": 0.3}],
    })


def single(role_devices: dict[str, list[str]], model: str = "llama-2-7b", cluster: str = "test",
           routes=None, layers: int = 32) -> Plan:
    """One single-stage replica per entry: ``{"p0": [...], "d0": [...]}``; role from the id's first letter."""
    roles = {"p": "prefill", "d": "decode", "c": "colocated"}
    reps = [{"id": rid, "role": roles[rid[0]], "stages": [_stage(devs, 0, layers)]} for rid, devs in role_devices.items()]
    return Plan.from_dict({"model": model, "cluster": cluster, "replicas": reps,
                           "kv_routes": [{"from": a, "to": b, "weight": w} for a, b, w in (routes or [])]})
