"""KV admission on a decoding replica, as strategy objects (one per replica).

* ``ReserveKV`` — a request holds its prompt + whole (true) output from admission, so the pool
  never overflows and nothing is ever pre-empted (``policies.batching.kv_reservation``).
* ``PagedKV`` — vLLM's paged pool, decided by ``policies.kv_admission`` (the functions the runtime's
  scheduler calls): a request holds the blocks its cached tokens fill; admission takes the blocks of
  its prefill while a watermark stays free; at an iteration boundary where the next iteration's
  new blocks do not fit, the latest arrival is pre-empted, to be recomputed (its prompt + the tokens
  it had made prefilled again; that prefill samples its next token). A colocated replica puts it
  back at the head of its waiting queue; a decode replica sends it back to the prefill replica
  that prefilled it (``ReplicaEnv.recompute``), which re-prefills it and hands it off again — both
  as the runtime's engine does. ``RequestTable.made`` keeps the tokens it had made.

The replica (``decoding.Decoding``, which makes its strategy with ``make_kv_admission(self, ...)``)
asks the strategy; the strategy keeps its own bookkeeping, reads the replica it was given (``rep``:
its requests, limits, batch and clock) and adjusts the replica's ``kv_used`` (the pool's occupancy
in tokens, which the statistics and snapshots read).
Every question is asked at an iteration boundary, or, while a segment of iterations runs, about
its next boundary (``admits``).

A request with n choices holds KV for each (``sim.choices``): under ``ReserveKV`` a colocated
replica keeps the prompt's shared blocks once; under ``PagedKV`` nothing is shared (the engine's
paged pool counts a sequence's blocks as its own), and its choices are pre-empted together.
"""

from __future__ import annotations

from collections.abc import Sequence

from hetserve.policies.kv_admission import (BatchBlocks, RunningKV, blocks_for, can_admit_paged, decode_growth,
                                            preemptions)
from hetserve.sim.choices import fed_tokens, reservation, shared_tokens


class ReserveKV:
    grows = False  # KV use is fixed at admission

    def __init__(self, rep):
        self.rep = rep
        self.preemptions = 0
        # what ``shared`` reads of the replica, fixed for its life (asked at every offer)
        self._shares, self._block = rep.role == "colocated", rep.limits.block_size
        # rid -> ``need``, from its first ask until it finishes: it reads only the request's fixed
        # fields here (nothing is pre-empted), and is asked at each offer, admission and finish
        self._need: dict[int, int] = {}

    def shared(self, rid: int) -> int:
        """Prompt tokens ``rid``'s choices share here: on the replica that prefills them (colocated);
        a decode replica takes each choice's KV in a hand-off of its own."""
        return shared_tokens(self.rep.req, rid, self._block, False) if self._shares else 0

    def need(self, rid: int) -> float:
        """KV to reserve when admitting ``rid``: prompt + whole output (whole blocks), each choice's."""
        n = self._need.get(rid)
        if n is None:
            n = self._need[rid] = reservation(self.rep.req, rid, True, self.rep.limits.block_size, self.shared(rid))
        return n

    def prefill_tokens(self, rid: int) -> int:
        return fed_tokens(self.rep.req, rid, self.shared(rid))

    def made(self, rid: int) -> int:
        return 0

    def admits(self, rid: int, whole_segment: bool = False) -> bool:
        return self.rep.can_hold(self.rep.kv_used, self.need(rid))

    def admit(self, rid: int) -> None:
        self.rep.kv_add(self.need(rid))

    def join(self, rid: int) -> int:
        """``rid`` joins the batch: tokens it has generated so far (its first, from the prefill)."""
        return 1

    def finish(self, rid: int) -> None:
        self.rep.kv_add(-self.need(rid))
        del self._need[rid]

    def after_finish(self) -> None:
        pass

    def never_joins(self, rid: int) -> None:
        """``rid`` finished with its prefill's token (it never joins; ``finish`` frees its reservation)."""

    def at_boundary(self, j: int) -> None:
        pass

    def make_room(self, prefilling: Sequence[int] = ()) -> list[int]:
        return []

    def segment_limit(self) -> int | None:
        return None


