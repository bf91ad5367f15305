"""Continuous batching: which requests run in a replica's next step. One copy, two clocks.

The simulator's replicas (``hetserve.sim.replicas``, ``sim.pipeline``) and the runtime's
``ReplicaScheduler`` compose every step with ``compose_step`` and admit KV with ``kv_reservation``
("reserve") or the paged rule of ``policies.kv_admission`` ("paged", with pre-emption), from the
defaults in ``BatchingConfig`` (the only place they are written). Pure Python: no torch, no sockets.

A step (one forward pass of a replica) carries:

* every running decode sequence (one token each) — on a pipeline, an even share per micro-batch;
* on a prefill-capable replica, waiting prompts from the head of the FCFS queue while
  - the step stays within ``token_budget`` tokens (decode tokens + prompt tokens; the first prompt
    of a step always gets in, so a prompt longer than the budget runs, alone with the decodes),
  - the replica runs at most ``max_batch`` sequences,
  - the prompt's KV fits the pool (``kv_reservation``, or ``kv_admission.can_admit_paged``); the
    first prompt that does not fit stops admission (nobody overtakes it: FCFS).

``prefill_mode`` says how prompts meet decodes on a colocated replica:
``"mixed"`` (the runtime's engine, vLLM v1 without chunking): whole prompts ride in the decode
step; ``"prefill_first"`` (vLLM v0): a step of prompts only, decoding waits for it;
``"chunked"`` (Sarathi, vLLM's chunked prefill): every prompt that fits the KV pool and the
sequence limit is admitted, and admitted prompts feed chunks, in admission order, up to
``chunk_tokens`` per step with the decode tokens counted (``prompt_chunks``). The runtime
implements ``"mixed"`` and ``"chunked"``; ``"prefill_first"`` is a simulator what-if.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

from hetserve.policies.kv_admission import DEFAULT_WATERMARK, KV_ADMISSIONS, KVAdmission

PrefillMode = Literal["mixed", "prefill_first", "chunked"]
PREFILL_MODES = ("mixed", "prefill_first", "chunked")


@dataclass(frozen=True)
class BatchingConfig:
    """The batching knobs, with the one set of defaults the simulator and the runtime share."""

    token_budget: int = 2048  # tokens per step: decode tokens + prompt tokens
    max_batch: int = 256  # sequences per step (running requests per replica); vLLM's max_num_seqs
    prefill_mode: PrefillMode = "mixed"
    chunk_tokens: int = 512  # tokens per step with chunked prefill (decode tokens included)
    block_size: int = 16  # KV tokens per block; reservations are whole blocks
    # "reserve" (prompt + max_tokens held from admission) or "paged" (vLLM: blocks as the context
    # grows, pre-emption by recompute; policies.kv_admission)
    kv_admission: KVAdmission = "reserve"
    kv_watermark: float = DEFAULT_WATERMARK  # paged: share of the pool an admission leaves free

    def __post_init__(self) -> None:
        if min(self.token_budget, self.max_batch, self.chunk_tokens, self.block_size) < 1:
            raise ValueError("token_budget, max_batch, chunk_tokens and block_size must be positive")
        if self.kv_admission not in KV_ADMISSIONS:
            raise ValueError(f"kv_admission must be one of {', '.join(KV_ADMISSIONS)}, got {self.kv_admission!r}")
        if not 0 <= self.kv_watermark < 1:
            raise ValueError(f"kv_watermark must be in [0, 1), got {self.kv_watermark}")
        if self.prefill_mode not in PREFILL_MODES:
            raise ValueError(f"prefill_mode must be one of {', '.join(PREFILL_MODES)}, got {self.prefill_mode!r}")


DEFAULT_BATCHING = BatchingConfig()


def kv_reservation(prompt_tokens: int, max_tokens: int, decoding: bool, block_size: int) -> int:
    """KV tokens a replica reserves when it admits a request, in whole blocks.

    A decoding (decode or colocated) replica reserves every token the request can ever hold,
    prompt + ``max_tokens``, so a running request never runs out of room; a prefill replica the
    prompt only (it frees it once the KV reached the decode side). The simulator's requests carry
    their true output length as ``max_tokens`` (a replayed trace sends exactly that, ignoring EOS).
    """
    tokens = prompt_tokens + max_tokens if decoding else prompt_tokens
    return -(-tokens // block_size) * block_size


def prompt_chunks(remaining: list[int], chunk_tokens: int, decode_tokens: int) -> list[int]:
    """Chunked prefill: tokens each admitted prompt feeds this step, for prompts with ``remaining``
    tokens left to prefill, in admission order (the returned list may be shorter: the rest wait).

    The step carries ``decode_tokens`` decodes and at most ``chunk_tokens`` tokens in all, but at
    least one prompt token, so prompts always make progress beside a full decode batch.
    """
    left = max(1, chunk_tokens - decode_tokens)
    out = []
    for r in remaining:
        if left <= 0:
            break
        c = min(r, left)
        out.append(c)
        left -= c
    return out


def decode_share(running: int, micro_batches: int) -> int:
    """Decode sequences per micro-batch: the running ones spread evenly over the steps in flight."""
    return -(-running // max(1, micro_batches))


class StepBuilder:
    """Admission of waiting prompts into one step: ``offer`` each head of queue until it says no.

    ``tokens`` / ``seqs``: what the step already carries (its decode tokens and sequences; the
    simulator passes the replica's admitted requests as ``seqs``, the same number on a one-stage
    replica). ``budget``: the step's token budget (``None``: unlimited, e.g. chunked prefill).
    """

    __slots__ = ("budget", "max_seqs", "tokens", "seqs", "prompts")

    def __init__(self, budget: int | None, max_seqs: int, tokens: int = 0, seqs: int = 0):
        self.budget, self.max_seqs = budget, max_seqs
        self.tokens, self.seqs, self.prompts = tokens, seqs, 0

    def room_for(self, prompt_tokens: int) -> bool:
        """Whether a prompt of ``prompt_tokens`` fits the step's budget and sequence limit."""
        if self.seqs >= self.max_seqs:
            return False
        return self.budget is None or self.prompts == 0 or self.tokens + prompt_tokens <= self.budget

    def offer(self, prompt_tokens: int, kv_fits: bool) -> bool:
        """Admit the head of the queue if it fits the step and its KV fits the pool (then count it)."""
        if not kv_fits or not self.room_for(prompt_tokens):
            return False
        self.tokens += prompt_tokens
        self.seqs += 1
        self.prompts += 1
        return True


