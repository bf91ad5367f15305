"""Sampling parameters of one request: plain data, no torch, so the HTTP server and the
policies can build them without importing the model code (the sampler is ``sampling.py``)."""

from __future__ import annotations

from dataclasses import dataclass

MAX_LOGPROBS = 20  # alternatives per token at most (vLLM's default max_logprobs)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None  # None: the engine draws one per request
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # when False, the checkpoint's eos ids also stop generation
    min_tokens: int = 0  # no stop token ends the request before this many tokens (vLLM's min_tokens)
    presence_penalty: float = 0.0  # OpenAI's, in [-2, 2] (sampling.py has the definitions)
    frequency_penalty: float = 0.0  # OpenAI's, in [-2, 2]
    repetition_penalty: float = 1.0  # vLLM's, > 0 (1: none)
    logprobs: int | None = None  # each sampled token's logprob and this many alternatives (None: none)
    prompt_logprobs: int | None = None  # each prompt token's logprob (the first has none) and alternatives

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -2 <= v <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {v}")
        if not 0 < self.repetition_penalty <= 100:
            raise ValueError(f"repetition_penalty must be in (0, 100], got {self.repetition_penalty}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not 0 <= v <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {v}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def penalized(self) -> bool:
        """Whether sampling needs the sequence's token history."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0
