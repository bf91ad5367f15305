"""Attention over a paged KV pool, for a batch mixing prefills and decodes.

A step runs ``T`` new tokens from ``B`` sequences; sequence ``b`` has ``start[b]`` tokens already in
the KV pool and ``q_len[b]`` new ones (a prefill: the prompt or a chunk of it; a decode: one token).
Linear layers see the flat ``(T, hidden)`` batch; only attention needs the per-sequence view,
described by ``AttnMeta``, built once per step on the host and copied to the device in one
transfer (pinned, non-blocking on CUDA), then shared by every layer:

- each new token's K/V is written to its slot (``slot_mapping``; -1: a padding row, skipped);
- the sequences attend through ``hetserve.runtime.kernels`` in parts (``AttnPart``): a step of
  decodes only is one ``paged_decode_attention`` call, anything else one packed
  ``paged_prefill_attention`` call. On a CPU (plain-torch prefill) a mixed step is split into
  its decodes and its prompts, because that implementation pads every sequence to the longest
  query of its call: a decode beside a 128-token prompt would attend as 128 rows (1.7-17.8x the
  attention time of two calls on the CPU demo, ``python -m bench.bench_attention``).
- on a CPU the decode kernel is the C++ one (``kernels.native``), reading the pool in place; where
  it does not build, a float32 decode step's sequences attend over their contexts as kept from
  earlier steps (``AttnMeta.grids``, ``context_grids.ContextGrids``) rather than gathered again.

Nothing here reads device data back to the host: every size a kernel needs (``max_query_len``)
is known on the host when the step is built.

Slot of position ``p`` of a sequence with block table ``bt``: ``bt[p // block_size] * block_size +
p % block_size``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hetserve.runtime import kernels
from hetserve.runtime.model.context_grids import ContextGrids


@dataclass
class AttnPart:
    """Sequences of a step that attend in one kernel call."""

    tokens: torch.Tensor | None  # (T_p,) the part's rows among the step's T; None: all of them, in order
    block_tables: torch.Tensor  # (B_p, NB) int32, padded with block 0
    context_lens: torch.Tensor  # (B_p,) int32, this step's tokens included (0: a padding row)
    query_start_loc: torch.Tensor  # (B_p + 1,) int32, cumulative new tokens
    max_query_len: int  # 1: a decode part
    num_seqs: int


@dataclass
class AttnMeta:
    positions: torch.Tensor  # (T,) int32 absolute position of each new token
    slot_mapping: torch.Tensor  # (T,) int32 KV slot each new token writes (-1: none)
    last_token: torch.Tensor  # (B,) int32 index in T of each sequence's last new token
    num_seqs: int
    block_size: int
    parts: tuple[AttnPart, ...]
    grids: ContextGrids | None = None  # set by the step runner on a CPU in float32 (runner.py)


@dataclass
class HostMeta:
    """A step's metadata as host arrays, before its one copy to the device."""

    positions: np.ndarray  # (T,)
    slot_mapping: np.ndarray  # (T,)
    last_token: np.ndarray  # (B,)
    parts: list[tuple[np.ndarray | None, np.ndarray, np.ndarray, np.ndarray, int]]  # tokens, bt, ctx, qsl, max_q


