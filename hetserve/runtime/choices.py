"""``Choices``: the choices of one prompt (n > 1) share its KV blocks in the engine.

The first choice prefills the prompt; the others, submitted after it (``share_prefix_with``),
wait for that (``held_by``), then take the prompt's full blocks as theirs too (reference-counted,
``kv_cache.py``) and each prefills only the rest of the prompt into blocks of its own. Where
sharing does not apply they queue as plain requests.

A mixin over the ``EngineLoop``'s state (its sequences, schedulers and queues), like ``Recovery``.
"""

from __future__ import annotations

from hetserve.runtime.scheduler import ReplicaScheduler
from hetserve.runtime.sequence import Sequence, Status


class Choices:
    """A request's choices sharing its prompt's blocks, for ``EngineLoop`` (see the module docstring)."""

    def _hold_for_first(self, seq: Sequence, parent: int | None) -> bool:
        """Hold ``seq`` until ``parent``, the first choice of the same prompt, has prefilled it, while
        that one waits or runs, was not aborted and has produced no token; False: ``seq`` queues as
        it is."""
        first = self.seqs.get(parent)
        if (first is not None and not first.output and not first.aborted and first.prompt == seq.prompt
                and first.status in (Status.WAITING, Status.RUNNING)):
            seq.held_by = first  # waits for the first choice's prefill, then shares its blocks
            first.children.append(seq)
            return True
        return False

    def _fork(self, first: Sequence, sched: ReplicaScheduler) -> None:
        """``first`` has just prefilled its prompt here: its waiting choices take the prompt's full
        blocks as theirs too and join this replica's queue, each to prefill only the rest of the
        prompt (under a block) into blocks of its own. Where sharing does not apply (paged KV, whose
        pre-emption counts a sequence's blocks as its own; a re-prefill; prompt logprobs, which need
        every position) they queue as plain requests."""
        children, first.children = first.children, []
        shared = first.table[:(len(first.prompt) - 1) // sched.blocks.block_size]
        can_share = bool(shared) and not sched.paged and first.prefill_end == len(first.prompt)
        for child in reversed(children):  # to the head of the queues, in arrival order
            child.held_by = None
            if can_share and child.params.prompt_logprobs is None:
                child.table = sched.blocks.share(shared)
                child.replica = child.pinned = sched.id
                sched.pinned.appendleft(child)
            else:
                self._queue_alone(child)

    def _unhold(self, first: Sequence) -> None:
        """``first`` ended before its prefill: its waiting choices queue as plain requests."""
        for child in reversed(first.children):
            child.held_by = None
            self._queue_alone(child)
        first.children = []

    def _queue_alone(self, seq: Sequence) -> None:
        """To the head of the queue of the replica it was placed on (if alive), else the shared one."""
        home = self.schedulers.get(seq.pinned) if seq.pinned else None
        if home is None or not home.alive:
            seq.pinned, home = None, None
        (home.pinned if home else self.waiting).appendleft(seq)
