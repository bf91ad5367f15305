"""One worker's KV cache: a fixed pool of slots for its layers and its KV heads.

``k`` and ``v`` are ``(num_layers, num_slots, num_kv_heads_local, head_dim)``; the coordinator's
``BlockManager`` decides which slots a request owns. ``read`` / ``write`` move a rectangle
(layers x slots x heads) out of and into the pool for the prefill -> decode hand-off; they may run
on a receiver thread while the step loop computes, because a request's slots are touched by steps
only after its hand-off is acknowledged.
"""

from __future__ import annotations

import torch


class KVPool:
    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        shape = (num_layers, num_slots, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer (k, v) views of shape (num_slots, heads, head_dim)."""
        return [(self.k[i], self.v[i]) for i in range(self.k.shape[0])]

    def read(self, layers: slice, heads: slice, slots: torch.Tensor) -> torch.Tensor:
        """(num_layers, 2, num_slots, num_heads, head_dim) copy of the rectangle."""
        slots = slots.to(self.k.device)
        return torch.stack((self.k[layers][:, slots, heads], self.v[layers][:, slots, heads]), dim=1)

    def write(self, layers: slice, heads: slice, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """Inverse of ``read``: ``kv`` is (num_layers, 2, num_slots, num_heads, head_dim)."""
        slots = slots.to(self.k.device)
        kv = kv.to(device=self.k.device, dtype=self.k.dtype)
        self.k[layers, slots, heads] = kv[:, 0]
        self.v[layers, slots, heads] = kv[:, 1]


def slots_of(block_table: list[int], num_tokens: int, block_size: int) -> torch.Tensor:
    """Slots of positions ``0 .. num_tokens - 1`` for ``block_table``. (num_tokens,) long."""
    pos = torch.arange(num_tokens)
    table = torch.tensor(block_table, dtype=torch.long)
    return table[pos // block_size] * block_size + pos % block_size
