"""A workload's mean request as a replica serves it, for the capacities (``CostModel.*_capacity``).

Beside its prompt and output lengths, a request may decode ``choices`` sequences (OpenAI ``n``) and
score its prompt (``prompt_logprobs``; ``scoring`` is the share of requests that do). The engine
serves them as the simulator does (``sim/choices.py``): the prompt is prefilled once and, unless it
is scored, the choices share its full KV blocks on the replica that prefills it; each other choice
prefills only the rest (under a block) and decodes its own row. A scored prompt is prefilled whole
by every choice, and its positions' logprobs priced (``PrefillBatch.scored``). A decode replica takes
each choice's KV in a hand-off of its own: nothing is shared there.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetserve.cost.prefill_batch import PrefillBatch

# The part of a prompt each other choice prefills itself when the choices share the prompt's full
# blocks: on average half a block of the engine's default 16 tokens (the block of the last token).
UNSHARED_PROMPT_TOKENS = 8.0


@dataclass(frozen=True)
class RequestMix:
    input_tokens: float
    output_tokens: float  # per choice
    choices: float = 1.0
    scoring: float = 0.0  # share of the requests scoring their prompt

    def _rest(self) -> float:
        """Prompt tokens each other choice of an unscored request prefills itself."""
        return min(self.input_tokens, UNSHARED_PROMPT_TOKENS)

    def kv_tokens(self, shares: bool) -> float:
        """KV one request holds at its end, all choices; ``shares``: on the replica that prefilled it."""
        full = self.choices * (self.input_tokens + self.output_tokens)
        if not shares:
            return full
        return full - (self.choices - 1) * (1 - self.scoring) * (self.input_tokens - self._rest())

    def prompts(self, requests: float) -> PrefillBatch:
        """The prefill of ``requests`` such requests (fractional: a mean), all their choices."""
        s, c, n = self.input_tokens, self.choices, requests
        rest, shared = self._rest(), self.input_tokens - self._rest()
        fed = s + (c - 1) * (self.scoring * s + (1 - self.scoring) * rest)
        sum_sq = s * s + (c - 1) * (self.scoring * s * s + (1 - self.scoring) * (rest * rest + 2 * rest * shared))
        scored = self.scoring * c * max(0.0, s - 1)
        return PrefillBatch(max(1, round(n * c)), n * fed, n * sum_sq, round(n * scored))
