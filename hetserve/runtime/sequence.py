"""``Sequence``: the coordinator's state for one request as it moves through replicas.

Life cycle (``status``):

    WAITING --admitted by a prefill-capable replica--> RUNNING
    RUNNING (colocated/decode replica) --each step--> RUNNING ... --stop/length--> FINISHED
    RUNNING (prefill replica) --first token--> HANDOFF --KV acknowledged by every decode worker--> RUNNING (decode replica)
    RUNNING / HANDOFF --its replica died--> WAITING (re-run: re-prefill prompt + output so far)
    RUNNING --pre-empted (paged KV full)--> WAITING (recompute: re-prefill prompt + output so far)
    any --no live replica can serve it / engine shut down--> FAILED

``num_cached`` tokens of the sequence have their KV in the pool of ``replica`` (blocks ``table``).
While ``prefilling`` (``num_cached < prefill_end``), the next step feeds the prompt and every token
generated so far (the output is non-empty only for a request re-run after its replica died) from
``num_cached`` on: all of it, or ``chunk`` tokens with chunked prefill. After that, each step feeds
the last generated token at position ``num_cached``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from hetserve.runtime.handle import RequestHandle
from hetserve.runtime.sampling import SampleKey
from hetserve.runtime.params import SamplingParams


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    HANDOFF = "handoff"
    FINISHED = "finished"
    FAILED = "failed"


@dataclass(eq=False)
class Sequence:
    id: int
    prompt: list[int]
    params: SamplingParams
    seed: int
    stop_ids: frozenset[int]
    handle: RequestHandle
    pinned: str | None = None  # prefill replica chosen at submission, if any
    status: Status = Status.WAITING
    output: list[int] = field(default_factory=list)
    replica: str | None = None
    table: list[int] = field(default_factory=list)
    num_cached: int = 0
    prefill_end: int = 0  # tokens its prefill covers, set when a replica admits it
    chunk: int = 0  # chunked prefill: tokens the next step feeds (0: all that is left)
    # during a hand-off: destination replica, its block table, workers that acknowledged
    dst: str | None = None
    dst_table: list[int] = field(default_factory=list)
    acks: set[str] = field(default_factory=set)
    aborted: bool = False
    reruns: int = 0  # times it was re-run after its replica died
    preemptions: int = 0  # times it was pre-empted (paged KV) and recomputed
    transfer: int = 0  # id of its current KV hand-off (fresh per attempt, so stale pieces never count)
    handoff_sent: float = 0.0  # monotonic time its current hand-off was sent to the prefill workers
    _seen: list[int] | None = None  # the prompt's distinct ids, for the repetition penalty (computed once)
    # choices of one prompt (n > 1): the first one's ``children`` wait for its prefill, then share its
    # prompt's full KV blocks (``EngineLoop._fork``); ``held_by`` is the first one while they wait
    children: list["Sequence"] = field(default_factory=list)
    held_by: "Sequence | None" = None

    @property
    def reserve_tokens(self) -> int:
        """KV a decoding replica reserves: every token this request can ever hold."""
        return len(self.prompt) + self.params.max_tokens

    @property
    def prefill_tokens(self) -> int:
        """Tokens its (re-)prefill feeds: the prompt plus whatever was generated before a re-run."""
        return len(self.prompt) + len(self.output)

    @property
    def prefilling(self) -> bool:
        """Admitted, and part of its prompt still has no KV (before its first step, or between chunks)."""
        return self.num_cached < self.prefill_end

    def next_input(self) -> tuple[int, list[int]]:
        """(start position, tokens) the next step feeds."""
        if self.prefilling:
            rest = (self.prompt + self.output)[self.num_cached:self.prefill_end]
            return self.num_cached, rest[:self.chunk] if self.chunk else rest
        return self.num_cached, [self.output[-1]]

    def sample_key(self) -> SampleKey:
        p = self.params
        return (p.temperature, p.top_p, self.seed, len(self.output), p.presence_penalty, p.frequency_penalty,
                p.repetition_penalty, -1 if p.logprobs is None else p.logprobs)

    def step_extra(self, start: int, q_len: int) -> dict | None:
        """What the last stage needs beyond the sample key (plain data; None: nothing):
        ``history`` (prompt ids seen, output so far) for penalties; ``targets``, the next token of each
        fed position that is a prompt position with a next prompt token, for prompt logprobs."""
        p, extra = self.params, {}
        if p.penalized:
            if self._seen is None:
                self._seen = sorted(set(self.prompt))
            extra["history"] = (self._seen, list(self.output))
        if p.prompt_logprobs is not None and start < len(self.prompt) - 1:
            extra["targets"] = self.prompt[start + 1:min(start + q_len, len(self.prompt) - 1) + 1]
            extra["k"] = p.prompt_logprobs
        return extra or None

    def finish_reason(self) -> str | None:
        """"stop" / "length" once the last token ends the request, else None."""
        if self.output and self.output[-1] in self.stop_ids and len(self.output) >= self.params.min_tokens:
            return "stop"
        if len(self.output) >= self.params.max_tokens:
            return "length"
        return None


class StepLogprobs:
    """A step result's logprobs, per row ``b`` of the step: ``sampled[b]`` = (logprob of the sampled
    token, [(id, logprob)] of its alternatives), ``prompt[b]`` = (first position, one such pair per
    prompt position fed). Rows of requests that did not ask have no entry."""

    def __init__(self, seqs: list[Sequence], q_lens: list[int], tensors: dict):
        self.sampled: dict[int, tuple] = {}
        self.prompt: dict[int, tuple] = {}
        if "lp" in tensors:
            lp, ids, lps = tensors["lp"].tolist(), tensors["top_ids"].tolist(), tensors["top_lps"].tolist()
            for b, seq in enumerate(seqs):
                k = seq.params.logprobs
                if k is not None:
                    self.sampled[b] = (lp[b], list(zip(ids[b][:k], lps[b][:k])))
        if "p_lp" in tensors:
            lp, ids, lps = tensors["p_lp"].tolist(), tensors["p_top_ids"].tolist(), tensors["p_top_lps"].tolist()
            row = 0
            for b, (seq, q) in enumerate(zip(seqs, q_lens)):
                k, start, n = seq.params.prompt_logprobs, seq.num_cached, 0
                if k is not None and start < len(seq.prompt) - 1:
                    n = min(start + q, len(seq.prompt) - 1) - start  # as ``Sequence.step_extra`` asked
                if n:
                    self.prompt[b] = (start, [(lp[i], list(zip(ids[i][:k], lps[i][:k]))) for i in range(row, row + n)])
                row += n
