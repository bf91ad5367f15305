"""The replicas ``hetserve calibrate`` probes, shared by the probes (``calibration_probes``) and the
fit (``calibrate``), so both price the same layouts: one device, a two-stage pipeline, one stage of
TP 2 and a prefill replica handing its KV to a decode replica, in a cluster of devices of one GPU
type named ``cal:0``, ``cal:1``, ...
"""

from __future__ import annotations

from hetserve.cost.layout import ReplicaLayout, StageLayout
from hetserve.planner.plan import Plan
from hetserve.specs.cluster import Cluster, cluster_from_dict


def one_device_cluster(gpu_name: str, count: int = 1) -> Cluster:
    # Memory is left at the GPU's: calibration measures speed, not capacity.
    return cluster_from_dict({"name": "calibration", "machines": [{"name": "cal", "gpu": gpu_name, "count": count}]})


def stage_bounds(num_layers: int, stages: int) -> list[tuple[int, int]]:
    """Layers split as evenly as they go over ``stages`` stages (the pipeline probe's layout)."""
    cuts = [round(i * num_layers / stages) for i in range(stages + 1)]
    return list(zip(cuts, cuts[1:]))


def _stage_devices(stages: int, tp: int, first_device: int = 0) -> list[range]:
    """Device indices of each stage: ``tp`` consecutive devices a stage, from ``first_device``."""
    return [range(first_device + i * tp, first_device + (i + 1) * tp) for i in range(stages)]


def one_device_plan(spec, cluster: Cluster, stages: int = 1, tp: int = 1) -> Plan:
    """One colocated replica; ``stages`` > 1: a pipeline with one device per stage; ``tp`` > 1: one
    stage on ``tp`` devices."""
    bounds = stage_bounds(spec.num_layers, stages)
    return Plan.from_dict({"model": spec.name, "cluster": cluster.name, "algorithm": "calibration",
                           "replicas": [{"id": "c0", "role": "colocated",
                                         "stages": [{"devices": [f"cal:{d}" for d in devs], "layers": [lo, hi]}
                                                    for devs, (lo, hi) in zip(_stage_devices(stages, tp), bounds)]}]})


def probe_layout(spec, stages: int = 1, tp: int = 1, first_device: int = 0) -> ReplicaLayout:
    """The replica ``one_device_plan`` serves, as the cost model sees it (devices from ``first_device``)."""
    return ReplicaLayout(tuple(StageLayout(tuple(devs), b) for devs, b in
                               zip(_stage_devices(stages, tp, first_device), stage_bounds(spec.num_layers, stages))))


def handoff_plan(spec, cluster: Cluster) -> Plan:
    """A prefill replica on one device handing its KV to a decode replica on another."""
    stage = lambda dev: [{"devices": [dev], "layers": [0, spec.num_layers]}]  # noqa: E731
    return Plan.from_dict({"model": spec.name, "cluster": cluster.name, "algorithm": "calibration",
                           "replicas": [{"id": "p0", "role": "prefill", "stages": stage("cal:0")},
                                        {"id": "d0", "role": "decode", "stages": stage("cal:1")}],
                           "kv_routes": [{"from": "p0", "to": "d0", "weight": 1.0}]})


def tp_divides(spec, tp: int) -> bool:
    """The checkpoint's heads, KV heads and FFN split evenly over ``tp`` devices (a TP probe is possible)."""
    return spec.num_heads % tp == 0 and spec.num_kv_heads % tp == 0 and spec.ffn_hidden % tp == 0
