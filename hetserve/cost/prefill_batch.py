"""A batch of prompts as the cost model prices it (count, tokens, squared lengths, scored positions)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class PrefillBatch:
    """A batch of prompts: count, total tokens, Σ length² (for causal attention), and ``scored``:
    prompt positions whose logprobs the step returns (``prompt_logprobs``), priced on the last
    stage by ``CostModel.prompt_logprob_time``. A plain class, not a frozen dataclass: a simulation
    makes one at nearly every step, and a frozen dataclass's generated ``__init__`` costs ~15 times
    a compiled one's (``make fast-sim`` compiles this module)."""

    __slots__ = ("num_seqs", "tokens", "sum_sq", "scored")

    # counts, or means over micro-batches (``sim.replicas``): either kind of number, kept as given
    def __init__(self, num_seqs: Any, tokens: Any, sum_sq: Any, scored: Any = 0):
        self.num_seqs, self.tokens, self.sum_sq, self.scored = num_seqs, tokens, sum_sq, scored

    def __repr__(self) -> str:
        return f"PrefillBatch(num_seqs={self.num_seqs}, tokens={self.tokens}, sum_sq={self.sum_sq}, scored={self.scored})"

    @staticmethod
    def of(lengths: Sequence[int], scored: int = 0) -> "PrefillBatch":
        return PrefillBatch(len(lengths), int(sum(lengths)), float(sum(s * s for s in lengths)), scored)

    @staticmethod
    def single(length: int, scored: bool = False) -> "PrefillBatch":
        return PrefillBatch(1, int(length), float(length) * length, int(length) - 1 if scored else 0)
