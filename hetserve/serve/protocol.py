"""The OpenAI wire format: request bodies the server accepts and the objects it returns.

Only what hetserve serves is modelled; fields OpenAI documents but hetserve cannot honour
(``best_of`` other than ``n``, ``tools``, a ``tool_choice`` asking for a tool call, ``logit_bias``,
``suffix``) are rejected with a 400 naming
the field rather than silently ignored. Unknown fields are rejected too, as OpenAI does.

Honoured: ``n`` choices per prompt and a list of prompts (completions), ``logprobs`` / ``top_logprobs``,
``echo`` (with ``max_tokens: 0``: score the prompt, generate nothing), ``presence_penalty`` /
``frequency_penalty`` and vLLM's ``repetition_penalty``. vLLM's extensions that benchmark clients send
(``ignore_eos``, ``min_tokens``) are honoured. Real
OpenAI fields that change nothing about generation here (``store``, ``metadata``,
``parallel_tool_calls``, ``service_tier``, ``prompt_cache_key``, ``safety_identifier``,
``skip_special_tokens``) are accepted; when set, the server logs one warning naming them
(``ignored_fields``), as vLLM does. vLLM's ``top_k`` / ``min_p`` pass only at their neutral values.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator, model_serializer, model_validator

MAX_STOP_SEQUENCES = 4
MAX_CHOICES = 64  # choices one request may ask for (prompts x n): each is a request to the engine
MAX_LOGPROBS = 20  # alternatives per token at most (vLLM's default max_logprobs)


class _Strict(BaseModel):
    # unknown fields refused; no lax coercion of a request's values: ``true`` is no token count or
    # token id and ``"5"`` no number (a client sending them has a bug a 400 shows it)
    model_config = ConfigDict(extra="forbid", strict=True)


def _finite(**limits):
    """A float field that must be a finite number within ``limits`` (NaN is refused as not finite,
    not as out of range)."""
    return Field(allow_inf_nan=False, **limits)


class StreamOptions(_Strict):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # with include_usage: usage in every chunk (as vLLM)
    # OpenAI's: random padding in stream chunks against length side channels. Accepted either way, as
    # clients that send false to save bytes are right about these streams: no padding is ever added
    include_obfuscation: StrictBool | None = None


class _SamplingFields(_Strict):
    model: str = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=0)  # 0 only with echo (completions): score the prompt
    temperature: float = _finite(default=1.0, ge=0.0, le=2.0)
    # OpenAI takes 0 too: the nucleus of no mass is the most likely token alone, i.e. greedy
    # (``sampling_knobs``); the engine's sampler, as vLLM's, takes only (0, 1]
    top_p: float = _finite(default=1.0, ge=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stream: StrictBool = False  # JSON true / false only: "yes" or 1 is a client bug, not a choice
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2 ** 63), le=2 ** 63 - 1)  # what a 64-bit generator takes
    user: str | None = None
    presence_penalty: float = _finite(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = _finite(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    # vLLM extensions honoured here
    ignore_eos: StrictBool = False
    min_tokens: int = Field(default=0, ge=0)
    # vLLM sampling extensions: top_k and min_p pass only at their neutral values
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float = _finite(default=1.0, gt=0.0, le=100.0)  # vLLM's (sampling.py)
    # real OpenAI / vLLM fields that change nothing here: accepted, logged when set (ignored_fields)
    store: StrictBool | None = None
    metadata: dict[str, str] | None = None
    parallel_tool_calls: StrictBool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    skip_special_tokens: StrictBool | None = None

    _IGNORED = ("store", "metadata", "parallel_tool_calls", "service_tier", "prompt_cache_key",
                "safety_identifier", "skip_special_tokens")

    def ignored_fields(self) -> list[str]:
        """The accepted-but-ignored fields this request set (the server logs them)."""
        return [f for f in self._IGNORED if getattr(self, f) is not None]

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str]:
        stops = [] if v is None else [v] if isinstance(v, str) else list(v)
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed")
        if any(s == "" for s in stops):
            raise ValueError("stop sequences must not be empty")
        return stops

    @model_validator(mode="after")
    def _supported(self) -> "_SamplingFields":
        if self.logit_bias:
            raise ValueError("logit_bias: not supported")
        if self.top_k not in (None, 0, -1):
            raise ValueError("top_k: not supported (only -1 or 0, no top-k cut, is accepted)")
        if self.min_p not in (None, 0.0):
            raise ValueError("min_p: not supported (only 0 is accepted)")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens: must be at most max_tokens ({self.max_tokens})")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        return self

    @property
    def sampled_logprobs(self) -> int | None:
        """Alternatives asked per sampled token (None: no logprobs)."""
        if isinstance(self.logprobs, bool):  # chat: logprobs true, top_logprobs alternatives
            return (self.top_logprobs or 0) if self.logprobs else None
        return self.logprobs

    @property
    def sampling_knobs(self) -> tuple[float, float]:
        """(temperature, top_p) for the engine: ``top_p`` 0 keeps only the most likely token, which is
        greedy decoding (temperature 0, no nucleus cut)."""
        return (0.0, 1.0) if self.top_p == 0 else (self.temperature, self.top_p)

    @property
    def stop_strings(self) -> list[str]:
        return list(self.stop or [])  # normalised to a list by the validator

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage in every chunk: ``include_usage`` and ``continuous_usage_stats`` both set (vLLM's rule)."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``. ``max_tokens`` defaults to 16, as in OpenAI's API."""

    prompt: str | list[int] | list[str] | list[list[int]]
    echo: StrictBool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _prompts(self) -> "CompletionRequest":
        p = self.prompt
        if isinstance(p, (list, str)) and len(p) == 0:
            raise ValueError("prompt: must not be empty")
        if any(len(q) == 0 for q in self.prompts):
            raise ValueError("prompt: a prompt in the list is empty")
        if len(self.prompts) * self.n > MAX_CHOICES:
            raise ValueError(f"prompt: {len(self.prompts)} prompts x n={self.n} choices is over {MAX_CHOICES}")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: 0 is only allowed with echo (the prompt scored, nothing generated)")
        if self.best_of not in (None, self.n):
            raise ValueError("best_of: only best_of equal to n is supported (every choice is returned)")
        if self.suffix:
            raise ValueError("suffix: not supported")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts, one or a list (each a text or token ids)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            return list(p)  # type: ignore[arg-type]
        return [p]  # type: ignore[list-item]


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)  # clients attach name, tool_call ids, ...
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = Field(default=None, validate_default=True)

    @field_validator("content")
    @classmethod
    def _content_where_needed(cls, content, info):
        # only an assistant's message (one that called tools) or a tool's may come without content
        if content is None and info.data.get("role") in ("system", "developer", "user"):
            raise ValueError(f"a {info.data['role']} message needs content")
        return content

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``. ``max_tokens`` (or ``max_completion_tokens``) defaults to the
    room left in the context."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: StrictBool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[Any] | None = None
    tool_choice: Any | None = None
    response_format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _chat_supported(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: only allowed when logprobs is true")
        if self.max_tokens == 0:
            raise ValueError("max_tokens: must be at least 1 in a chat completion")
        if self.tools:
            raise ValueError("tools: not supported")
        # with no tools, "none" and "auto" both mean a plain answer, which is what runs; "required" or a
        # named function asks for a tool call no answer here can be, so it is refused, not ignored
        if self.tool_choice not in (None, "none", "auto"):
            raise ValueError(f"tool_choice: only 'none' or 'auto' is supported (no tools are; got "
                             f"{self.tool_choice!r})")
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            raise ValueError("response_format: only type 'text' is supported")
        return self

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# ----------------------------------------------------------------------------- responses


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @staticmethod
    def of(prompt_tokens: int, completion_tokens: int) -> "Usage":
        return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)


FinishReason = Literal["stop", "length"]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: dict[str, Any] | None = None  # {tokens, token_logprobs, top_logprobs, text_offset}
    finish_reason: FinishReason | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: dict[str, Any] | None = None  # {content: [{token, logprob, bytes, top_logprobs}]}
    finish_reason: FinishReason | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler):
        # as OpenAI's stream: a delta carries only what it has (the role in the first, no "role": null after)
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "hetserve"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())
