"""Elastic re-plan on the running engine: move to a new plan while the unchanged replicas keep serving.

``reconfigure(engine, plan, cluster)`` compares ``plan`` (usually from ``planner.replan``) with the
running layout. A running replica the new plan holds on the same devices with the same stages keeps
serving, under its running id and with the same workers; where the new plan gives it another role
(a prefill replica that decodes in place since its decode replicas died, planned colocated or
prefill again) the coordinator changes the role in place when the new replicas join. Every other
running replica — a dead one, or a survivor the new plan reshapes — is retired first (its requests
re-run on the kept replicas, exactly as after a death, so none is lost) which frees its devices;
then the new replicas' workers start (loading their shards while the kept replicas serve), the
running workers learn the new peers and layout (a prefill replica can hand off to a new decode
replica), and the coordinator puts the new replicas into service. Returns what it did (``roles``:
the kept replicas whose role changed, from and to) and how long each part took.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import replace
from typing import Any

import torch

from hetserve.errors import PlanError
from hetserve.planner.plan import Plan, unused_id
from hetserve.runtime.deployment import build_layout, local_devices
from hetserve.runtime.engine_config import kv_capacity, memory_is_real, scheduler_for
from hetserve.runtime.layout import ReplicaSpec
from hetserve.runtime.workers.wire import Message
from hetserve.runtime.workers.worker import WorkerConfig
from hetserve.specs.cluster import Cluster


def shape(r) -> tuple:
    """What makes two replicas the same deployment: (devices, layers) per stage. Not the role: the
    role is the coordinator's to change (a live replica's may already differ from its plan's), and
    matching on it would retire and restart a survivor whose workers could keep serving."""
    if isinstance(r, ReplicaSpec):
        return tuple((tuple(w.name for w in st), st[0].layers) for st in r.stages)
    return tuple((tuple(st.devices), tuple(st.layers)) for st in r.stages)


def reconfigure(engine, plan: Plan, cluster: Cluster) -> dict[str, Any]:
    t0 = time.monotonic()
    coord = engine.loop
    running = {shape(r): r.id for r in coord.layout if coord.schedulers[r.id].alive}
    keep: dict[str, str] = {}  # new plan id -> running id
    for r in plan.replicas:
        if shape(r) in running:
            keep[r.id] = running.pop(shape(r))
    retire = [r.id for r in coord.layout if r.id not in keep.values()]
    # new replicas get ids no replica of this engine has had (running, retiring or retired before)
    rename = {r.id: keep[r.id] if r.id in keep else unused_id(r.id, engine.replica_ids_used) for r in plan.replicas}
    merged = replace(plan, replicas=tuple(replace(r, id=rename[r.id]) for r in plan.replicas),
                     kv_routes=tuple(replace(k, src=rename[k.src], dst=rename[k.dst]) for k in plan.kv_routes))
    if engine.devices is not None:  # the launcher placed every device of the cluster (Ray)
        missing = sorted(set(merged.devices) - set(engine.devices))
        if missing:
            raise PlanError(f"re-plan: device(s) {', '.join(missing)} were not placed by the launcher that "
                            f"started this engine (it placed {', '.join(sorted(engine.devices))}); start a new "
                            "deployment for them")
        device_of = {d: engine.devices[d] for d in merged.devices}
    else:
        # every live worker keeps its GPU (retiring ones hold theirs while they drain; a dead one's is free)
        now = {w.name: w.device for r in coord.layout if coord.schedulers[r.id].alive for w in r.workers}
        device_of = local_devices(merged.devices, cluster, torch.cuda.device_count() if engine._use_cuda else 0, now)
    layout = build_layout(merged, cluster, engine.arch, device_of, source="re-plan")
    added = tuple(r for r in layout if r.id not in keep.values())
    pools = kv_capacity(added, cluster, engine.arch, engine.dtype, engine.config,
                        memory_is_real(device_of, cluster, engine._use_cuda, one_host=engine.devices is None)
                        ) if added else {}
    cfg = engine.config
    schedulers = [scheduler_for(r, pools[r.id].tokens, cfg) for r in added]
    if not added and not keep:
        raise PlanError("re-plan: the new plan has no replica")

    done = threading.Event()
    engine.transport.post(Message("retire", {"replicas": retire, "why": "re-plan", "done": done}))
    done.wait()
    t_retired = time.monotonic()

    procs: dict[str, Any] = {}
    if added:
        coord.joining = queue.Queue()

        def recv(timeout: float):
            try:
                return coord.joining.get(timeout=timeout)
            except queue.Empty:
                return None

        def make_config(w, store_address, backend) -> WorkerConfig:
            sched = next(s for s in schedulers if s.id == w.replica)
            return engine.worker_config(w, layout, sched.blocks.capacity_tokens, store_address, backend)
        try:
            procs = engine.workers.start_more(added, layout, make_config, cfg.start_method, recv)
        finally:
            coord.joining = None
    t_started = time.monotonic()

    done = threading.Event()
    roles = {r.id: r.role for r in layout if r.id in keep.values()}  # kept replicas' roles in the new plan
    changed: dict[str, list[str]] = {}  # kept replica -> [live role, new role], filled by the coordinator
    engine.transport.post(Message("add", {"layout": layout, "procs": procs, "replicas": list(added),
                                          "schedulers": schedulers, "plan": merged, "roles": roles,
                                          "changed": changed, "done": done}))
    done.wait()
    t_end = time.monotonic()
    engine.plan, engine.layout, engine.cluster = merged, layout, cluster
    engine.replicas = {r.id: r for r in layout}
    engine.kv_sizing.update(pools)
    record = {"kept": sorted(keep.values()), "retired": retire, "added": [r.id for r in added], "roles": changed,
              "retire_s": t_retired - t0, "start_s": t_started - t_retired, "activate_s": t_end - t_started,
              "total_s": t_end - t0}
    coord.replans.append(record)
    return record
