"""KV admission over a replica's pool of blocks, and pre-emption: one rule, two clocks.

The simulator's decoding replicas (``sim/replicas/kv.py``) and the runtime's ``ReplicaScheduler``
both decide with these functions, over the same few numbers (blocks free, blocks in the pool, and
per running sequence its id, blocks held and tokens cached). Pure Python: no torch, no sockets.

Two modes (``KV_ADMISSIONS``):

* ``"reserve"``: a request holds prompt + ``max_tokens`` (whole blocks) from admission
  (``policies.batching.kv_reservation``), so a running request never runs out of room and nothing
  is ever pre-empted. The simulator's requests carry their true output length as ``max_tokens``.
* ``"paged"`` (vLLM's block manager): a sequence holds the blocks its cached tokens fill. Admission
  takes the blocks of the tokens its prefill writes (``prefill_blocks``) while, after them, at least
  a watermark of the pool stays free (``can_admit_paged``; vLLM's ``watermark=0.01``). Every decode
  step writes one more token, which takes a new block when the last one is full (``step_growth``).
  When the step's new blocks do not fit, the sequence that arrived last is pre-empted (its blocks
  freed) until they do (``preemptions``; vLLM pre-empts from the back of its running queue) and goes
  back to the head of the waiting queue, to be *recomputed*: its prompt and the tokens it had made
  are prefilled again, and that prefill samples its next token, as in vLLM. A step that pre-empts
  admits no new prompt (vLLM v0's scheduler does the same), and the last running sequence is
  never pre-empted (the runtime refuses, at submission, a request whose prompt + ``max_tokens``
  cannot fit the empty pool; the simulator lets a lone larger one overflow, nothing is dropped).

Accounting conventions (both sides keep them): a sequence whose KV holds ``cached`` tokens holds
``blocks_for(cached)`` blocks, except an admitted prompt not yet (fully) prefilled, which already
holds the blocks of its whole prefill.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, MutableSequence
from dataclasses import dataclass
from typing import Literal, TypeVar

T = TypeVar("T")

KVAdmission = Literal["reserve", "paged"]
KV_ADMISSIONS = ("reserve", "paged")
DEFAULT_WATERMARK = 0.01  # share of the pool an admission must leave free (vLLM's default)


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks of ``block_size`` tokens that ``tokens`` tokens of KV fill."""
    return -(-int(tokens) // block_size)


def pool_tokens(tokens: float, block_size: int) -> int:
    """The tokens a KV pool of room for ``tokens`` holds: whole blocks only (the runtime's block
    manager hands out blocks, so the simulator sizes its pools the same way)."""
    return int(tokens // block_size) * block_size


def watermark_blocks(total_blocks: int, watermark: float = DEFAULT_WATERMARK) -> int:
    return int(watermark * total_blocks)


def prefill_blocks(prefill_tokens: int, block_size: int) -> int:
    """Blocks a paged admission takes: those of every token its (re-)prefill writes."""
    return blocks_for(prefill_tokens, block_size)


def can_admit_paged(free_blocks: int, total_blocks: int, need_blocks: int,
                    watermark: float = DEFAULT_WATERMARK) -> bool:
    """Whether a prompt needing ``need_blocks`` is admitted into a pool with ``free_blocks`` free
    (after the blocks the step's decodes take). An empty pool takes any prompt (the caller made sure
    it can ever fit), so a prompt near the pool's size is not locked out by the watermark."""
    if free_blocks >= total_blocks:
        return True
    return free_blocks - need_blocks >= watermark_blocks(total_blocks, watermark)


def decode_growth(cached: int, block_size: int, steps: int = 1) -> int:
    """New blocks a sequence with ``cached`` tokens of KV takes over its next ``steps`` decode steps
    (each writes one token)."""
    return blocks_for(cached + steps, block_size) - blocks_for(cached, block_size)


@dataclass(frozen=True)
class RunningKV:
    """One running sequence as the pre-emption rule sees it."""

    id: int  # arrival order: a larger id arrived later
    blocks: int  # blocks it holds now
    growth: int  # blocks its next step takes (0 when it is not in the step, or prefilling)


def step_growth(running: Iterable[RunningKV]) -> int:
    return sum(s.growth for s in running)


def preemptions(running: list[RunningKV], free_blocks: int) -> list[int]:
    """Ids to pre-empt, in order, so the step's new blocks fit: the latest arrival first, never the
    last sequence left. Empty when the step fits as it is. O(n log n)."""
    order = sorted(running, key=lambda s: s.id)
    need = step_growth(order)
    victims: list[int] = []
    while need > free_blocks and len(order) > 1:
        s = order.pop()
        victims.append(s.id)
        free_blocks += s.blocks
        need -= s.growth
    return victims


class BatchBlocks:
    """The blocks a batch of decoding sequences holds, as aggregates: the simulator advances a whole
    batch one token per step, so it needs Σ ``blocks_for(cached + t)`` at any step ``t`` without a
    loop over the sequences. Each sequence is added with ``offset`` = tokens cached − the step count
    ``t`` at which it has them; writing ``offset + block_size − 1 = a·B + r`` per sequence and
    ``t = q·B + u``, the sum is Σa + n·q + #{r ≥ B − u} (O(B) per question, O(1) per change)."""

    __slots__ = ("block_size", "n", "sum_a", "res")

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.n = self.sum_a = 0
        self.res = [0] * block_size  # sequences per residue r

    def add(self, offset: int, sign: int = 1) -> None:
        a, r = divmod(offset + self.block_size - 1, self.block_size)
        self.n += sign
        self.sum_a += sign * a
        self.res[r] += sign

    def remove(self, offset: int) -> None:
        self.add(offset, -1)

    def blocks(self, t: int) -> int:
        """Σ ``blocks_for(offset + t)`` over the sequences."""
        q, u = divmod(t, self.block_size)
        return self.sum_a + self.n * q + (sum(self.res[self.block_size - u:]) if u else 0)

    def growth(self, t: int, steps: int = 1) -> int:
        """New blocks the batch takes over the ``steps`` decode steps after step ``t``."""
        return self.blocks(t + steps) - self.blocks(t)

    def steps_that_fit(self, t: int, free_blocks: int, limit: int) -> int:
        """The most decode steps (≤ ``limit``) from step ``t`` before the batch's new blocks exceed
        ``free_blocks`` — each step of the runtime's scheduler checks the same (``step_growth`` ≤
        free), so a simulated segment of this many steps pre-empts nowhere the runtime would."""
        if self.growth(t, limit) <= free_blocks:
            return limit
        lo, hi = 0, limit  # growth over lo steps fits, over hi does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.growth(t, mid) <= free_blocks:
                lo = mid
            else:
                hi = mid
        return lo


def steps_that_fit(cached: list[int], free_blocks: int, block_size: int, limit: int) -> int:
    """``BatchBlocks.steps_that_fit`` for sequences caching ``cached`` tokens now."""
    batch = BatchBlocks(block_size)
    for c in cached:
        batch.add(c)
    return batch.steps_that_fit(0, free_blocks, limit)


def requeue(queue: MutableSequence[T], item: T, order: Callable[[T], int], preempted: Callable[[T], bool]) -> None:
    """Put a pre-empted ``item`` back at the head of a waiting ``queue``, to be recomputed when
    admitted: in arrival order (``order``) behind the pre-empted ones that arrived earlier, before
    everything else (vLLM puts pre-empted sequences back at the front of its waiting queue)."""
    i, key = 0, order(item)
    while i < len(queue) and order(queue[i]) < key and preempted(queue[i]):
        i += 1
    queue.insert(i, item)
