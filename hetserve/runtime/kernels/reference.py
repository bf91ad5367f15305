"""Obviously-correct versions of the kernels, one sequence and one query at a time, in float64.

Slow on purpose: they follow the definitions in the package docstring word for word (look up
each position's slot, softmax over the scores) so the fast paths can be checked against them.
Only the heads of one query are computed together.
"""

from __future__ import annotations

import torch


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    block_size = k_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        k_cache[slot // block_size, slot % block_size] = k[t]
        v_cache[slot // block_size, slot % block_size] = v[t]


def context(cache: torch.Tensor, table: list[int], length: int) -> torch.Tensor:
    """Positions 0..length-1 of one sequence, read slot by slot -> (length, Hkv, D) float64."""
    block_size = cache.shape[1]
    rows = [cache[table[p // block_size], p % block_size] for p in range(length)]
    return torch.stack(rows).double() if rows else cache.new_zeros(0, *cache.shape[2:]).double()


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """One query (Hq, D) over keys/values (L, Hkv, D): head h reads KV head h // (Hq // Hkv) and
    returns softmax(q_h . k * scale) . v -> (Hq, D); zeros over no keys."""
    hq = q.shape[0]
    if keys.shape[0] == 0:
        return torch.zeros(q.shape, dtype=torch.float64)
    kv_head = torch.arange(hq) // (hq // keys.shape[1])  # (Hq,)
    keys, values = keys[:, kv_head], values[:, kv_head]  # (L, Hq, D)
    scores = torch.einsum("hd,lhd->hl", q.double(), keys) * scale  # (Hq, L)
    return torch.einsum("hl,lhd->hd", torch.softmax(scores, dim=1), values)


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale) -> torch.Tensor:
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b in range(q.shape[0]):
        n = int(context_lens[b])
        table = block_tables[b].tolist()
        out[b] = attend(q[b], context(k_cache, table, n), context(v_cache, table, n), scale)
    return out


def paged_prefill_attention(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale) -> torch.Tensor:
    out = torch.zeros(q.shape, dtype=torch.float64)
    starts = query_start_loc.tolist()
    for b in range(len(starts) - 1):
        n = int(context_lens[b])
        q_len = starts[b + 1] - starts[b]
        table = block_tables[b].tolist()
        keys, values = context(k_cache, table, n), context(v_cache, table, n)
        for i in range(q_len):
            visible = n - q_len + i + 1  # positions 0..own
            out[starts[b] + i] = attend(q[starts[b] + i], keys[:visible], values[:visible], scale)
    return out
