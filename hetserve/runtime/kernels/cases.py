"""Random inputs for checking the kernels (tests and ``bench/check_kernels.py`` share them).

A case is a KV pool whose blocks are handed to the sequences in shuffled order, block tables
padded with -1 past each sequence's blocks, and every slot no sequence owns filled with NaN: a
kernel that reads outside a context, or lets a masked position into a sum, returns NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOLERANCE = {"fp32": 2e-3, "bf16": 2e-2, "fp16": 2e-2}  # max abs error against reference.py


@dataclass(frozen=True)
class Shape:
    """One case's sizes; ``q_lens`` only for prefill (None: one query per sequence)."""

    context_lens: tuple[int, ...]
    num_kv_heads: int
    group: int  # query heads per KV head
    head_dim: int
    block_size: int
    dtype: str  # a key of DTYPES
    q_lens: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.q_lens is not None and any(q > c for q, c in zip(self.q_lens, self.context_lens)):
            raise ValueError(f"a sequence has more new tokens than context: {self.q_lens} vs {self.context_lens}")

    def describe(self) -> str:
        q = "" if self.q_lens is None else f" q={max(self.q_lens, default=0)}"
        return (f"B={len(self.context_lens)} ctx<={max(self.context_lens, default=0)}{q} "
                f"H={self.num_kv_heads * self.group}/{self.num_kv_heads} D={self.head_dim} bs={self.block_size}")


@dataclass
class Case:
    shape: Shape
    k_cache: torch.Tensor  # (num_blocks, block_size, Hkv, D)
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # (B, max_blocks) int32, -1 past each sequence's blocks
    context_lens: torch.Tensor  # (B,) int32
    q: torch.Tensor  # (B, Hq, D) decode; (T, Hq, D) prefill
    query_start_loc: torch.Tensor | None  # (B+1,) int32, prefill only
    scale: float


def make_case(shape: Shape, seed: int) -> Case:
    """A pool holding each sequence's context (random values), NaN everywhere else."""
    gen = torch.Generator().manual_seed(seed)
    dtype = DTYPES[shape.dtype]
    bs, hkv, d = shape.block_size, shape.num_kv_heads, shape.head_dim
    used = [-(-n // bs) for n in shape.context_lens]
    max_blocks = max(used + [1])
    num_blocks = sum(used) + 2  # spare blocks no sequence owns
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.full((len(used), max_blocks), -1, dtype=torch.int32)
    k_cache = torch.full((num_blocks, bs, hkv, d), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    for b, (n, nb) in enumerate(zip(shape.context_lens, used)):
        blocks, order = order[:nb], order[nb:]
        tables[b, :nb] = torch.tensor(blocks, dtype=torch.int32)
        k, v = torch.randn(2, n, hkv, d, generator=gen).to(dtype)  # (n, Hkv, D) each
        for i, block in enumerate(blocks):
            rows = slice(i * bs, min(n, (i + 1) * bs))
            k_cache[block, :rows.stop - rows.start] = k[rows]
            v_cache[block, :rows.stop - rows.start] = v[rows]
    hq = hkv * shape.group
    num_q = len(used) if shape.q_lens is None else sum(shape.q_lens)
    q = torch.randn(num_q, hq, d, generator=gen).to(dtype)
    qsl = None
    if shape.q_lens is not None:
        qsl = torch.tensor([0, *torch.tensor(shape.q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return Case(shape=shape, k_cache=k_cache, v_cache=v_cache, block_tables=tables,
                context_lens=torch.tensor(shape.context_lens, dtype=torch.int32), q=q,
                query_start_loc=qsl, scale=d ** -0.5)


def store_inputs(shape: Shape, seed: int, skip_every: int = 3):
    """New K/V rows for ``store_kv`` and their slots (every ``skip_every``-th row -1), over an empty pool."""
    gen = torch.Generator().manual_seed(seed)
    dtype = DTYPES[shape.dtype]
    bs, hkv, d = shape.block_size, shape.num_kv_heads, shape.head_dim
    rows = max(1, sum(shape.context_lens))
    num_blocks = -(-rows // bs) + 1
    slots = torch.randperm(num_blocks * bs, generator=gen)[:rows]
    slots[::skip_every] = -1
    k = torch.randn(rows, hkv, d, generator=gen).to(dtype)
    v = torch.randn(rows, hkv, d, generator=gen).to(dtype)
    k_cache = torch.zeros(num_blocks, bs, hkv, d, dtype=dtype)
    return k, v, k_cache, torch.zeros_like(k_cache), slots