class PagedKV:
    grows = True  # KV use grows as the contexts do

    def __init__(self, rep):
        self.rep = rep
        self.bs = rep.limits.block_size
        self.held = 0  # blocks of admitted requests outside the batch (prefilling, KV inbound, recomputing)
        self.off: dict[int, int] = {}  # batch member -> tokens cached minus the batch's iteration count
        self.blocks = BatchBlocks(self.bs)  # the members' blocks, as aggregates over ``off``
        self.preemptions = 0
        self.preempted_now = False  # the last boundary pre-empted: it admits no prompt (as the runtime)

    # ------------------------------------------------------------------ what the pool holds
    @property
    def total(self) -> int:
        """The pool's blocks (the runtime's too: its KV tokens // block size)."""
        return int(self.rep.kv_capacity // self.bs)

    def _used(self, j: int = 0) -> int:
        """Blocks held ``j`` iterations after the batch's last boundary."""
        return self.held + self.blocks.blocks(self.rep.batch.iteration + j)

    def _free_for_admission(self, whole_segment: bool) -> int:
        """Blocks free at the next boundary once its iteration's decodes have their new blocks (or,
        ``whole_segment``, beside everything the running segment will take)."""
        b = self.rep.batch
        if not b.active:
            j = 0
        elif whole_segment:
            j = b.k
        else:
            j = b.boundary_at_or_after(self.rep.loop.now)
        return self.total - self._used(j + 1)  # after the next iteration's new blocks

    def sync(self, j: int | None = None) -> None:
        """Set the replica's ``kv_used`` (tokens) to what the pool holds now."""
        rep = self.rep
        if j is None:
            j = rep.batch.iterations_done(rep.loop.now)
        rep.kv_add(self._used(j) * self.bs - rep.kv_used)

    # ------------------------------------------------------------------ admission
    def shared(self, rid: int) -> int:
        return 0

    def _cached(self, rid: int) -> int:
        """Tokens each choice of ``rid`` caches by its (re-)prefill: its prompt and the tokens it made
        before a pre-emption."""
        return self.rep.req.inp[rid] + self.rep.req.made[rid]

    def _prefill_blocks(self, rid: int) -> int:
        return self.rep.req.choices[rid] * blocks_for(self._cached(rid), self.bs)

    def prefill_tokens(self, rid: int) -> int:
        """Tokens ``rid``'s (re-)prefill writes, all its choices'."""
        return self.rep.req.choices[rid] * self._cached(rid)

    def made(self, rid: int) -> int:
        return self.rep.req.made[rid]

    def admits(self, rid: int, whole_segment: bool = False) -> bool:
        if self.preempted_now:
            return False
        need = self._prefill_blocks(rid)
        return can_admit_paged(self._free_for_admission(whole_segment), self.total, need)

    def admit(self, rid: int) -> None:
        self.held += self._prefill_blocks(rid)
        self.sync()

    def join(self, rid: int) -> int:
        self.held -= self._prefill_blocks(rid)
        self.off[rid] = self._cached(rid) - self.rep.batch.iteration
        self.blocks.add(self.off[rid], self.rep.req.choices[rid])
        return self.rep.req.made[rid] + 1  # its prefill sampled one more

    def finish(self, rid: int) -> None:
        if rid in self.off:
            self.blocks.add(self.off.pop(rid), -self.rep.req.choices[rid])

    def after_finish(self) -> None:
        self.sync()

    def never_joins(self, rid: int) -> None:
        self.held -= self._prefill_blocks(rid)  # its prompt's KV goes now

    def drop_prefilling(self, rid: int) -> None:
        """An admitted prompt not yet prefilled is pre-empted: its blocks go."""
        self.held -= self._prefill_blocks(rid)

    def at_boundary(self, j: int) -> None:
        """The pool is fullest just before the finishing requests leave."""
        self.sync(j)

    # ------------------------------------------------------------------ pre-emption
    def make_room(self, prefilling: Sequence[int] = ()) -> list[int]:
        """At a boundary: pre-empt (``kv_admission.preemptions``) until the next iteration's new
        blocks fit; batch members leave the batch here, ``prefilling`` ones (admitted prompts, not in
        the batch) are the replica's to drop. Returns the pre-empted ids, latest arrival first."""
        rep = self.rep
        b, r = rep.batch, rep.req
        free = self.total - self._used()
        if self.blocks.growth(b.iteration) <= free:
            self.preempted_now = False
            return []  # the next iteration fits (O(B), the common case)
        cached = {rid: o + b.iteration for rid, o in self.off.items()}  # per choice
        n = r.choices
        running = [RunningKV(rid, n[rid] * blocks_for(c, self.bs), n[rid] * decode_growth(c, self.bs))
                   for rid, c in cached.items()]
        running += [RunningKV(rid, self._prefill_blocks(rid), 0) for rid in prefilling]
        victims = preemptions(running, free)
        self.preempted_now = bool(victims)
        for rid in victims:
            if rid not in cached:
                continue
            c = cached[rid]
            self.blocks.add(self.off.pop(rid), -n[rid])
            b.remove(rid, n[rid] * (c + 1))  # the batch counts its sampled, not yet cached, token too
            rep.admitted -= n[rid]
            r.made[rid] = c - r.inp[rid] + 1
        self.preemptions += len(victims)
        if victims:
            self.sync(0)
        return victims

    def segment_limit(self) -> int | None:
        """Iterations the batch runs before a step's new blocks would not fit (the runtime pre-empts
        there). No admission is possible before then: the pool only fills during a segment."""
        b = self.rep.batch
        k = b.next_finish_iteration - b.iteration
        fit = self.blocks.steps_that_fit(b.iteration, self.total - self._used(), k)
        return None if fit >= k or fit == 0 else fit  # 0: a lone request larger than the pool runs anyway


def make_kv_admission(rep, paged: bool) -> ReserveKV | PagedKV:
    return PagedKV(rep) if paged else ReserveKV(rep)
