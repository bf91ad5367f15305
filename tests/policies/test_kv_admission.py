"""The paged KV admission rule (``policies.kv_admission``) and the runtime scheduler driving it.

The simulator's ``PagedKV`` runs on the same functions; ``tests/runtime/test_batching_equivalence.py``
checks the two pre-empt the same requests at the same steps, and ``tests/sim/test_paged_kv.py`` the
simulator's behaviour under load.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest

from hetserve.policies.kv_admission import (BatchBlocks, RunningKV, blocks_for, can_admit_paged, decode_growth, preemptions,
                                            requeue, steps_that_fit, watermark_blocks)


def test_blocks_growth_and_watermark():
    assert [blocks_for(t, 16) for t in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]
    # a decode step takes a block only when the last one is full (cached 16 -> writes the 17th token)
    assert [decode_growth(c, 16) for c in (15, 16, 17, 31, 32)] == [0, 1, 0, 0, 1]
    assert decode_growth(16, 16, steps=17) == 2
    assert watermark_blocks(100) == 1 and watermark_blocks(99) == 0
    assert can_admit_paged(10, 100, 9) and not can_admit_paged(10, 100, 10)  # one block stays free
    assert can_admit_paged(100, 100, 100)  # an empty pool takes a prompt the watermark would refuse


def test_preemptions_take_the_latest_arrival_first_and_never_the_last():
    run = [RunningKV(3, 4, 1), RunningKV(1, 5, 1), RunningKV(7, 2, 0), RunningKV(5, 3, 1)]
    assert preemptions(run, 3) == []  # 3 new blocks, 3 free: fits
    assert preemptions(run, 2) == [7]  # 7 arrived last (it does not even grow): its 2 blocks free room
    assert preemptions(run, -3) == [7, 5]  # 2 + 3 freed: 2 free, 2 needed (1 and 3 grow)
    assert preemptions(run, -100) == [7, 5, 3]  # never the last one (1)
    assert preemptions([RunningKV(1, 5, 1)], 0) == []


@pytest.mark.parametrize("seed", range(5))
def test_steps_that_fit_is_the_step_by_step_rule(seed):
    """A simulated segment of ``steps_that_fit`` steps is what the runtime's per-step check allows."""
    rng = np.random.default_rng(seed)
    cached = [int(c) for c in rng.integers(1, 80, rng.integers(1, 6))]
    free = int(rng.integers(0, 8))
    steps, left, c = 0, free, list(cached)
    while steps < 60:  # the runtime: each step takes its decodes' new blocks while they fit
        need = sum(decode_growth(x, 16) for x in c)
        if need > left:
            break
        left -= need
        c = [x + 1 for x in c]
        steps += 1
    assert steps_that_fit(cached, free, 16, 60) == steps


def test_requeue_puts_the_preempted_first_in_arrival_order():
    made = {2: 5, 6: 1}  # 2 and 6 were pre-empted earlier and wait at the head
    queue = [2, 6, 3, 9]
    for rid in (7, 4):  # pre-empted now, latest arrival first
        made[rid] = 1
        requeue(queue, rid, int, lambda r: r in made)
    assert queue == [2, 4, 6, 7, 3, 9]


def test_batch_blocks_aggregates_equal_the_sum_over_sequences():
    rng = np.random.default_rng(7)
    batch, offsets = BatchBlocks(16), []
    for _ in range(60):
        if offsets and rng.random() < 0.3:
            batch.remove(offsets.pop(int(rng.integers(len(offsets)))))
        else:
            offsets.append(int(rng.integers(-40, 200)))  # offset = cached - step count: may be negative
            batch.add(offsets[-1])
        t = int(rng.integers(40, 120))
        assert batch.blocks(t) == sum(blocks_for(o + t, 16) for o in offsets)
        assert batch.growth(t) == sum(decode_growth(o + t, 16) for o in offsets)


