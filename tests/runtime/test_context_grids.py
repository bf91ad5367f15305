"""ContextGrids: decode attention over contexts kept between steps equals the gathering kernel's,
whatever joins, leaves, reuses blocks or writes the pool in between."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from hetserve.runtime.model.attention import build_attn_meta, host_meta, paged_attention
from hetserve.runtime.model.context_grids import ContextGrids

HQ, HKV, D, BS, SLOTS = 4, 2, 16, 4, 2048


# the C++ kernels split their rows between threads: checked with two (``two_torch_threads``)
pytestmark = pytest.mark.usefixtures("two_torch_threads")


class Pool:
    """One layer's pool, the grids over it, and sequences decoding through ``paged_attention``."""

    def __init__(self, seed: int, budget: int = 10 ** 9):
        torch.manual_seed(seed)
        self.k, self.v = torch.randn(SLOTS, HKV, D), torch.randn(SLOTS, HKV, D)
        self.grids = ContextGrids([(self.k, self.v)], BS, budget)
        self.seqs: dict[int, list] = {}  # id -> [tokens in the pool, blocks]

    def add(self, sid: int, tokens: int, blocks: list[int], how: str) -> None:
        """A sequence whose first ``tokens`` are written to the pool: by a prompt step's store
        (``"store"``) or by a hand-off (``"handoff"``: written outside a step, then announced)."""
        pos = torch.arange(tokens)
        slots = torch.tensor(blocks)[pos // BS] * BS + pos % BS
        k, v = torch.randn(tokens, HKV, D), torch.randn(tokens, HKV, D)
        self.k[slots], self.v[slots] = k, v
        if how == "store":
            self.grids.write_through(self.k, k, v, slots.int())
        else:
            self.grids.pool_written(slots)
        self.seqs[sid] = [tokens, list(blocks)]

    def decode(self, order: list[int], pad: int = 0) -> float:
        """One decode step of ``order`` (padded by ``pad`` rows); the largest difference from the
        gathering kernel on a copy of the pool. Checks the grids' maps are inverse."""
        starts = [self.seqs[s][0] for s in order]
        tables = [self.seqs[s][1] for s in order]
        B = len(order)
        q, k, v = torch.randn(B, HQ, D), torch.randn(B, HKV, D), torch.randn(B, HKV, D)
        meta = build_attn_meta(starts, [1] * B, tables, BS)
        want = paged_attention(q, k, v, self.k.clone(), self.v.clone(), meta, 0.25)
        hm = host_meta(starts, [1] * B, tables, BS)
        step = self.grids.plan(hm.parts[0][1], hm.parts[0][2], B + pad)
        assert step is not None
        check_inverse(self.grids)
        z = lambda t: torch.cat((t, t.new_zeros(pad, *t.shape[1:])))  # noqa: E731
        meta = build_attn_meta(starts + [0] * pad, [1] * B + [0] * pad, tables + [[0]] * pad, BS)
        meta.slot_mapping = torch.cat((meta.slot_mapping, torch.full((pad,), -1, dtype=torch.int32)))
        meta.grids = self.grids
        got = paged_attention(z(q), z(k), z(v), self.k, self.v, meta, 0.25)
        assert got[B:].abs().max().item() == 0 if pad else True  # padding rows give zeros
        for s in order:
            self.seqs[s][0] += 1
        return (got[:B] - want).abs().max().item()


def check_inverse(grids: ContextGrids) -> None:
    at = np.flatnonzero(grids.where >= 0)
    assert np.array_equal(grids.slots.flat[grids.where[at]], at), "where -> slots"
    held = np.flatnonzero(grids.slots.reshape(-1) >= 0)
    assert np.array_equal(grids.where[grids.slots.reshape(-1)[held]], held), "slots -> where"


@pytest.mark.parametrize("seed", range(2))
def test_grids_equal_the_gathering_kernel_through_joins_leaves_and_reuse(seed):
    rng = random.Random(seed)
    pool = Pool(seed)
    free = list(range(SLOTS // BS))
    rng.shuffle(free)
    finished: list[tuple[int, list[int]]] = []  # (tokens, blocks) of sequences that left
    next_id, worst, steps = 0, 0.0, 0
    for _ in range(120):
        if rng.random() < 0.3 and len(pool.seqs) < 12:
            how = rng.choice(("store", "handoff"))
            if finished and rng.random() < 0.5 and all(b in free for b in finished[-1][1]):
                tokens, blocks = finished.pop()  # the same blocks and length as one that left
                for b in blocks:
                    free.remove(b)
            else:
                tokens = rng.randrange(1, 30)
                blocks = [free.pop() for _ in range(-(-(tokens + 1) // BS))]
            pool.add(next_id, tokens, blocks, how)
            next_id += 1
        if rng.random() < 0.2 and pool.seqs:
            sid = rng.choice(sorted(pool.seqs))
            tokens, blocks = pool.seqs.pop(sid)
            finished.append((tokens - 1, blocks))
            free.extend(blocks)
        if not pool.seqs:
            continue
        order = sorted(pool.seqs)
        rng.shuffle(order)
        for s in order:  # room for this step's token
            while len(pool.seqs[s][1]) * BS < pool.seqs[s][0] + 1:
                pool.seqs[s][1].append(free.pop())
        worst = max(worst, pool.decode(order, pad=rng.choice((0, 3))))
        steps += 1
    assert steps > 60
    assert worst < 1e-5


@pytest.mark.parametrize("how", ["store", "handoff"])
def test_a_sequence_on_the_blocks_of_one_that_left_reads_its_own_keys(how):
    """B takes A's blocks in A's order with A's length: the row that mirrored A must not serve B,
    unless B's writes reached it (a store writes through; a hand-off drops every row)."""
    pool = Pool(0)
    pool.add(0, 9, [7, 3, 11], "store")
    pool.add(1, 5, [20, 21], "store")
    for _ in range(2):
        assert pool.decode([0, 1]) < 1e-5
    tokens, blocks = pool.seqs.pop(0)
    pool.add(2, tokens - 1, blocks, how)  # B's first decode has A's last context
    assert pool.decode([1, 2]) < 1e-5
    assert pool.decode([2, 1]) < 1e-5


def test_a_row_kept_for_a_shorter_context_forgets_the_rest():
    """B keeps A's first blocks but not the third; the slots A's row mirrored there go, so a later
    store to them (C on A's third block) does not write into B's row."""
    pool = Pool(0)
    pool.add(0, 11, [7, 3, 11], "store")
    assert pool.decode([0]) < 1e-5
    pool.seqs.pop(0)
    pool.add(1, 8, [7, 3, 15], "store")
    assert pool.decode([1]) < 1e-5
    pool.add(2, 3, [11], "store")
    for _ in range(3):
        assert pool.decode([1, 2]) < 1e-5


def test_shared_slots_and_budget_fall_back_to_gathering():
    pool = Pool(0)
    pool.add(0, 6, [1, 2], "store")
    pool.add(1, 6, [1, 2], "store")  # blocks shared by two sequences
    hm = host_meta([6, 6], [1, 1], [[1, 2], [1, 2]], BS)
    assert pool.grids.plan(hm.parts[0][1], hm.parts[0][2], 2) is None
    small = Pool(0, budget=1024)
    small.add(0, 6, [1, 2], "store")
    hm = host_meta([6], [1], [[1, 2]], BS)
    assert small.grids.plan(hm.parts[0][1], hm.parts[0][2], 1) is None
