"""Plain transformer stages (layers [a, b) of a checkpoint) and their loader.

    config.py     ArchConfig read from config.json (no transformers import)
    attention.py  paged attention over a KV pool for mixed prefill/decode batches
    llama.py      Llama family (GQA, RoPE, RMSNorm, SwiGLU)
    opt.py        OPT
    loader.py     build a stage on meta, shard it (runtime.tp), fill it from safetensors slices
"""
