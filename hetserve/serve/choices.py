"""Running the choices of one HTTP request and writing their logprobs in OpenAI's shapes.

A request with ``n`` choices per prompt and several prompts becomes one ``Prepared`` request per
choice (its ``index``: prompt number × n + choice number, as OpenAI and vLLM order them), run side by
side. ``collect`` runs them to the end, cancelling all if the client goes away; ``sse`` streams them
as one event stream, each chunk naming its choice, and cancels what is left when the client goes.

Logprobs shapes:

- completions (``logprobs: N``): ``{"tokens": [text], "token_logprobs": [lp], "top_logprobs":
  [{text: lp}], "text_offset": [chars]}``; the top map holds the N most likely tokens and the
  chosen one (so up to N + 1 entries, as OpenAI says). With ``echo`` the prompt's tokens come first,
  the first with ``null`` logprob and ``null`` top map;
- chat (``logprobs: true, top_logprobs: N``): ``{"content": [{"token", "logprob", "bytes",
  "top_logprobs": [{"token", "logprob", "bytes"}]}]}``.

A token's text is what the tokenizer decodes it to alone (a piece of a multi-byte character shows
as U+FFFD, as in vLLM); a chat entry's ``bytes`` are the token's own bytes (``Codec.token_bytes``),
so the pieces of a character split over tokens join back into it, as OpenAI defines them.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable, Sequence

from fastapi.responses import StreamingResponse

from hetserve.serve.coordinator import Coordinator, Prepared
from hetserve.serve.errors import STREAM_END, error_event
from hetserve.serve.line_ends import escape_text

_DISCONNECT_POLL_S = 0.25

# A stream that has written nothing for this long writes an SSE comment line (KEEPALIVE), which SSE
# clients and the OpenAI SDK skip: a request held for a re-plan's replicas waits up to ~2 minutes
# with no token, and a client or proxy with a shorter read timeout would give up on it meanwhile.
KEEPALIVE_S = 15.0
KEEPALIVE = ": keep-alive\n\n"

# (token id, logprob or None, [(id, logprob)] or None)
Entry = tuple


def share_prompts(reqs: list[Prepared], n: int) -> None:
    """The choices of one prompt (``n`` consecutive requests) share the first one's prompt KV."""
    for i, req in enumerate(reqs):
        if i % n:
            req.share_with = reqs[i - i % n].request_id


def prompt_entries(ids: Sequence[int], prompt_logprobs: list | None) -> list[Entry]:
    """The prompt's tokens as logprob entries: the first has none, the rest the engine's."""
    out: list[Entry] = [(int(ids[0]), None, None)]
    for tok, (lp, top) in zip(ids[1:], prompt_logprobs or ()):
        out.append((int(tok), lp, top))
    return out


class LogprobWriter:
    """Writes entries in one request's format; ``offset`` keeps completions' ``text_offset`` running
    across stream chunks."""

    def __init__(self, codec, offset: int = 0):
        self.codec, self.offset = codec, offset

    def text(self, token: int) -> str:
        return self.codec.decode([token])

    def completions(self, entries: list[Entry]) -> dict:
        tokens, lps, tops, offsets = [], [], [], []
        for tok, lp, top in entries:
            t = self.text(tok)
            tokens.append(t)
            lps.append(lp)
            offsets.append(self.offset)
            self.offset += len(t)
            if top is None:
                tops.append(None)
            else:
                m = {self.text(i): v for i, v in top}
                m.setdefault(t, lp)  # the chosen token is always there
                tops.append(m)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    def chat(self, entries: list[Entry]) -> dict:
        def one(tok: int, lp: float) -> dict:
            t = self.text(tok)
            return {"token": t, "logprob": lp, "bytes": list(self.codec.token_bytes(tok))}

        return {"content": [{**one(tok, lp), "top_logprobs": [one(i, v) for i, v in top or ()]}
                            for tok, lp, top in entries]}


async def collect(c: Coordinator, reqs: list[Prepared], request) -> None:
    """Run every request to its end; if the client goes away first, cancel them all (which aborts
    them in the engine). An error in one cancels the others and is raised."""

    async def drain(req: Prepared) -> None:
        async for _ in c.run(req):
            pass

    tasks = [asyncio.ensure_future(drain(r)) for r in reqs]
    try:
        pending = set(tasks)
        while pending:
            done, pending = await asyncio.wait(pending, timeout=_DISCONNECT_POLL_S,
                                               return_when=asyncio.FIRST_EXCEPTION)
            for t in done:
                t.result()  # raises the first failure
            if pending and await request.is_disconnected():
                return  # nobody to answer; the finally cancels what is left
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def sse_event(data: str) -> str:
    """One SSE event of JSON ``data``, each line end a line-splitting client might see escaped (``line_ends``)."""
    return f"data: {escape_text(data)}\n\n"


def sse(c: Coordinator, reqs: list[Prepared], first: Callable[[Prepared], list[str]],
        chunk: Callable[[Prepared, str | None, str | None], str], usage_chunk: Callable[[], str] | None):
    """One SSE stream over ``reqs``: ``first(req)`` events of each choice, then a chunk per token as
    it comes (``chunk(req, text, None)``), a finish chunk per choice (``chunk(req, None, reason)``),
    the usage chunk, ``[DONE]``. A failure after the headers ends the stream with one error event.
    While no choice has anything to send, a ``KEEPALIVE`` comment goes out every ``KEEPALIVE_S``."""

    async def events() -> AsyncIterator[str]:
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(req: Prepared) -> None:
            try:
                async for delta in c.run(req):
                    await queue.put((req, delta, None))
                await queue.put((req, None, "done"))
            except Exception as exc:  # noqa: BLE001 - handed to the stream, which reports it in-band
                await queue.put((req, None, exc))

        tasks: list[asyncio.Task] = []
        try:
            for req in reqs:
                for event in first(req):
                    yield sse_event(event)
            tasks = [asyncio.ensure_future(pump(r)) for r in reqs]
            left = len(reqs)
            while left:
                try:  # events go out whole (one yield each), so a comment falls between two of them
                    async with asyncio.timeout(KEEPALIVE_S):
                        req, delta, end = await queue.get()
                except TimeoutError:
                    yield KEEPALIVE
                    continue
                if end is None:
                    yield sse_event(chunk(req, delta, None))
                elif end == "done":
                    left -= 1
                    yield sse_event(chunk(req, None, req.finish_reason))
                else:
                    raise end
            if usage_chunk is not None:
                yield sse_event(usage_chunk())
        except Exception as exc:  # noqa: BLE001 - headers are out: report in-band, then end the stream
            yield error_event(exc)
        finally:
            for t in tasks:
                if not t.done():
                    t.cancel()
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
        yield STREAM_END

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
