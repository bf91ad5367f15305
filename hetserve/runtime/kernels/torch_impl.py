"""The kernels in plain torch: any device, any dtype, vectorised (no per-sequence Python).

Attention here gathers each sequence's whole blocks from the pool into a padded grid and runs
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


def gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                  max_context: int) -> torch.Tensor:
    """Each sequence's first ``ceil(max_context / block_size)`` blocks, as a (B, K, Hkv, D) grid.

    Table entries past a sequence's own blocks are replaced by block 0, so padding in the table
    cannot index out of range; positions at or past a sequence's context are zeroed, since a slot
    nobody wrote may hold NaN, which a masked softmax would still carry into its sum (0 * NaN).
    """
    block_size = cache.shape[1]
    num_blocks = max(1, -(-max_context // block_size))
    table = block_tables[:, :num_blocks].long()  # (B, NB)
    used = -(-context_lens.long() // block_size)  # (B,) blocks each sequence holds
    owned = torch.arange(num_blocks, device=table.device)[None, :] < used[:, None]  # (B, NB)
    table = torch.where(owned, table, torch.zeros_like(table))
    grid = cache[table].flatten(1, 2)  # (B, NB * block_size, Hkv, D)
    k_pos = torch.arange(grid.shape[1], device=grid.device)  # (K,)
    in_ctx = k_pos[None, :] < context_lens.long()[:, None]  # (B, K)
    return grid.masked_fill_(~in_ctx[:, :, None, None], 0)  # in place: the gather made a fresh copy


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """One query per sequence over its whole context; rows of context 0 give zeros."""
    B = q.shape[0]
    max_context = int(context_lens.max()) if B else 0
    keys = gather_blocks(k_cache, block_tables, context_lens, max_context)  # (B, K, Hkv, D)
    values = gather_blocks(v_cache, block_tables, context_lens, max_context)
    k_pos = torch.arange(keys.shape[1], device=q.device)  # (K,)
    ctx = context_lens.long()[:, None]  # (B, 1)
    # a row of context 0 attends to key 0 (zeroed by gather_blocks), so softmax never sees an
    # all-masked row and the row's output is zeros
    mask = (k_pos[None, :] < ctx) | ((ctx == 0) & (k_pos[None, :] == 0))  # (B, K)
    return _sdpa(q[:, None], keys, values, mask[:, None, None, :], scale)[:, 0]  # (B, Hq, D)


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
    keys = gather_blocks(k_cache, block_tables, context_lens, max_context)  # (B, K, Hkv, D)
    values = gather_blocks(v_cache, block_tables, context_lens, max_context)
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

    Half-precision inputs attend in float32 (the kernels' accumulation rule) and come back in their dtype.
    """
    dtype = q.dtype
    work = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2).to(work), keys.transpose(1, 2).to(work), values.transpose(1, 2).to(work),
        attn_mask=mask, scale=scale, enable_gqa=q.shape[2] != keys.shape[2])  # (B, Hq, Q, D)
    return out.transpose(1, 2).to(dtype)
