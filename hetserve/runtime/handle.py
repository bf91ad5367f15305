"""``RequestHandle``: what ``Engine.submit`` returns; yields tokens as they are produced.

Thread-safe: the engine's coordinator thread pushes tokens, any thread iterates (``for t in h``),
any asyncio task streams (``async for t in h``). A failed request raises its ``RuntimeFailure``
from the iterator after the tokens produced before the failure.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterator


class RequestHandle:
    def __init__(self, request_id: int, prompt_len: int):
        self.request_id = request_id
        self.prompt_len = prompt_len
        self.tokens: list[int] = []
        # when the request asked for them: per token, (logprob, [(id, logprob)] alternatives) or None
        self.logprobs: list[tuple | None] = []
        # per prompt position after the first (asked with prompt_logprobs): the same pairs
        self.prompt_logprobs: list[tuple] = []
        self.finish_reason: str | None = None  # "stop" | "length" | "abort"
        self.error: BaseException | None = None
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        # disaggregated: seconds from sending its KV hand-off to the last decode worker's acknowledgement
        self.handoff_s: float | None = None
        self._done = False
        self._cv = threading.Condition()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self._abort = None  # set by the engine: callable aborting this request

    # ------------------------------------------------------------------ consumer side
    @property
    def finished(self) -> bool:
        return self._done

    def __iter__(self) -> Iterator[int]:
        i = 0
        while True:
            with self._cv:
                self._cv.wait_for(lambda: len(self.tokens) > i or self._done)
                new, done = self.tokens[i:], self._done
            yield from new
            i += len(new)
            if done and i == len(self.tokens):
                if self.error is not None:
                    raise self.error
                return

    def __aiter__(self) -> AsyncIterator[int]:
        return self._astream()

    async def _astream(self) -> AsyncIterator[int]:
        loop, event = asyncio.get_running_loop(), asyncio.Event()
        with self._cv:
            self._waiters.append((loop, event))
        i = 0
        try:
            while True:
                event.clear()
                with self._cv:
                    new, done = self.tokens[i:], self._done
                for t in new:
                    yield t
                i += len(new)
                if done and i == len(self.tokens):
                    if self.error is not None:
                        raise self.error
                    return
                await event.wait()
        finally:
            with self._cv:
                self._waiters.remove((loop, event))

    def result(self, timeout: float | None = None) -> list[int]:
        """All generated tokens, once finished. Raises the request's error, or TimeoutError."""
        with self._cv:
            if not self._cv.wait_for(lambda: self._done, timeout):
                raise TimeoutError(f"request {self.request_id} not finished after {timeout} s")
        if self.error is not None:
            raise self.error
        return list(self.tokens)

    async def aresult(self) -> list[int]:
        return [t async for t in self]

    def abort(self) -> None:
        """Stop generating (e.g. the client went away); the handle finishes with reason "abort"."""
        if self._abort is not None and not self._done:
            self._abort(self.request_id)

    @property
    def ttft(self) -> float | None:
        """Seconds from submission to the first token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean seconds per output token after the first."""
        if self.finish_time is None or self.first_token_time is None or len(self.tokens) < 2:
            return None
        return (self.finish_time - self.first_token_time) / (len(self.tokens) - 1)

    # ------------------------------------------------------------------ producer side (engine thread)
    def _push(self, token: int, logprobs: tuple | None = None) -> None:
        with self._cv:
            if self.first_token_time is None:
                self.first_token_time = time.monotonic()
            self.logprobs.append(logprobs)
            self.tokens.append(token)
            self._notify()

    def _prompt_logprobs(self, start: int, entries: list[tuple]) -> None:
        """Positions ``start ..`` of the prompt's logprobs (a re-run's prefill writes the same ones again)."""
        with self._cv:
            self.prompt_logprobs[start:start + len(entries)] = entries

    def _finish(self, reason: str, error: BaseException | None = None) -> None:
        with self._cv:
            if self._done:
                return
            self.finish_reason, self.error = reason, error
            self.finish_time = time.monotonic()
            self._done = True
            self._notify()

    def _notify(self) -> None:  # caller holds self._cv
        self._cv.notify_all()
        for loop, event in self._waiters:
            loop.call_soon_threadsafe(event.set)
