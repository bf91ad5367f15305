"""A stand-in for ``python`` / ``ray`` / ``hetserve`` on PATH: records argv and environment as a bundle
script starts it, and checks the engine's rules on them (exit 3 with the broken rule).

The rules are the ones hetserve.export.rules names, re-stated here from the engine's source
(vLLM ``get_pp_indices``, ``ParallelConfig``; SGLang ``_launch_subprocesses``), not imported from
the code under test:

* vLLM server: ``-m vllm.entrypoints.openai.api_server``; integer ``--tensor-parallel-size`` and
  ``--pipeline-parallel-size``; with PP > 1 ``VLLM_PP_LAYER_PARTITION`` has PP integers ≥ 1 that sum
  to the model's layers; without Ray, ``CUDA_VISIBLE_DEVICES`` names exactly TP × PP distinct GPUs;
  ``--kv-transfer-config`` is JSON naming a connector and a role.
* SGLang server: ``-m sglang.launch_server``; ``SGLANG_PP_LAYER_PARTITION`` as vLLM's; over
  ``--nnodes`` n: PP divisible by n and ``CUDA_VISIBLE_DEVICES`` naming TP × PP / n GPUs, else TP × PP.

Environment from the test: STANDIN_DIR (where records go), STANDIN_MACHINE (the machine the script
runs for), STANDIN_LAYERS (the model's layer count), STANDIN_SERVERS (servers expected on this
machine: a recorded server waits for the others so that none is ended before it has recorded).
"""

import json
import os
import sys
import time
import uuid

KEEP = ("CUDA_VISIBLE_DEVICES", "VLLM_PP_LAYER_PARTITION", "SGLANG_PP_LAYER_PARTITION", "RAY_ADDRESS",
        "VLLM_NIXL_SIDE_CHANNEL_HOST", "VLLM_NIXL_SIDE_CHANNEL_PORT", "RAY_AUTH_MODE")


def flag(argv, name, default=None):
    return argv[argv.index(name) + 1] if name in argv else default


def fail(msg):
    print(f"stand-in: {msg}", file=sys.stderr)
    sys.exit(3)


def partition(var, pp, layers):
    raw = os.environ.get(var)
    if pp == 1:
        return None
    if raw is None:
        fail(f"PP {pp} without {var}")
    parts = [int(x) for x in raw.split(",")]
    if len(parts) != pp:
        fail(f"{var}={raw}: {len(parts)} entries for PP {pp}")
    if sum(parts) != layers or min(parts) < 1:
        fail(f"{var}={raw}: sums to {sum(parts)}, the model has {layers} layers")
    return parts


def gpus():
    raw = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    out = [int(x) for x in raw.split(",") if x != ""]
    if len(set(out)) != len(out):
        fail(f"CUDA_VISIBLE_DEVICES={raw} repeats a GPU")
    return out


def check(prog, argv):
    layers = int(os.environ["STANDIN_LAYERS"])
    if prog == "python" and argv[:2] == ["-m", "vllm.entrypoints.openai.api_server"]:
        tp, pp = int(flag(argv, "--tensor-parallel-size", 1)), int(flag(argv, "--pipeline-parallel-size", 1))
        partition("VLLM_PP_LAYER_PARTITION", pp, layers)
        if flag(argv, "--distributed-executor-backend") != "ray" and len(gpus()) != tp * pp:
            fail(f"TP {tp} × PP {pp} on CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}")
        if "--kv-transfer-config" in argv:
            cfg = json.loads(flag(argv, "--kv-transfer-config"))
            if not cfg.get("kv_connector") or cfg.get("kv_role") not in ("kv_producer", "kv_consumer", "kv_both"):
                fail(f"--kv-transfer-config {cfg}")
        return "server"
    if prog == "python" and argv[:2] == ["-m", "sglang.launch_server"]:
        tp, pp = int(flag(argv, "--tp-size", 1)), int(flag(argv, "--pp-size", 1))
        nnodes = int(flag(argv, "--nnodes", 1))
        partition("SGLANG_PP_LAYER_PARTITION", pp, layers)
        if pp % nnodes or len(gpus()) != tp * pp // nnodes:
            fail(f"TP {tp} × PP {pp} over {nnodes} nodes on CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}")
        return "server"
    if prog == "ray" and argv[:1] == ["start"]:
        if "--num-gpus" in argv and int(flag(argv, "--num-gpus")) != len(gpus()):
            fail(f"ray --num-gpus {flag(argv, '--num-gpus')} with CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}")
        return "ray"
    if prog == "hetserve" and argv[:1] == ["serve"]:
        return "server"
    fail(f"unexpected command {prog} {' '.join(argv)}")


def main():
    prog, argv = os.path.basename(sys.argv[1]), sys.argv[2:]
    kind = check(prog, argv)
    folder = os.environ["STANDIN_DIR"]
    machine = os.environ["STANDIN_MACHINE"]
    rec = {"machine": machine, "prog": prog, "argv": argv, "kind": kind,
           "env": {k: os.environ[k] for k in KEEP if k in os.environ}}
    name = os.path.join(folder, f"{machine}-{kind}-{uuid.uuid4().hex}.json")
    with open(name + ".tmp", "w") as f:
        json.dump(rec, f)
    os.replace(name + ".tmp", name)
    if kind == "server":  # stay up until every server of this machine has recorded
        want = int(os.environ.get("STANDIN_SERVERS", "1"))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if sum(1 for n in os.listdir(folder) if n.startswith(f"{machine}-server-") and n.endswith(".json")) >= want:
                break
            time.sleep(0.02)


if __name__ == "__main__":
    main()
