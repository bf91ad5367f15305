"""The kernels in plain torch: any device, any dtype, vectorised (no per-sequence Python).

Attention here gathers each sequence's context from the pool into a padded grid and runs
``scaled_dot_product_attention`` over it with a mask; that copy is what the Triton path avoids.
Shapes and rules are those of the package docstring (``hetserve.runtime.kernels``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write row t of k, v to slot ``slot_mapping[t]`` of the caches; slots of -1 are skipped."""
    keep = slot_mapping >= 0  # (T,)
    slots = slot_mapping[keep].long()
    _flat(k_cache).index_copy_(0, slots, k[keep].to(k_cache.dtype))
    _flat(v_cache).index_copy_(0, slots, v[keep].to(v_cache.dtype))


def _flat(cache: torch.Tensor) -> torch.Tensor:
    """(num_blocks, block_size, Hkv, D) -> (slots, Hkv, D), a view of the same memory."""
    return cache.view(-1, *cache.shape[2:])


def gather_context(cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                   max_context: int) -> torch.Tensor:
    """Each sequence's context, position by position, as a (B, max(max_context, 1), Hkv, D) grid.

    One ``index_select`` of slots. Positions past a sequence's context repeat its position 0, so the
    grid holds only what the sequence wrote: a slot nobody wrote may hold anything, NaN included,
    which a masked softmax would still carry into its sum (0 * NaN). A row of context 0 reads an
    arbitrary slot (table entries are clamped into the pool); its caller drops that row's output.
    """
    B, block_size = block_tables.shape[0], cache.shape[1]
    flat = _flat(cache)  # (slots, Hkv, D)
    pos = torch.arange(max(max_context, 1), device=cache.device)  # (K,)
    blocks = block_tables.long().gather(1, (pos // block_size).expand(B, -1))  # (B, K)
    slots = blocks * block_size + pos % block_size
    slots = torch.where(pos[None, :] < context_lens.long()[:, None], slots, slots[:, :1])
    slots = slots.clamp_(0, flat.shape[0] - 1)
    return flat.index_select(0, slots.flatten()).view(B, pos.shape[0], *cache.shape[2:])


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """One query per sequence over its whole context; rows of context 0 give zeros.

    The ``Hq / Hkv`` query heads of a KV head attend as that head's query rows, (B, Hkv, G, D), so
    the keys and values are never repeated per query head.
    """
    B, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    max_context = int(context_lens.max()) if B else 0
    keys = gather_context(k_cache, block_tables, context_lens, max_context)  # (B, K, Hkv, D)
    values = gather_context(v_cache, block_tables, context_lens, max_context)
    k_pos = torch.arange(keys.shape[1], device=q.device)  # (K,)
    ctx = context_lens.long()[:, None]  # (B, 1)
    # a row of context 0 attends to key 0, so softmax never sees an all-masked row; its output
    # (whatever its grid held) is then replaced by zeros
    mask = (k_pos[None, :] < ctx) | ((ctx == 0) & (k_pos[None, :] == 0))  # (B, K)
    grouped = q.view(B, Hkv, Hq // Hkv, D).transpose(1, 2)  # (B, G, Hkv, D): G query rows per KV head
    out = _sdpa(grouped, keys, values, mask[:, None, None, :], scale)  # (B, G, Hkv, D)
    out = out.transpose(1, 2).reshape(B, Hq, D)
    return torch.where(ctx[:, :, None] == 0, torch.zeros((), dtype=out.dtype, device=out.device), out)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                            context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Packed queries of several sequences, each causal over its pool context; see the package doc."""
    T, Hq, D = q.shape
    B = context_lens.shape[0]
    out = torch.zeros_like(q)
    if T == 0 or B == 0:
        return out
    qsl = query_start_loc.long()
    q_len = qsl[1:] - qsl[:-1]  # (B,)
    ctx = context_lens.long()  # (B,)
    max_q, max_context = int(q_len.max()), int(ctx.max())
    keys = gather_context(k_cache, block_tables, context_lens, max_context)  # (B, K, Hkv, D)
    values = gather_context(v_cache, block_tables, context_lens, max_context)
    q_idx = torch.arange(max_q, device=q.device)  # (Q,)
    q_valid = q_idx[None, :] < q_len[:, None]  # (B, Q)
    token = (qsl[:-1, None] + q_idx[None, :])[q_valid]  # (T,) each grid row's row of q
    grid = q.new_zeros(B, max_q, Hq, D)
    grid[q_valid] = q[token]
    q_pos = (ctx - q_len)[:, None] + q_idx[None, :]  # (B, Q) absolute position of each query
    k_pos = torch.arange(keys.shape[1], device=q.device)  # (K,)
    mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & (k_pos[None, None, :] < ctx[:, None, None])  # (B, Q, K)
    # padded query rows attend to key 0 only, so softmax never sees an all-masked row
    mask |= (~q_valid)[:, :, None] & (k_pos == 0)[None, None, :]
    attended = _sdpa(grid, keys, values, mask[:, None], scale)  # (B, Q, Hq, D)
    out[token] = attended[q_valid]
    return out


def _sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q (B, Q, Hq, D) over keys/values (B, K, Hkv, D) with mask (B, 1, Q, K) -> (B, Q, Hq, D).

    Half-precision inputs stay in their dtype: torch's attention kernels accumulate them in float32
    (the kernels' rule), and a float32 copy of the grid would cost more than the attention itself.
    """
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
        attn_mask=mask, scale=scale, enable_gqa=q.shape[2] != keys.shape[2])  # (B, Hq, Q, D)
    return out.transpose(1, 2)
