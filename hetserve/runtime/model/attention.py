"""Attention over a paged KV pool, for a batch mixing prefills and decodes.

A step runs ``T`` new tokens from ``B`` sequences; sequence ``b`` has ``start[b]`` tokens already in
the KV pool and ``q_len[b]`` new ones (a prefill: the prompt; a decode: one token). Linear layers
see the flat ``(T, hidden)`` batch; only attention needs the per-sequence view, described by
``AttnMeta`` (built once per step, shared by every layer):

- each new token's K/V is written to its slot (``slot_mapping``);
- the sequences attend in groups (``AttnGroup``): the decoding ones (one new token each) in one,
  the prompts (or prompt chunks) in another. Within a group each sequence's whole context is
  gathered from its slots into a padded ``(B_g, K_g)`` grid, its queries scattered into a padded
  ``(B_g, Q_g)`` grid, attend with a causal mask offset by ``start``, and are gathered back.

Why two groups: one grid pads every sequence to the longest query of the step, so a decode beside a
128-token prompt would attend as 128 rows, 127 of them padding: 1.7-17.8x the attention time of
two grids over prompts of 32-512 tokens beside 1-16 decodes on the CPU demo (``python -m
bench.bench_attention``), and a mixed step the cost model cannot price (it prices no padding).

Slot of position ``p`` of a sequence with block table ``bt``: ``bt[p // block_size] * block_size +
p % block_size``. Cost per layer: O(Σ_g B_g * Q_g * K_g * heads * head_dim).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttnGroup:
    """Sequences of a step that attend in one padded grid."""

    tokens: torch.Tensor | None  # (T_g,) the group's tokens among the step's T; None: all of them, in order
    gather_slots: torch.Tensor  # (B_g, K_g) slots of each sequence's context, padded with slot 0
    mask: torch.Tensor  # (B_g, 1, Q_g, K_g) bool, True = may attend
    q_dest: torch.Tensor  # (T_g,) index of each of its tokens in the flattened (B_g * Q_g) query grid
    num_seqs: int
    max_q: int


@dataclass
class AttnMeta:
    positions: torch.Tensor  # (T,) absolute position of each new token
    slot_mapping: torch.Tensor  # (T,) KV slot each new token writes
    last_token: torch.Tensor  # (B,) index in T of each sequence's last new token
    num_seqs: int
    groups: tuple[AttnGroup, ...]


def build_attn_meta(starts: list[int], q_lens: list[int], block_tables: list[list[int]], block_size: int,
                    device: torch.device | str = "cpu", grouped: bool = True) -> AttnMeta:
    """Attention metadata for one step. Running time O(B * (Q + K)) tensor work, no per-token Python.
    ``grouped=False``: every sequence in one padded grid (``bench.bench_attention`` measures both)."""
    start = torch.tensor(starts, dtype=torch.long)  # (B,)
    q_len = torch.tensor(q_lens, dtype=torch.long)  # (B,)
    first = torch.cumsum(q_len, 0) - q_len  # (B,) index in T of each sequence's first new token
    decoding = q_len == 1
    mixed = grouped and bool(decoding.any()) and not bool(decoding.all())
    kinds = [decoding, ~decoding] if mixed else [None]
    positions = torch.empty(int(q_len.sum()), dtype=torch.long)  # (T,)
    slot_mapping = torch.empty_like(positions)
    groups = []
    for members in kinds:
        idx = torch.arange(len(q_lens)) if members is None else torch.nonzero(members).flatten()
        g, tokens, pos, slots = _group(start[idx], q_len[idx], first[idx], [block_tables[i] for i in idx.tolist()],
                                       block_size, device, whole=members is None)
        positions[tokens], slot_mapping[tokens] = pos, slots
        groups.append(g)
    return AttnMeta(positions=positions.to(device), slot_mapping=slot_mapping.to(device),
                    last_token=(first + q_len - 1).to(device), num_seqs=len(q_lens), groups=tuple(groups))


def _group(start: torch.Tensor, q_len: torch.Tensor, first: torch.Tensor, block_tables: list[list[int]],
           block_size: int, device, whole: bool) -> tuple[AttnGroup, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One group's padded grid; also its tokens' indices in T, their positions and KV slots."""
    B = len(block_tables)
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
    tokens = (first[:, None] + q_idx[None, :])[q_valid]  # (T_g,) in T, sequence by sequence
    slot_of = slots.gather(1, q_pos.clamp(max=max_k - 1))[q_valid]  # (T_g,)
    q_dest = (torch.arange(B)[:, None] * max_q + q_idx[None, :])[q_valid]  # (T_g,)
    group = AttnGroup(tokens=None if whole else tokens.to(device), gather_slots=gather_slots.to(device),
                      mask=mask[:, None].to(device), q_dest=q_dest.to(device), num_seqs=B, max_q=max_q)
    return group, tokens, q_pos[q_valid], slot_of


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttnMeta, scale: float) -> torch.Tensor:
    """Write this step's K/V to the pool, attend over each sequence's context.

    q: (T, Hq, D); k, v: (T, Hkv, D); k_cache, v_cache: (S, Hkv, D). Returns (T, Hq * D).
    """
    k_cache[meta.slot_mapping] = k
    v_cache[meta.slot_mapping] = v
    if len(meta.groups) == 1:
        return _attend(q, k_cache, v_cache, meta.groups[0], scale)
    T, Hq, D = q.shape
    out = q.new_empty(T, Hq * D)
    for g in meta.groups:
        out[g.tokens] = _attend(q[g.tokens], k_cache, v_cache, g, scale)
    return out


def _attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, g: AttnGroup, scale: float) -> torch.Tensor:
    """One group's attention: its queries (T_g, Hq, D) over its sequences' contexts -> (T_g, Hq * D)."""
    _, Hq, D = q.shape
    keys = k_cache[g.gather_slots]  # (B, K, Hkv, D)
    values = v_cache[g.gather_slots]  # (B, K, Hkv, D)
    Hkv = keys.shape[2]
    B, Q = g.num_seqs, g.max_q
    if Q == 1:  # every sequence decodes one token: the grid is the batch itself
        queries = q.view(B, 1, Hq, D)
    else:
        queries = q.new_zeros(B * Q, Hq, D)
        queries[g.q_dest] = q
        queries = queries.view(B, Q, Hq, D)
    out = F.scaled_dot_product_attention(
        queries.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),  # (B, H, Q|K, D)
        attn_mask=g.mask, scale=scale, enable_gqa=Hq != Hkv)  # (B, Hq, Q, D)
    out = out.transpose(1, 2).reshape(B * Q, Hq * D)  # (B*Q, Hq*D)
    return out if Q == 1 else out[g.q_dest]
