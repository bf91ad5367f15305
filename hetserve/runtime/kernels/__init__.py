"""The serving engine's kernels: paged attention (Triton on CUDA, C++ or plain torch on a CPU) and a layer's small ops.

The KV pool of one layer is a pair of caches ``(num_blocks, block_size, Hkv, D)``. Token position
``p`` of a sequence with block table ``bt`` lives in block ``bt[p // block_size]`` at offset
``p % block_size``; its slot is ``block * block_size + offset``. Query head ``h`` reads KV head
``h // (Hq // Hkv)`` (grouped-query attention; Hq a multiple of Hkv).

- ``store_kv(k, v, k_cache, v_cache, slot_mapping, impl=None)``: k, v ``(T, Hkv, D)``;
  ``slot_mapping (T,)`` int; row t is written to slot ``slot_mapping[t]`` in place; a slot of -1 is
  skipped (the padding rows of a captured CUDA graph).
- ``paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, impl=None)``:
  q ``(B, Hq, D)``, one query per sequence at the last of its ``context_lens[b]`` positions,
  ``block_tables (B, max_blocks)`` int32, ``context_lens (B,)`` int32 -> ``(B, Hq, D)``. A row of
  context 0 gives zeros and reads nothing. Triton: flash-decoding (the context split into
  partitions, each attended by its own program, merged by log-sum-exp); a program serves all the
  query heads of one KV head, so each KV block is loaded once per group.
- ``paged_prefill_attention(q, k_cache, v_cache, block_tables, query_start_loc, context_lens,
  scale, impl=None, max_query_len=None)``: q ``(T, Hq, D)`` packs the new tokens of B sequences,
  sequence b's at rows ``query_start_loc[b]:query_start_loc[b+1]`` (``query_start_loc (B+1,)``
  int32, cumulative). ``context_lens[b]`` counts sequence b's tokens in the pool *including* this
  step's (already stored with ``store_kv``), so its query i sits at position
  ``context_lens[b] - q_len[b] + i`` and attends to the positions up to its own: a prompt, a
  prompt chunk after earlier chunks, or decodes (q_len 1). ``max_query_len``, when the caller
  knows it, spares the Triton launch a device-to-host read. -> ``(T, Hq, D)``.
- ``rms_norm(x, weight, eps, impl=None)`` and ``rotary(q, k, cos, sin, impl=None)``: a Llama
  layer's normalisation and rotary embedding, rounding where transformers rounds; C++ under
  ``"native"``, torch otherwise (Triton has none).

``impl``: ``"triton"``, ``"native"``, ``"torch"``, or None: Triton when the tensors are on CUDA,
Triton imports and a tiny Triton kernel launches on that GPU (tried once per GPU: Triton builds
its launcher with the host's C compiler and Python headers at the first launch, and where that
fails every launch would; the log line then starts with ``TRITON_FAILED`` and the torch kernels
run); on a CPU the C++ kernels (``native.py``) where they build, plain torch
otherwise. ``"native"`` has decode attention and ``store_kv`` kernels: its prefill is the torch one.
On CPU tensors ``impl="triton"`` runs the kernels under Triton's interpreter (slow; for checking
them). Inputs of float32, bfloat16 or float16; scores, softmax
and sums accumulate in float32; the output has q's dtype. Checked against the per-sequence loops
of ``reference.py`` by ``tests/runtime/test_kernels.py`` and ``bench/check_kernels.py``.
"""

from __future__ import annotations

import functools
import logging

import torch

from . import native, torch_impl

IMPLS = ("triton", "native", "torch")
TRITON_FAILED = "Triton kernels cannot launch"  # the log line's fixed start: a GPU check greps for it
log = logging.getLogger(__name__)


@functools.cache
def triton_available() -> bool:
    """Whether Triton imports here (it is optional: hetserve runs without it). Asked only when a
    call may run Triton, so code on CPU tensors with the default impl never imports it."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _probe_launch(device: torch.device) -> None:
    """Launch the smallest Triton kernel on ``device`` and wait for it; raises where it cannot run."""
    k = torch.ones(1, 1, 16, device=device)
    cache = torch.zeros(1, 16, 1, 16, device=device)
    _triton().store_kv(k, k, cache, cache.clone(), torch.zeros(1, dtype=torch.int32, device=device))
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    if cache[0, 0, 0, 0].item() != 1.0:
        raise RuntimeError("the probe kernel ran but wrote nothing")


@functools.cache
def _triton_failure(index: int) -> str:
    """Why Triton's kernels cannot run on GPU ``index`` ("" where they can), found once per GPU."""
    device = torch.device("cuda", index)
    try:
        _probe_launch(device)
    except Exception as e:  # noqa: BLE001 - whatever stops a launch: a compiler, headers, the driver
        first = next((line for line in str(e).splitlines() if line.strip()), "")  # compilers say much more
        why = f"{type(e).__name__}: {first}"[:300]
        log.warning("%s on %s (%s); the torch kernels run instead (and CUDA graphs are off)", TRITON_FAILED,
                    device, why)
        return why
    return ""


