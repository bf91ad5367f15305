"""The graceful shutdown's waits, shared by ``hetserve serve``'s ``Coordinator`` and ``hetserve
route``'s ``Router`` (``serve.server`` drives them on SIGTERM / Ctrl-C).

Both take ``requests``: an object with ``in_flight`` (requests being answered), ``draining`` (set:
new requests are refused) and ``end_now(reason, grace_s, poll_s)`` (end every request in flight
with ``reason``, each answered with an error: an SSE error event and ``[DONE]`` where it streams).
"""

from __future__ import annotations

import asyncio
import time


async def drain(requests, timeout_s: float, clock=time.monotonic, poll_s: float = 0.05) -> int:
    """Admit nothing new, let the requests in flight finish for up to ``timeout_s``, then end those
    left with one clear error. Returns how many had to be ended."""
    requests.draining = True
    deadline = clock() + timeout_s
    while requests.in_flight and clock() < deadline:
        await asyncio.sleep(poll_s)
    cut = requests.in_flight
    if cut:
        await requests.end_now(f"the server is shutting down: the request did not finish within the drain "
                               f"timeout ({timeout_s:g} s)", poll_s=poll_s)
    return cut


async def wait_answered(requests, grace_s: float, clock=time.monotonic, poll_s: float = 0.05) -> None:
    """Wait up to ``grace_s`` for the requests ``end_now`` ended to write their error and close."""
    end = clock() + grace_s
    while requests.in_flight and clock() < end:
        await asyncio.sleep(poll_s)