def _seq(i, prompt_len, max_tokens):
    from hetserve.runtime.handle import RequestHandle
    from hetserve.runtime.params import SamplingParams
    from hetserve.runtime.sequence import Sequence

    return Sequence(i, [1] * prompt_len, SamplingParams(max_tokens=max_tokens), 0, frozenset(),
                    RequestHandle(i, prompt_len))


def _run_step(sched, step_id):
    """The coordinator's part: pre-empted sequences go back to the queue; the step ran; every
    sequence cached its input and sampled a token."""
    from hetserve.runtime.scheduler import requeue

    batch = sched.next_step(sched.waiting_q)
    for seq in sched.last_preempted:
        requeue(sched.waiting_q, seq)
    sched.start(step_id, batch)
    for s in sched.complete(step_id):
        s.num_cached += len(s.next_input()[1])
        s.output.append(9)
        sched.chunk_done(s)
        sched.ready.append(s)
    return batch


def test_scheduler_preempts_the_latest_frees_its_blocks_and_requeues_it_for_recompute():
    from hetserve.runtime.kv_cache import BlockManager
    from hetserve.runtime.scheduler import ReplicaScheduler
    from hetserve.runtime.sequence import Status

    sched = ReplicaScheduler("c0", "colocated", BlockManager(4, 4), num_stages=1, kv_admission="paged")
    # each fits the 16-token pool alone (4 + 12), not the three together
    a, b, late = _seq(1, 4, 12), _seq(2, 4, 12), _seq(3, 4, 12)
    sched.waiting_q = deque([a, b, late])
    first = _run_step(sched, 1)
    assert [s.id for s in first] == [1, 2, 3]  # paged: 1 block each at admission (reserve: 4 each)
    assert sched.blocks.num_free_blocks == 1
    second = _run_step(sched, 2)  # each decode writes its 5th token: 3 new blocks, 1 free
    assert sched.last_preempted == [late] and [s.id for s in second] == [1, 2]
    assert late.status == Status.WAITING and late.table == [] and late.num_cached == 0
    assert list(sched.waiting_q) == [late] and late.prefill_tokens == 5  # recomputes prompt + its token
    assert sched.blocks.num_free_blocks == 0 and [len(s.table) for s in (a, b)] == [2, 2]
    sched.waiting_q.append(_seq(4, 1, 2))
    third = _run_step(sched, 3)  # no room: 3 waits at the head, 4 behind it (FCFS)
    assert [s.id for s in third] == [1, 2] and [s.id for s in sched.waiting_q] == [3, 4]
    assert sched.stats()["preemptions"] == 1
    with pytest.raises(ValueError, match="kv_admission"):
        ReplicaScheduler("c0", "colocated", BlockManager(4, 4), num_stages=1, kv_admission="lazy")


def test_a_preempting_step_admits_no_prompt():
    from hetserve.runtime.kv_cache import BlockManager
    from hetserve.runtime.scheduler import ReplicaScheduler

    sched = ReplicaScheduler("c0", "colocated", BlockManager(6, 4), num_stages=1, kv_admission="paged")
    a, b = _seq(1, 4, 20), _seq(2, 8, 16)  # each fits the 24-token pool alone
    sched.waiting_q = deque([a, b])
    _run_step(sched, 1)  # a: 1 block, b: 2 blocks; 3 free
    sched.waiting_q.append(_seq(3, 4, 2))
    step = _run_step(sched, 2)  # a and b each take a block: 1 free; 3 (1 block) is admitted
    assert [s.id for s in step] == [1, 2, 3]
    sched.waiting_q.append(_seq(4, 1, 2))
    step = _run_step(sched, 3)  # 3 needs a block, none free: 3 pre-empted; 4 would fit but must wait
    assert [s.id for s in sched.last_preempted] == [3] and [s.id for s in step] == [1, 2]
    assert [s.id for s in sched.waiting_q] == [3, 4]