def host_meta(starts: list[int], q_lens: list[int], block_tables: list[list[int]], block_size: int,
              split: bool = False, width: int | None = None) -> HostMeta:
    """Metadata of one step as int32 host arrays. ``split``: decodes and prompts in separate parts
    when the step has both. ``width``: block-table columns (default: the step's longest context).
    Running time O(T + B * NB) numpy work, one Python iteration per sequence."""
    start = np.asarray(starts, dtype=np.int64)  # (B,)
    q_len = np.asarray(q_lens, dtype=np.int64)  # (B,)
    ctx = start + q_len  # (B,)
    qsl = np.concatenate(([0], np.cumsum(q_len)))  # (B+1,)
    nb = int(-(-ctx.max() // block_size)) if len(ctx) else 1
    bt = np.zeros((len(q_lens), max(nb, width or 0)), dtype=np.int64)  # (B, NB)
    for b, table in enumerate(block_tables):
        n = min(len(table), nb)
        bt[b, :n] = table[:n]
    seq = np.repeat(np.arange(len(q_lens)), q_len)  # (T,) sequence of each new token
    positions = np.arange(qsl[-1]) - qsl[:-1][seq] + start[seq]  # (T,)
    slots = bt[seq, positions // block_size] * block_size + positions % block_size  # (T,)
    decoding = q_len == 1
    groups = [decoding, ~decoding] if split and decoding.any() and not decoding.all() else [None]
    parts = []
    for members in groups:
        if members is None:
            parts.append((None, bt, ctx, qsl, int(q_len.max(initial=1))))
            continue
        tokens = np.concatenate([np.arange(qsl[b], qsl[b + 1]) for b in np.flatnonzero(members)])
        sub_qsl = np.concatenate(([0], np.cumsum(q_len[members])))
        parts.append((tokens, bt[members], ctx[members], sub_qsl, int(q_len[members].max())))
    return HostMeta(positions, slots, qsl[1:] - 1, parts)


def to_device(meta: HostMeta, block_size: int, device: torch.device | str) -> AttnMeta:
    """``meta`` on ``device``: every array packed into one int32 tensor and copied once (from
    pinned memory, non-blocking, where the device is a GPU); the fields are views of that copy."""
    device = torch.device(device)
    arrays = [meta.positions, meta.slot_mapping, meta.last_token]
    for tokens, bt, ctx, qsl, _ in meta.parts:
        arrays += ([] if tokens is None else [tokens]) + [bt.reshape(-1), ctx, qsl]
    packed = torch.from_numpy(np.concatenate(arrays).astype(np.int32))
    if device.type == "cuda":
        packed = packed.pin_memory().to(device, non_blocking=True)
    views, at = [], 0
    for a in arrays:
        views.append(packed[at:at + a.size])
        at += a.size
    out = iter(views)
    positions, slots, last = next(out), next(out), next(out)
    parts = []
    for tokens, bt, ctx, qsl, max_q in meta.parts:
        tok = None if tokens is None else next(out)
        parts.append(AttnPart(tokens=tok, block_tables=next(out).view(bt.shape), context_lens=next(out),
                              query_start_loc=next(out), max_query_len=max_q, num_seqs=len(ctx)))
    return AttnMeta(positions=positions, slot_mapping=slots, last_token=last, num_seqs=len(meta.last_token),
                    block_size=block_size, parts=tuple(parts))


def build_attn_meta(starts: list[int], q_lens: list[int], block_tables: list[list[int]], block_size: int,
                    device: torch.device | str = "cpu", grouped: bool | None = None) -> AttnMeta:
    """Attention metadata for one step on ``device``. ``grouped``: a mixed step's decodes and prompts
    in separate kernel calls (default: where the prefill kernel is the plain-torch one, on a CPU)."""
    if grouped is None:
        grouped = kernels.resolve_impl(None, torch.device(device)) != "triton"
    return to_device(host_meta(starts, q_lens, block_tables, block_size, split=grouped), block_size, device)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttnMeta, scale: float) -> torch.Tensor:
    """Write this step's K/V to the pool, attend over each sequence's context.

    q: (T, Hq, D); k, v: (T, Hkv, D); k_cache, v_cache: (S, Hkv, D). Returns (T, Hq * D).
    """
    T, Hq, D = q.shape
    kc = k_cache.view(-1, meta.block_size, *k_cache.shape[1:])  # (S / bs, bs, Hkv, D), no copy
    vc = v_cache.view(-1, meta.block_size, *v_cache.shape[1:])
    kernels.store_kv(k, v, kc, vc, meta.slot_mapping)
    if meta.grids is not None:  # the contexts kept contiguous between steps (plain-torch kernels)
        meta.grids.write_through(k_cache, k, v, meta.slot_mapping)
        if meta.grids.step is not None:
            return meta.grids.attend(q, k_cache, v_cache, scale).view(T, Hq * D)
    if len(meta.parts) == 1:
        return _attend(q, kc, vc, meta.parts[0], scale).view(T, Hq * D)
    out = q.new_empty(T, Hq, D)
    for p in meta.parts:
        out[p.tokens] = _attend(q[p.tokens], kc, vc, p, scale)
    return out.view(T, Hq * D)


def _attend(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, p: AttnPart, scale: float) -> torch.Tensor:
    """One part's attention: its queries (T_p, Hq, D) -> (T_p, Hq, D)."""
    if p.max_query_len == 1:
        return kernels.paged_decode_attention(q, kc, vc, p.block_tables, p.context_lens, scale)
    return kernels.paged_prefill_attention(q, kc, vc, p.block_tables, p.query_start_loc, p.context_lens, scale,
                                           max_query_len=p.max_query_len)
