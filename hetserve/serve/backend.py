"""What the HTTP front needs from an engine: the ``Backend`` protocol.

The coordinator (``hetserve.serve.app``) speaks only to this protocol, so its HTTP, streaming,
error and metrics logic is tested against an in-process fake, and the real engine
(``hetserve.serve.engine_backend.EngineBackend``, local processes or Ray actors) plugs in with
an adapter.

    generate(request_id, prompt_token_ids, params, replica) -> async iterator of token ids
        Tokens as the engine produces them; the iterator ends when the request finishes (it hit
        ``max_tokens`` or produced a token of ``stop_token_ids``, which is yielded too). Raises
        (or the iterator raises) on engine failure. When ``params`` asks for logprobs, each token is
        a ``SampledToken`` (an int carrying them); the first one carries the prompt's too.
        ``share_with`` (optional keyword): the id of a request of the same prompt started just before
        (another choice of it); a backend that can, shares that prompt's KV between the two.
    abort(request_id)          free the request's slot and KV; a no-op for unknown or finished ids.
                               Synchronous and non-blocking: it is called from ``finally`` blocks of
                               cancelled tasks (a client that went away), where nothing may be awaited
    replicas() -> [ReplicaState]   a snapshot for the placement policy and the metrics
    link_stats() -> [LinkStats]    bytes / queueing per device-pair link, every sending process's summed
                                   (empty where the engine has no link hook)
    refused_connections() -> {reason: n}   connections the runtime's endpoints closed unread (docs/security.md)
    max_context                    the model's context length (prompt + output tokens)
    vocab_size, block_size         optional: the vocabulary (token ids are checked against it) and the
                                   KV block (reservations are whole blocks), as the engine checks them
    close()                        stop the engine; idempotent
    replanning, broken             optional: True while replicas are being brought up (requests wait),
                                   and why the engine refuses every request (None while it serves)
"""

from __future__ import annotations

from typing import AsyncIterator, Protocol, Sequence

from hetserve.policies.base import ReplicaState

from hetserve.runtime.params import SamplingParams


class SampledToken(int):
    """A token id (an int wherever one is expected) with its logprob and the ``top`` alternatives,
    [(id, logprob)]; the first token of a request that asked for prompt logprobs also carries
    ``prompt_logprobs``: one (logprob, alternatives) per prompt token after the first."""

    logprob: float | None
    top: list
    prompt_logprobs: list | None

    def __new__(cls, token: int, logprob: float | None = None, top=(), prompt_logprobs=None):
        self = super().__new__(cls, token)
        self.logprob, self.top, self.prompt_logprobs = logprob, list(top), prompt_logprobs
        return self


class Backend(Protocol):
    max_context: int

    def generate(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                 replica: str | None = None, *, share_with: str | None = None) -> AsyncIterator[int]: ...

    def abort(self, request_id: str) -> None: ...

    def replicas(self) -> list[ReplicaState]: ...

    def link_stats(self) -> list: ...

    def refused_connections(self) -> dict[str, int]: ...

    async def close(self) -> None: ...
