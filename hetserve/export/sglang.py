"""A plan as an SGLang launch bundle: one ``sglang.launch_server`` per replica and machine.

Flags follow SGLang's source at the commit ``rules.SOURCES`` names:

* ``python -m sglang.launch_server --model-path M --tp-size TP --pp-size PP``;
  ``SGLANG_PP_LAYER_PARTITION`` = the plan's layers per stage when PP > 1;
* a replica over n machines: ``--nnodes n --node-rank i --dist-init-addr HEAD:PORT`` on each,
  machine i holding stages ``[i * PP/n, (i+1) * PP/n)``; ``CUDA_VISIBLE_DEVICES`` lists the
  machine's GPUs in stage order and ``--base-gpu-id 0``, so SGLang's GPU for (pp_rank, tp_rank),
  ``base_gpu_id + (pp_rank % pp_per_node) * TP + tp_rank``, is the plan's device;
* prefill / decode replicas: ``--disaggregation-mode prefill|decode`` with the NIXL transfer
  backend; each prefill server's ``--disaggregation-bootstrap-port``; SGLang's own router
  (``sglang_router.launch_router --pd-disaggregation``) in front, which speaks its bootstrap
  protocol. Colocated plans get ``hetserve route``.
"""

from __future__ import annotations

from hetserve.export.bundle import Bundle, Launch, ReplicaDeploy, option_value
from hetserve.export.common import ENDPOINT_PORT, ROUTER_PORT, SIDE_PORT, ExportContext
from hetserve.specs.cluster import gpu_index
from hetserve.export.rules import engine_version, machine_runs

SERVER_MODULE = "sglang.launch_server"
ROUTER_MODULE = "sglang_router.launch_router"
TRANSFER_BACKEND = "nixl"


def build(ctx: ExportContext) -> Bundle:
    plan = ctx.plan
    disaggregated = plan.is_disaggregated
    replicas = []
    for r in plan.replicas:
        runs = machine_runs(r)
        tp, pp = r.stages[0].tp, len(r.stages)
        head = runs[0][0]
        host = ctx.address(head)
        port = ctx.port("http", head, ENDPOINT_PORT)
        base = ["python", "-m", SERVER_MODULE, "--model-path", ctx.model_path, "--served-model-name", plan.model,
                "--host", host, "--port", str(port), "--tp-size", str(tp), "--pp-size", str(pp), "--base-gpu-id", "0"]
        env: dict[str, str] = {}
        if pp > 1:
            env["SGLANG_PP_LAYER_PARTITION"] = ",".join(str(s.layers[1] - s.layers[0]) for s in r.stages)
        extra: dict = {"tp_size": tp, "pp_size": pp}
        if disaggregated:
            base += ["--disaggregation-mode", r.role, "--disaggregation-transfer-backend", TRANSFER_BACKEND]
            if r.role == "prefill":
                boot = ctx.port("side", head, SIDE_PORT)
                base += ["--disaggregation-bootstrap-port", str(boot)]
                extra["bootstrap_port"] = boot
        if len(runs) > 1:
            init = f"{host}:{ctx.port('side', head, SIDE_PORT)}"
            extra["dist_init_addr"] = init
        launches = []
        for i, (m, stages) in enumerate(runs):
            gpus = [gpu_index(d) for s in stages for d in s.devices]
            argv = list(base)
            if len(runs) > 1:
                argv += ["--nnodes", str(len(runs)), "--node-rank", str(i), "--dist-init-addr", init]
            launches.append(Launch(m, argv, gpus, {**env, "CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus))}))
        replicas.append(ReplicaDeploy(r.id, r.role, list(r.devices), launches, f"http://{host}:{port}", extra))
    router = ctx.router()
    if disaggregated:
        argv = ["python", "-m", ROUTER_MODULE, "--pd-disaggregation"]
        for rep in replicas:
            if rep.role == "prefill":
                argv += ["--prefill", rep.endpoint, str(rep.extra["bootstrap_port"])]
        for rep in replicas:
            if rep.role == "decode":
                argv += ["--decode", rep.endpoint]
        host = option_value(router["argv"], "--host")
        router["argv"] = argv + ["--host", host, "--port", str(ROUTER_PORT)]
        router["protocol"] = "sglang-bootstrap"
        router["note"] = ("sglang_router balances by load, not by the plan's weights, which are recorded "
                          "here for reference")
    else:
        router["protocol"] = "openai"
    return Bundle("sglang", engine_version("sglang"), replicas, router, ctx.machines)
