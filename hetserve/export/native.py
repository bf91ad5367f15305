"""A plan as a hetserve launch bundle: docs/multinode.md as scripts.

One Ray cluster for the pool: the head on the machine of the plan's first device, a node on each
other machine, each advertising ``hetserve_machine_<name>`` (where the workers of that machine's
devices are placed) and binding the cluster file's address. ``hetserve serve --backend ray`` runs
on the head machine and places one worker per device of the plan (the ``actor`` launch entries:
GPU indices are the plan's, as the engine pins them), its own listeners on ports from
``ExportContext.port_range`` where one is given. Token authentication is Ray's default; the README
says where the token goes.
"""

from __future__ import annotations

import json

from hetserve.export.bundle import Bundle, Launch, ReplicaDeploy
from hetserve.export.common import ExportContext
from hetserve.export.ports import check_port_range
from hetserve.specs.cluster import gpu_index, machine_of
from hetserve.export.rules import engine_version

SERVE_PORT = 8000


def build(ctx: ExportContext, cluster_ref: str) -> Bundle:
    plan = ctx.plan
    head = ctx.head_machine
    head_addr = ctx.address(head)
    ray_addr = f"{head_addr}:{ctx.ray_port}"
    serve = ["hetserve", "serve", "--backend", "ray", "--ray-address", ray_addr, "--advertise-address", head_addr,
             "--plan", "plan.json", "--cluster", cluster_ref, "--model", ctx.model_path,
             "--host", head_addr, "--port", str(SERVE_PORT)]
    if ctx.port_range is not None:
        # refused here, not when the server on that machine finds no free port; the serve command sets no
        # --device-channel, so channels are off (serve's default) and only TP groups need the store
        check_port_range(ctx.port_range, plan, head, ctx.address)
        serve += ["--port-range", str(ctx.port_range)]
    shared = []
    for m, addr in ctx.machines.items():
        resources = json.dumps({f"hetserve_machine_{m}": 1000}, separators=(",", ":"))
        start = (["ray", "start", "--head", "--port", str(ctx.ray_port)] if m == head
                 else ["ray", "start", "--address", ray_addr])
        shared.append(Launch(m, start + ["--node-ip-address", addr, "--resources", resources], [], {}, kind="ray"))
    shared.append(Launch(head, serve, [], {}, note="the HTTP API and the engine; places every replica's workers"))
    replicas = []
    for r in plan.replicas:
        by_machine: dict[str, list[int]] = {}
        for d in r.devices:
            by_machine.setdefault(machine_of(d), []).append(gpu_index(d))
        launches = [Launch(m, serve, gpus, {}, kind="actor",
                           note=f"workers placed by hetserve serve on Ray node hetserve_machine_{m}")
                    for m, gpus in by_machine.items()]
        replicas.append(ReplicaDeploy(r.id, r.role, list(r.devices), launches, f"http://{head_addr}:{SERVE_PORT}"))
    router = {"argv": serve, "weights": ctx.entry_weights(), "kv_routes": ctx.kv_routes(),
              "endpoint": f"http://{head_addr}:{SERVE_PORT}", "protocol": "openai",
              "note": "hetserve serve is its own router: the plan's weights place requests on the replicas"}
    # Ray's token authentication unless the machine's environment says otherwise (docs/multinode.md:
    # RAY_AUTH_MODE=disabled only on a network no one else reaches)
    preamble = ['export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"']
    return Bundle("hetserve", engine_version("hetserve"), replicas, router, ctx.machines, shared=shared,
                  extra={"cluster": cluster_ref}, preamble=preamble)