def triton_failure(device: torch.device) -> str:
    """Why the default kernels on CUDA ``device`` are not Triton's though it imports ("" otherwise)."""
    if device.type != "cuda" or not triton_available():
        return ""
    return _triton_failure(torch.cuda.current_device() if device.index is None else device.index)


def describe(device: torch.device) -> str:
    """The default kernels on ``device``, and why not Triton's where its launch failed (a worker's report)."""
    why = triton_failure(device)
    return f"torch ({TRITON_FAILED}: {why})" if why else resolve_impl(None, device)


def resolve_impl(impl: str | None, device: torch.device) -> str:
    """The implementation a call runs: ``impl`` checked, or the default for ``device``."""
    if impl is None:
        if device.type == "cuda":
            return "triton" if triton_available() and not triton_failure(device) else "torch"
        return "native" if device.type == "cpu" and native.available() else "torch"
    if impl not in IMPLS:
        raise ValueError(f"unknown kernel impl {impl!r}: choose one of {', '.join(map(repr, IMPLS))} or None")
    if impl == "triton" and not triton_available():
        raise ValueError("impl='triton' needs the triton package (pip install triton), which does not import here")
    if impl == "native" and (device.type != "cpu" or not native.available()):
        raise ValueError(f"impl='native' runs on CPU tensors where the C++ kernels build (here: {device.type} "
                         f"tensors, built: {native.available()}; the log says why not)")
    return impl


def _triton():
    from . import triton_kernels
    return triton_kernels


def store_kv(k, v, k_cache, v_cache, slot_mapping, impl=None) -> None:
    """Write this step's K/V rows into the pool in place; slots of -1 are skipped."""
    chosen = resolve_impl(impl, k.device)
    if chosen == "triton":
        _triton().store_kv(k, v, k_cache, v_cache, slot_mapping)
    elif chosen == "native" and k.dtype == v.dtype == k_cache.dtype:
        native.store_kv(k, v, k_cache, v_cache, slot_mapping)
    else:
        torch_impl.store_kv(k, v, k_cache, v_cache, slot_mapping)


def rms_norm(x, weight, eps: float, impl=None):
    """transformers' Llama RMSNorm of x (..., H) with weight (H,): normalised in float32, rounded
    to x's dtype, times the weight. Triton has none: on CUDA it is the torch one."""
    if resolve_impl(impl, x.device) == "native" and x.dtype == weight.dtype:
        return native.rms_norm(x, weight, eps)
    return torch_impl.rms_norm(x, weight, eps)


def rotary(q, k, cos, sin, impl=None):
    """Rotary embedding of q (T, Hq, D) and k (T, Hkv, D) by cos, sin (T, D) of their dtype ->
    (q, k) rotated, as transformers' ``apply_rotary_pos_emb``. On CUDA the torch one."""
    if resolve_impl(impl, q.device) == "native" and q.dtype == k.dtype == cos.dtype == sin.dtype:
        return native.rotary(q, k, cos, sin)
    return torch_impl.rotary(q, k, cos, sin)


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, impl=None):
    """Decode attention of one query per sequence over its paged context -> (B, Hq, D)."""
    chosen = resolve_impl(impl, q.device)
    if chosen == "triton":
        return _triton().paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)
    if chosen == "native":
        return native.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)
    return torch_impl.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)


def paged_prefill_attention(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale,
                            impl=None, max_query_len=None):
    """Causal attention of packed new tokens over their sequences' paged contexts -> (T, Hq, D)."""
    if resolve_impl(impl, q.device) == "triton":
        return _triton().paged_prefill_attention(q, k_cache, v_cache, block_tables, query_start_loc,
                                                 context_lens, scale, max_query_len)
    return torch_impl.paged_prefill_attention(q, k_cache, v_cache, block_tables, query_start_loc,
                                              context_lens, scale)


__all__ = ["IMPLS", "TRITON_FAILED", "describe", "paged_decode_attention", "paged_prefill_attention", "resolve_impl",
           "rms_norm", "rotary", "store_kv", "triton_available", "triton_failure"]
