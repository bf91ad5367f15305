"""The serving runtime: real worker processes running a Plan's replicas.

    engine.py      Engine: starts workers, coordinator thread (scheduling, hand-offs, failures), submit()
    coordinator.py the coordinator's loop: messages, steps, hand-offs  recovery.py  worker deaths, re-runs, re-plans
    worker.py      one process per device: a TP rank of a pipeline stage; leader relays activations
    scheduler.py   continuous batching for one replica        kv_cache.py   BlockManager (admission)
    sequence.py    per-request state                          handle.py     RequestHandle (sync/async)
    routing.py     decode-replica choice (plan KV-route weights by default)
    layout.py      who holds which layers/heads (records shipped to workers); KV hand-off pieces
    deployment.py  plan x checkpoint x cluster -> layout; plan and memory checks
    transport.py   messages + tensors between endpoints with a priority class; sockets / in-process
    kv_pool.py     one worker's KV tensors                    sampling.py   SamplingParams, sampler
    tp.py          tensor parallelism as a transformation of a plain model
    model/         plain Llama / OPT stages, paged attention, safetensors loader
    make_model.py  tiny random checkpoints with a byte tokenizer

Importing this package does not import torch; ``from hetserve.runtime.engine import Engine`` does.
"""

from __future__ import annotations

__all__ = ["Engine", "EngineConfig", "RequestHandle", "SamplingParams"]


def __getattr__(name: str):
    if name in ("Engine", "EngineConfig"):
        from hetserve.runtime import engine

        return getattr(engine, name)
    if name == "RequestHandle":
        from hetserve.runtime.handle import RequestHandle

        return RequestHandle
    if name == "SamplingParams":
        from hetserve.runtime.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(name)
