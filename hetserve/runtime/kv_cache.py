"""Admission over a fixed-capacity KV pool: which blocks of a replica's pool each request holds.

One ``BlockManager`` per replica lives in the coordinator; every worker of the replica has a
``KVPool`` (``kv_pool.py``) with the same number of slots, holding its own layers and KV heads.
A block is ``block_size`` consecutive slots; a request's block table maps its token positions to
slots (``table[p // block_size] * block_size + p % block_size``).

What a request is given is the scheduler's decision (``policies.kv_admission``): by default its
whole KV (prompt + max new tokens) up front, so nothing is ever pre-empted; with paged admission
its prompt's blocks, then one block at a time as it grows (a pre-empted request's blocks come back
here). Ask ``can_allocate`` before ``allocate``. No torch here.

Sharing: the choices of one prompt (``n > 1``) hold the prompt's full blocks together. A block has a
reference count: ``allocate`` sets it to 1, ``share`` adds one per extra holder, ``free`` takes one
off and returns the block to the pool at 0. Shared blocks are only read (a holder writes past them,
into blocks of its own), so no copy is ever needed.

Invariant: ``free_blocks`` and the blocks with a reference count partition ``range(num_blocks)``.
"""

from __future__ import annotations

from collections import deque


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"need a positive pool (num_blocks={num_blocks}, block_size={block_size})")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.refs: dict[int, int] = {}  # block -> holders (blocks in use only)
        self.peak_used_blocks = 0  # the most blocks in use at once

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    @property
    def usage(self) -> float:
        """Fraction of the pool's blocks held by requests."""
        return self.num_used_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def fits_ever(self, num_tokens: int) -> bool:
        """Whether ``num_tokens`` could fit in the empty pool."""
        return self.blocks_needed(num_tokens) <= self.num_blocks

    def can_allocate(self, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) <= len(self.free_blocks)

    def allocate(self, num_tokens: int) -> list[int]:
        """Block table for ``num_tokens`` tokens. Raises ValueError if ``can_allocate`` is false."""
        n = self.blocks_needed(num_tokens)
        if n > len(self.free_blocks):
            raise ValueError(f"cannot allocate {n} blocks: {len(self.free_blocks)} free")
        table = [self.free_blocks.popleft() for _ in range(n)]
        for b in table:
            self.refs[b] = 1
        self.peak_used_blocks = max(self.peak_used_blocks, self.num_used_blocks)
        return table

    def share(self, blocks: list[int]) -> list[int]:
        """One more holder for each of ``blocks`` (in use); returns them, as the new holder's table part."""
        for b in blocks:
            assert self.refs.get(b, 0) > 0, f"block {b} is not in use"
            self.refs[b] += 1
        return list(blocks)

    def release_all(self) -> None:
        """The pool is gone (its replica's workers stopped): every block free, held by no one."""
        self.free_blocks = deque(range(self.num_blocks))
        self.refs.clear()

    def free(self, table: list[int]) -> None:
        """One holder fewer for each block of ``table``; a block nobody holds goes back to the pool.
        A block already free is left as it is: a second free of one table (a stale one, a released
        pool's) must not put a block in the pool twice, where two requests would then share it."""
        for b in table:
            held = self.refs.get(b)
            if held is None:
                continue
            if held > 1:
                self.refs[b] = held - 1
            else:
                del self.refs[b]
                self.free_blocks.append(b)
