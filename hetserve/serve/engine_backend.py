"""``EngineBackend``: the runtime ``Engine`` (local processes or Ray actors) behind the ``Backend`` protocol.

Passes the server's ``SamplingParams`` to the engine, streams the engine's
``RequestHandle`` asynchronously, hands the engine's per-replica snapshots
(``hetserve.runtime.snapshot``) to the placement policies as ``ReplicaState``, and reads link counters from the
engine (``Engine.link_stats``: every worker's, as reported over the transport, and this process's).

Engine errors are mapped once, here: a ``ValueError`` from ``submit`` (prompt outside the
vocabulary or the context) and an ``InfeasibleError`` (KV can never fit) become ``InvalidRequest``;
a ``RuntimeFailure`` at submission (no replica can serve) becomes ``Unavailable`` (503), one
mid-stream ``ServerError``, or ``ShuttingDown`` (503) where a shutdown ended it (``fail_all``).
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Sequence

from hetserve.errors import RuntimeFailure
from hetserve.policies.base import ReplicaState
from hetserve.runtime.params import SamplingParams
from hetserve.runtime.snapshot import state_from_stats
from hetserve.serve.backend import SampledToken
from hetserve.policies.request_checks import RequestRefused
from hetserve.serve.errors import InvalidRequest, ServerError, ShuttingDown, Unavailable, refusal


class EngineBackend:
    def __init__(self, engine, links=None):
        self.engine = engine
        self.links = links  # the LinkSchedulerFactory the engine was started with (closed with it), or None
        self.max_context = int(engine.arch.max_positions)
        self.vocab_size = int(engine.arch.vocab_size)
        self.block_size = int(engine.config.block_size)
        self._handles: dict[str, object] = {}
        self._closed = False
        self._ended: str | None = None  # why fail_all ended the requests in flight (a shutdown)

    async def generate(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                       replica: str | None = None, *, share_with: str | None = None) -> AsyncIterator[int]:
        try:
            first = self._handles.get(share_with) if share_with is not None else None
            handle = self.engine.submit(list(prompt_token_ids), params, replica=replica, share_prefix_with=first)
        except RequestRefused as exc:  # the rules the coordinator checked first, as the engine found them now
            raise refusal(exc) from exc
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from exc
        except RuntimeFailure as exc:
            raise Unavailable(str(exc)) from exc
        self._handles[request_id] = handle
        detailed = params.logprobs is not None or params.prompt_logprobs is not None
        try:
            try:
                i = 0
                async for token in handle:
                    if detailed:  # a token's logprobs are stored before the token (RequestHandle._push)
                        lp = handle.logprobs[i] or (None, [])
                        token = SampledToken(token, lp[0], lp[1], handle.prompt_logprobs if i == 0 and
                                             params.prompt_logprobs is not None else None)
                    i += 1
                    yield token
            except RuntimeFailure as exc:
                # ended by a shutdown (``fail_all``): the server's refusal, as a request arriving now gets
                raise (ShuttingDown if self._ended is not None else ServerError)(str(exc)) from exc
        finally:
            self._handles.pop(request_id, None)
            if not handle.finished:
                handle.abort()  # cancelled mid-stream (the client went away): free the slot now

    @property
    def replanning(self) -> bool:
        """True while a re-plan brings replicas up, or none is left and requests are held for one:
        requests wait for them rather than being refused."""
        return bool(getattr(self.engine, "_reconfiguring", False) or getattr(self.engine, "holding", False))

    @property
    def broken(self) -> str | None:
        """Why the engine refuses every request now (a re-plan that failed with no replica left), or None."""
        return self.engine.broken

    def abort(self, request_id: str) -> None:
        handle = self._handles.get(request_id)
        if handle is not None:
            handle.abort()

    def replicas(self) -> list[ReplicaState]:
        """The engine's own per-replica snapshot (``hetserve.runtime.snapshot``): per-replica queues,
        tokens outstanding, context tokens and KV use, the fields the simulator fills."""
        stats = self.engine.stats()
        return [state_from_stats(rid, s) for rid, s in stats.get("replicas", {}).items()]

    def fail_all(self, reason: str) -> None:
        """End every request in flight with ``reason`` (graceful shutdown past its drain timeout)."""
        self._ended = reason
        self.engine.fail_all(reason)

    def link_stats(self) -> list:
        return self.engine.link_stats()

    def refused_connections(self) -> dict[str, int]:
        return self.engine.refused_connections()

    def channel_stats(self) -> dict[str, dict[str, int]]:
        return self.engine.channel_stats()

    def worker_deaths(self) -> int:
        """Workers that died or were declared frozen since the engine started."""
        return len(self.engine.stats().get("deaths", []))

    def worker_load_seconds(self) -> dict[str, float]:
        """Seconds each worker took to make its stage (read or draw its weights), as it measured."""
        return {w: float(load["seconds"]) for w, load in self.engine.worker_loads().items()}

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await asyncio.to_thread(self.engine.shutdown)
        if self.links is not None:
            self.links.close()
