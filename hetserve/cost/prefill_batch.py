"""A batch of prompts as the cost model prices it (count, tokens, squared lengths, scored positions)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PrefillBatch:
    """A batch of prompts: count, total tokens, Σ length² (for causal attention), and ``scored``:
    prompt positions whose logprobs the step returns (``prompt_logprobs``), priced on the last
    stage by ``CostModel.prompt_logprob_time``."""

    num_seqs: int
    tokens: int
    sum_sq: float
    scored: int = 0

    @staticmethod
    def of(lengths: Sequence[int], scored: int = 0) -> "PrefillBatch":
        return PrefillBatch(len(lengths), int(sum(lengths)), float(sum(s * s for s in lengths)), scored)

    @staticmethod
    def single(length: int, scored: bool = False) -> "PrefillBatch":
        return PrefillBatch(1, int(length), float(length) * length, int(length) - 1 if scored else 0)
