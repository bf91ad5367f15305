"""A backend's stream relayed to one client by ``hetserve route``, released once however its answer
ends: iterated to its end or broken off (the relay generator's own clean-up), or never iterated at
all. Starlette reads a response's body only after sending its headers, so a client gone before then
never started the generator, whose ``finally`` then never ran: the backend response stayed open and
the backend counted one request busier for good, which least-loaded routing reads."""

from __future__ import annotations

from typing import AsyncGenerator, AsyncIterator, Awaitable, Callable

from fastapi.responses import StreamingResponse


class Relay:
    """The relay generator and its release (what its ``finally`` runs), run by ``aclose`` if it never started."""

    def __init__(self, relay: AsyncGenerator[bytes, None], release: Callable[[], Awaitable[None]]):
        self._relay, self._release, self._started = relay, release, False

    def __aiter__(self) -> AsyncIterator[bytes]:
        self._started = True
        return self._relay

    async def aclose(self) -> None:
        if self._started:
            await self._relay.aclose()  # its own clean-up releases
        else:
            self._started = True  # released once
            await self._release()


class RelayedResponse(StreamingResponse):
    """A relayed stream's response, its relay released however the response ends (``Relay``):
    a client gone before the headers went out ends the response before its body is read at all."""

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
