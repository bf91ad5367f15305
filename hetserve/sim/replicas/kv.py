"""KV admission on a decoding replica, as strategy objects (one per replica).

* ``ReserveKV`` — a request holds its prompt + whole (true) output from admission, so the pool
  never overflows and nothing is ever pre-empted.
* ``PagedKV`` — vLLM's paged pool: a request holds what its context has grown to; admission needs
  room for the prompt and its first token (plus a 1 % watermark); when an iteration would not
  fit, the newest running request is pre-empted and later re-prefilled (recompute).

The replica (``Decoding``) asks the strategy; the strategy keeps its own bookkeeping and adjusts
the replica's ``kv_used`` (the pool's occupancy, which the statistics and snapshots read).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hetserve.policies.batching import kv_reservation

if TYPE_CHECKING:  # pragma: no cover
    from hetserve.sim.replicas.decoding import Decoding


class ReserveKV:
    grows = False  # KV use is fixed at admission

    def __init__(self, rep: "Decoding"):
        self.rep = rep
        self.preempted: list[tuple[int, int]] = []  # always empty: nothing is pre-empted
        self.preemptions = 0

    def need(self, rid: int) -> float:
        """KV to reserve when admitting ``rid``: prompt + whole output (the shared policy's
        ``kv_reservation``, whole blocks)."""
        r = self.rep.req
        return kv_reservation(r.inp[rid], r.out[rid], True, self.rep.limits.block_size)

    def base(self) -> float:
        """KV an admission must fit beside: what is reserved."""
        return self.rep.kv_used

    def hold(self, tokens: float) -> None:
        self.rep._kv_add(tokens)

    def join(self, rid: int) -> int:
        """``rid`` joins the batch: tokens it has generated so far (its first, from the prefill)."""
        return 1

    def finish(self, rid: int) -> None:
        self.rep._kv_add(-self.need(rid))

    def after_finish(self) -> None:
        pass

    def never_joins(self, rid: int) -> None:
        """``rid`` finished with its first token (it never joins; ``finish`` frees its reservation)."""

    def at_boundary(self, j: int) -> None:
        pass

    def segment_limit(self) -> int | None:
        return None

    def make_room(self) -> int | None:
        return None

    def recompute_fits(self) -> bool:
        return False

    def take_recompute(self, budget: int) -> list[tuple[int, int]]:
        return []


class PagedKV:
    grows = True  # KV use grows one token per request per iteration

    def __init__(self, rep: "Decoding"):
        self.rep = rep
        self.held = 0.0  # KV of admitted requests outside the batch (prefilling, KV inbound)
        self.g0: dict[int, int] = {}  # tokens a re-joining request had made before pre-emption
        self.preempted: list[tuple[int, int]] = []  # (rid, tokens made) waiting to recompute
        self.preemptions = 0

    def need(self, rid: int) -> float:
        """KV to reserve when admitting ``rid``: the prompt and its first token (the rest grows one
        token per iteration)."""
        return self.rep.req.inp[rid] + 1

    def base(self) -> float:
        """The most the pool will hold before the running segment ends, so no admission makes the
        segment overflow; plus vLLM's watermark (1 % of the pool) so an admission does not pre-empt
        at once."""
        rep = self.rep
        b = rep.batch
        return self.held + (b.c0 + b.k * b.size if b.active else b.context) + 0.01 * rep.kv_capacity

    def hold(self, tokens: float) -> None:
        self.held += tokens
        self.sync()

    def sync(self) -> None:
        """Set the replica's ``kv_used`` to what the pool holds now."""
        rep = self.rep
        b = rep.batch
        ctx = b.context + b.iterations_done(rep.loop.now) * b.size if b.active else b.context
        rep._kv_add(self.held + ctx - rep.kv_used)

    def join(self, rid: int) -> int:
        g = self.g0.get(rid, 1)
        self.held -= self.rep.req.inp[rid] + g
        return g

    def finish(self, rid: int) -> None:
        self.g0.pop(rid, None)

    def after_finish(self) -> None:
        self.sync()

    def never_joins(self, rid: int) -> None:
        self.held -= self.rep.req.inp[rid] + 1  # its prompt's KV goes now

    def at_boundary(self, j: int) -> None:
        """The pool is fullest just before the finishing requests leave."""
        rep = self.rep
        b = rep.batch
        rep._kv_add(self.held + b.c0 + j * b.size - rep.kv_used)

    def segment_limit(self) -> int | None:
        return self.make_room()

    def make_room(self) -> int | None:
        """At a boundary: iterations the batch can run before the pool overflows; when not even one
        fits, pre-empt the newest request (vLLM's recompute pre-emption) until it does. A lone
        request larger than the pool runs anyway (nothing is dropped)."""
        rep = self.rep
        b, r = rep.batch, rep.req
        while True:
            free = rep.kv_capacity - self.held - b.context
            if free >= b.size:
                return int(free // b.size)
            if b.size <= 1:
                return None
            rid = max(b.members)  # the latest arrival goes first (vLLM pre-empts from the back)
            gen = b.iteration - b.members[rid] + self.g0.get(rid, 1)
            b.remove(rid, r.inp[rid] + gen)
            rep.admitted -= 1
            self.preemptions += 1
            self.preempted.append((rid, gen))
            self.sync()

    def recompute_fits(self) -> bool:
        rep = self.rep
        if not self.preempted or rep.admitted >= rep.max_batch:
            return False
        rid, gen = min(self.preempted)
        # room for the request and one more iteration of the batch it re-joins (no instant re-pre-emption)
        return rep._can_hold(self.base() + rep.batch.size + 1, rep.req.inp[rid] + gen)

    def take_recompute(self, budget: int) -> list[tuple[int, int]]:
        """Pre-empted requests to re-prefill now, oldest first, within ``budget`` tokens, as
        ``(rid, prompt + tokens made so far)``; they are admitted again (KV held)."""
        if not self.recompute_fits():
            return []
        rep = self.rep
        r, take, tokens = rep.req, [], 0
        self.preempted.sort()
        while self.recompute_fits():
            rid, gen = self.preempted[0]
            n = r.inp[rid] + gen
            if take and tokens + n > budget:
                break
            self.preempted.pop(0)
            self.g0[rid] = gen
            rep.admitted += 1
            self.hold(n)
            take.append((rid, n))
            tokens += n
        return take


def make_kv_admission(rep: "Decoding", paged: bool) -> ReserveKV | PagedKV:
    return PagedKV(rep) if paged else ReserveKV(rep)
