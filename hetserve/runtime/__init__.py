"""The serving runtime: real worker processes running a Plan's replicas.

    engine.py       Engine: starts workers and the engine loop thread, submit()
    engine_loop.py  the loop: messages, steps, hand-offs       recovery.py  worker deaths, re-runs, re-plans
                                                               choices.py   n choices sharing a prompt's KV
    scheduler.py    continuous batching for one replica        kv_cache.py  BlockManager (admission)
    sequence.py     per-request state                          handle.py    RequestHandle (sync/async)
    routing.py      decode-replica choice (plan KV-route weights by default)
    layout.py       who holds which layers/heads (records shipped to workers); KV hand-off pieces
    deployment.py   plan x checkpoint x cluster -> layout; plan and memory checks
    sampling.py     the sampler                                params.py    SamplingParams
    step_timing.py  what one engine step took, for the comparison with the simulator
    workers/        one process per device (worker, worker_group), the wire format, authenticated
                    sockets (transport, auth), rendezvous, KV pools, Ray placement
    links/          the network model of ``--shape-links``: link tables, sharing, the link clock
    model/          plain Llama / OPT stages, paged attention, tensor parallelism (tp.py), the
                    safetensors loader, tiny random checkpoints (make.py)

Importing this package does not import torch; ``from hetserve.runtime.engine import Engine`` does.
"""
