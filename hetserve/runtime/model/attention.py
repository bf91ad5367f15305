"""Attention over a paged KV pool, for a batch mixing prefills and decodes.

A step runs ``T`` new tokens from ``B`` sequences; sequence ``b`` has ``start[b]`` tokens already in
the KV pool and ``q_len[b]`` new ones (a prefill: the prompt; a decode: one token). Linear layers
see the flat ``(T, hidden)`` batch; only attention needs the per-sequence view, described by
``AttnMeta`` (built once per step, shared by every layer):

- each new token's K/V is written to its slot (``slot_mapping``);
- each sequence's whole context is gathered from its slots into a padded ``(B, K)`` grid;
- queries are scattered into a padded ``(B, Q)`` grid, attend with a causal mask offset by
  ``start``, and are gathered back to ``(T, ...)``.

Slot of position ``p`` of a sequence with block table ``bt``: ``bt[p // block_size] * block_size +
p % block_size``. Cost per layer: O(B * Q * K * heads * head_dim).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttnMeta:
    positions: torch.Tensor  # (T,) absolute position of each new token
    slot_mapping: torch.Tensor  # (T,) KV slot each new token writes
    gather_slots: torch.Tensor  # (B, K) slots of each sequence's context, padded with slot 0
    mask: torch.Tensor  # (B, 1, Q, K) bool, True = may attend
    q_dest: torch.Tensor  # (T,) index of each token in the flattened (B * Q) query grid
    last_token: torch.Tensor  # (B,) index in T of each sequence's last new token
    num_seqs: int
    max_q: int


def build_attn_meta(starts: list[int], q_lens: list[int], block_tables: list[list[int]], block_size: int,
                    device: torch.device | str = "cpu") -> AttnMeta:
    """Attention metadata for one step. Running time O(B * (Q + K)) tensor work, no per-token Python."""
    B = len(q_lens)
    start = torch.tensor(starts, dtype=torch.long)  # (B,)
    q_len = torch.tensor(q_lens, dtype=torch.long)  # (B,)
    ctx_len = start + q_len  # (B,)
    max_q, max_k = int(q_len.max()), int(ctx_len.max())
    num_blocks = -(-max_k // block_size)
    bt = torch.zeros(B, num_blocks, dtype=torch.long)  # (B, NB)
    for b, table in enumerate(block_tables):
        n = min(len(table), num_blocks)
        bt[b, :n] = torch.tensor(table[:n], dtype=torch.long)
    k_pos = torch.arange(max_k)  # (K,)
    slots = bt.gather(1, (k_pos // block_size).expand(B, -1)) * block_size + k_pos % block_size  # (B, K)
    in_ctx = k_pos[None, :] < ctx_len[:, None]  # (B, K)
    gather_slots = torch.where(in_ctx, slots, torch.zeros_like(slots))
    q_idx = torch.arange(max_q)  # (Q,)
    q_pos = start[:, None] + q_idx[None, :]  # (B, Q)
    q_valid = q_idx[None, :] < q_len[:, None]  # (B, Q)
    mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & in_ctx[:, None, :]  # (B, Q, K)
    # padded query rows attend to key 0 only, so softmax never sees an all-masked row
    mask |= (~q_valid)[:, :, None] & (k_pos == 0)[None, None, :]
    slot_mapping = slots.gather(1, q_pos.clamp(max=max_k - 1))[q_valid]  # (T,)
    q_dest = (torch.arange(B)[:, None] * max_q + q_idx[None, :])[q_valid]  # (T,)
    return AttnMeta(
        positions=q_pos[q_valid].to(device), slot_mapping=slot_mapping.to(device),
        gather_slots=gather_slots.to(device), mask=mask[:, None].to(device), q_dest=q_dest.to(device),
        last_token=(torch.cumsum(q_len, 0) - 1).to(device), num_seqs=B, max_q=max_q)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttnMeta, scale: float) -> torch.Tensor:
    """Write this step's K/V to the pool, attend over each sequence's context.

    q: (T, Hq, D); k, v: (T, Hkv, D); k_cache, v_cache: (S, Hkv, D). Returns (T, Hq * D).
    """
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    k_cache[meta.slot_mapping] = k
    v_cache[meta.slot_mapping] = v
    keys = k_cache[meta.gather_slots]  # (B, K, Hkv, D)
    values = v_cache[meta.gather_slots]  # (B, K, Hkv, D)
    B, Q = meta.num_seqs, meta.max_q
    if Q == 1:  # every sequence decodes one token: the grid is the batch itself
        queries = q.view(B, 1, Hq, D)
    else:
        queries = q.new_zeros(B * Q, Hq, D)
        queries[meta.q_dest] = q
        queries = queries.view(B, Q, Hq, D)
    out = F.scaled_dot_product_attention(
        queries.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),  # (B, H, Q|K, D)
        attn_mask=meta.mask, scale=scale, enable_gqa=Hq != Hkv)  # (B, Hq, Q, D)
    out = out.transpose(1, 2).reshape(B * Q, Hq * D)  # (B*Q, Hq*D)
    return out if Q == 1 else out[meta.q_dest]