class Offer:
    """The head of a replica's waiting queue, as a step sees it. A plain class, not a frozen
    dataclass: one is made for every admission a simulated step weighs, and a frozen dataclass's
    generated ``__init__`` costs ~15 times a compiled one's."""

    __slots__ = ("tokens", "kv_fits", "seqs")

    def __init__(self, tokens: int, kv_fits: bool, seqs: int = 1):
        self.tokens = tokens  # prompt tokens it still has to prefill here
        self.kv_fits = kv_fits  # its KV reservation fits the pool now
        self.seqs = seqs  # sequences it adds to the replica (its choices)

    def __repr__(self) -> str:
        return f"Offer(tokens={self.tokens}, kv_fits={self.kv_fits}, seqs={self.seqs})"


class Step:
    """What one step carries: ``decodes`` one-token rows, then prompt tokens ``chunks``, one per
    prompt in admission order (those admitted before and still prefilling first); ``admitted`` of
    them came from the waiting queue in this step. Without chunking a chunk is a whole prompt.
    A plain class for the reason ``Offer`` is one: a simulation makes one per step."""

    __slots__ = ("decodes", "admitted", "chunks")

    def __init__(self, decodes: int, admitted: int, chunks: tuple[int, ...]):
        self.decodes, self.admitted, self.chunks = decodes, admitted, chunks

    @property
    def prompt_tokens(self) -> int:
        return sum(self.chunks)

    def __repr__(self) -> str:
        return f"Step(decodes={self.decodes}, admitted={self.admitted}, chunks={self.chunks})"


def compose_step(head: Callable[[], Offer | None], take: Callable[[], None], *, token_budget: int | None,
                 max_seqs: int, decodes: int, seqs: int, chunk_tokens: int | None = None,
                 prefilling: tuple[int, ...] | list[int] = (), admit: bool = True) -> Step:
    """The one rule for a replica's next step, for the runtime's scheduler and the simulator.

    ``head()`` shows the waiting queue's head (None: empty) and ``take()`` admits it (the caller
    gives it its KV). The step carries ``decodes`` decode rows on a replica already running
    ``seqs`` sequences. Heads are admitted in order while ``StepBuilder`` takes them within
    ``token_budget`` (None: no budget) and ``max_seqs`` and their KV fits; the first that does not
    stops admission (FCFS). ``admit=False``: none (a step that pre-empted). Chunked prefill
    (``chunk_tokens`` set): the prompts admitted before with ``prefilling`` tokens left, then
    the new ones, feed chunks by ``prompt_chunks``; otherwise every admitted prompt rides whole.
    """
    step = StepBuilder(token_budget, max_seqs, tokens=decodes, seqs=seqs)
    fed: list[int] = []
    while admit and (offer := head()) is not None and step.offer(offer.tokens, offer.kv_fits):
        step.seqs += offer.seqs - 1  # a request's choices are sequences of the replica
        take()
        fed.append(offer.tokens)
    if chunk_tokens is None:
        return Step(decodes, len(fed), tuple(fed))
    return Step(decodes, len(fed), tuple(prompt_chunks([*prefilling, *fed], chunk_tokens, decodes)))


def token_budget_rule(max_batched_tokens: int, max_num_seqs: int, seqs_name: str, chunked: str) -> str | None:
    """What the token budget per step must be beside ``max_num_seqs`` (None: it is). Every sequence a
    step decodes counts one token of the budget and a step decodes up to ``max_num_seqs`` of them, so a
    smaller budget is exceeded by the decodes alone (vLLM refuses it too); nor does any budget split
    a prompt: a step's first prompt rides whole (``StepBuilder``), so a budget
    meant to cap prompt tokens is refused, naming the chunked prefill that does (``chunked``). The
    runtime and the simulator both refuse what this refuses."""
    if max_batched_tokens >= max_num_seqs:
        return None
    return (f"at least {seqs_name} ({max_num_seqs}): a step decodes up to {max_num_seqs} sequences, one token of "
            f"the budget each, and rides a prompt whole whatever the budget (to feed prompts in pieces of N tokens: "
            f"{chunked} N)")
