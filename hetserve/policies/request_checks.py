"""Whether a request can be served at all: the checks made when a request is submitted.

The engine makes them when a request is submitted, and the simulator when a request arrives, so a
simulated trace refuses exactly the requests a served deployment refuses (and counts them as
refused instead of completing them). Each check raises a ``RequestRefused`` whose ``reason`` names
the rule (``"empty"``, ``"vocabulary"``, ``"context"``, ``"kv"``); the first three are also
``ValueError`` and the KV one an ``InfeasibleError``, the types a server maps to HTTP 400.

Pure: no torch, no sockets; O(prompt length) for the token ids, O(replicas) for the KV pools.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from hetserve.errors import InfeasibleError
from hetserve.planner.plan import serves_decode, serves_prefill
from hetserve.policies.batching import kv_reservation


class RequestRefused(Exception):
    """A request no replica of the deployment can serve; ``reason`` names the rule it breaks."""

    reason = "refused"


class EmptyPrompt(RequestRefused, ValueError):
    reason = "empty"


class OutOfVocabulary(RequestRefused, ValueError):
    reason = "vocabulary"


class ContextExceeded(RequestRefused, ValueError):
    reason = "context"

    def __init__(self, prompt_tokens: int, max_tokens: int, max_context: int):
        self.prompt_tokens, self.max_tokens, self.max_context = prompt_tokens, max_tokens, max_context
        super().__init__(f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds the model's "
                         f"context of {max_context} tokens")

    def __reduce__(self):  # rebuilt from its fields wherever it is unpickled
        return type(self), (self.prompt_tokens, self.max_tokens, self.max_context)


class KVNeverFits(RequestRefused, InfeasibleError):
    """``prompt_alone``: the prompt does not fit even with one output token (a shorter completion
    would not help). ``side``: the replicas short of room, ``"decode"`` (those that decode, which
    hold prompt + output) or ``"prefill"`` (those that take prompts); ``largest_pool`` is the
    largest of theirs, so the figure is the one the request exceeds."""
    reason = "kv"

    def __init__(self, prompt_tokens: int, max_tokens: int, largest_pool: float, prompt_alone: bool = False,
                 side: str = "decode"):
        self.prompt_tokens, self.max_tokens, self.largest_pool = prompt_tokens, max_tokens, largest_pool
        self.prompt_alone, self.side = prompt_alone, side
        super().__init__(f"a request needing {prompt_tokens + max_tokens} tokens of KV cache (prompt "
                         f"{prompt_tokens} + max_tokens {max_tokens}) cannot fit the KV pool of any replica "
                         f"{SIDE_WORDS[side]} (largest: {largest_pool:.0f} tokens)")

    def __reduce__(self):
        return type(self), (self.prompt_tokens, self.max_tokens, self.largest_pool, self.prompt_alone, self.side)


SIDE_WORDS = {"decode": "that decodes", "prefill": "that takes prompts"}


REASONS: tuple[str, ...] = ("empty", "vocabulary", "context", "kv")


def check_prompt_ids(ids: Sequence[int], vocab_size: int | None) -> None:
    """The prompt has at least one token and every id is in the vocabulary ``[0, vocab_size)``
    (``None``: a vocabulary not known here, left to the model)."""
    if not ids:
        raise EmptyPrompt("the prompt is empty")
    if vocab_size is None:
        return
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise OutOfVocabulary(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")


def check_context(prompt_tokens: int, max_tokens: int, max_context: int) -> None:
    """Prompt + ``max_tokens`` fit the model's context (positions beyond it have no embedding)."""
    if prompt_tokens <= 0:
        raise EmptyPrompt("the prompt is empty")
    if prompt_tokens + max_tokens > max_context:
        raise ContextExceeded(prompt_tokens, max_tokens, max_context)


def check_kv_fits(prompt_tokens: int, max_tokens: int, pools: Iterable[tuple[str, float]], block_size: int) -> None:
    """Some replica could ever hold the request's KV, on each side it needs.

    ``pools``: ``(role, KV capacity in tokens)`` of every live replica. A prompt needs a prefill
    or colocated replica whose empty pool holds its reservation (the prompt on a prefill replica,
    prompt + ``max_tokens`` on a colocated one), and a decode or colocated replica whose empty pool
    holds prompt + ``max_tokens``; reservations are whole blocks of ``block_size`` tokens
    (``kv_reservation``), as the replicas admit them. A request that fails here would wait forever:
    no finishing request ever frees enough room.
    """
    pools = list(pools)

    def short_side(out: int) -> str | None:
        """The side where no replica holds the request with ``out`` output tokens (None: both do)."""
        if not any(can_hold(cap, prompt_tokens, out, True, block_size) for role, cap in pools if serves_decode(role)):
            return "decode"
        if not any(can_hold(cap, prompt_tokens, out, serves_decode(role), block_size)
                   for role, cap in pools if serves_prefill(role)):
            return "prefill"
        return None

    side = short_side(max_tokens)
    if side is not None:
        serves = serves_decode if side == "decode" else serves_prefill
        largest = max((cap for role, cap in pools if serves(role)), default=0)
        raise KVNeverFits(prompt_tokens, max_tokens, largest, prompt_alone=short_side(1) is not None, side=side)


def can_hold(capacity: float, prompt_tokens: int, max_tokens: int, decoding: bool, block_size: int) -> bool:
    """Whether a replica whose empty KV pool is ``capacity`` tokens can ever hold the request's
    reservation (``kv_reservation``: prompt + ``max_tokens`` where it decodes, the prompt alone on
    a prefill replica)."""
    return kv_reservation(prompt_tokens, max_tokens, decoding, block_size) <= capacity


def able_to_hold(candidates: Sequence, prompt_tokens: int, max_tokens: int, block_size: int,
                 decoding: bool | None = None) -> list:
    """The candidates (``ReplicaState``) that can ever hold the request (``can_hold``; ``decoding``
    None: as each candidate's role decides, True: the decode side of a hand-off). Placement and
    KV routes choose among these only: a request placed where it never fits waits forever, while
    another replica could serve it. A candidate whose pool is not known (0) is kept; where none can
    hold it, all are returned (the arrival checks, ``check_kv_fits``, refuse such a request first)."""
    keep = [c for c in candidates
            if c.kv_capacity_tokens <= 0 or can_hold(c.kv_capacity_tokens, prompt_tokens, max_tokens,
                                                      serves_decode(c.role) if decoding is None else decoding,
                                                      block_size)]
    return keep or list(candidates)


def check_request(prompt_tokens: int, max_tokens: int, max_context: int, pools: Iterable[tuple[str, float]],
                  block_size: int, *, context: bool = True, kv: bool = True) -> None:
    """Every check on a request known by its lengths, in the engine's order: an empty prompt, the
    model's context (skipped with ``context=False``), then the KV pools (``check_kv_fits``; skipped
    with ``kv=False``, where the pools are not known)."""
    if prompt_tokens <= 0:
        raise EmptyPrompt("the prompt is empty")
    if context:
        check_context(prompt_tokens, max_tokens, max_context)
    if kv:
        check_kv_fits(prompt_tokens, max_tokens, pools, block_size)
