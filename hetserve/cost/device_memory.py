"""What one device of a stage holds: its weights, its activation buffers and KV per token, and how many
KV tokens fit beside them. The memory rule, in one place: a device may fill ``usable_memory`` of
its memory (``Efficiency``; the runtime's ``memory_fraction``) with its weights, the activation
buffers (HexGen Appendix B) and KV. The cost model (planner, validator, simulator) and the runtime's
deployment check (``runtime/deployment.py``) call these very functions."""

from __future__ import annotations

from hetserve.specs.model import ModelSpec


def device_weight_bytes(model: ModelSpec, num_layers: int, tp: int, is_first: bool, is_last: bool,
                        is_leader: bool) -> float:
    """Weight bytes one device of a stage loads: 1/tp of the stage's layers, plus, on the stage
    leader only, the embeddings (first stage) or final norm + LM head (last stage; a tied head is
    a separate copy). This is where the runtime puts them (leaders talk between stages, HexGen
    §3.2), and the runtime's memory check calls this very function."""
    params = num_layers * model.params_per_layer / tp
    if is_leader and is_first:
        params += model.embedding_params
    if is_leader and is_last:
        params += model.head_params + (model.vocab * model.hidden if model.tie_embeddings else 0)
    return params * model.dtype_bytes


def device_kv_bytes_per_token(model: ModelSpec, num_layers: int, tp: int) -> float:
    """KV bytes per token on one device of a stage: its layers, its 1/tp of the KV heads."""
    return num_layers * model.kv_bytes_per_token_per_layer / tp


def device_activation_bytes(model: ModelSpec, buffers: int, tokens: int) -> float:
    """The reusable activation buffers every device of a stage keeps: ``buffers`` of ``tokens`` x hidden."""
    return buffers * tokens * model.hidden * model.dtype_bytes


def kv_tokens_fit(memory_bytes: float, usable: float, held_bytes: float, kv_bytes_per_token: float) -> float:
    """KV tokens a device fits beside ``held_bytes`` (weights + activation buffers) within ``usable``
    of its memory; negative when what it holds alone does not fit."""
    free = memory_bytes * usable - held_bytes
    return free / kv_bytes_per_token if kv_bytes_per_token else (float("inf") if free >= 0 else -1.0)
