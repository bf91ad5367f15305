"""Replay requests against a server through the official ``openai`` client and time every token.

``replay(url, model, requests)`` sends each ``LoadRequest`` at its arrival offset (seconds after
the start) as a streaming completion and measures, per request, the client-side TTFT, TPOT
(mean gap between output tokens after the first) and end-to-end latency. ``summarize`` turns the
results into the simulator's summary shape (``ttft_s`` / ``tpot_s`` / ``e2e_s`` with mean and
percentiles), so measured and simulated figures print side by side.

Prompts are token-id lists, so the server sees exactly the lengths of the trace. hetserve streams
one chunk per token — an empty one while the token's text is held back (a partial UTF-8
character, common with a random-weight byte-level model) — so the first chunk is the first token,
not the first printable text; usage (``include_usage``) gives the exact token count, and TPOT uses
it: (last chunk - first chunk) / (tokens - 1).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from hetserve.serve.server import KEEP_ALIVE_S
from hetserve.sim.metrics import latency_stats


@dataclass(frozen=True)
class LoadRequest:
    arrival_s: float
    prompt: list[int] | str
    max_tokens: int


@dataclass(frozen=True)
class LoadResult:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    ttft_s: float
    tpot_s: float | None  # None with fewer than two output tokens
    e2e_s: float
    error: str | None = None


def requests_from_workload(workload, n: int, vocab_low: int = 32, vocab_high: int = 127, max_input: int | None = None,
                           max_output: int | None = None, seed: int = 0, start: int = 0) -> list[LoadRequest]:
    """The first ``n`` requests of a ``Workload`` (from ``start``) as token-id prompts of the trace's
    lengths (printable byte ids by default), arrivals relative to the first."""
    rng = np.random.default_rng(seed)
    out = []
    arr = np.asarray(workload.arrival_s[start:start + n], float)
    inp = np.asarray(workload.input_tokens[start:start + n])
    outp = np.asarray(workload.output_tokens[start:start + n])
    for a, i, o in zip(arr - arr[0], inp, outp):
        i = int(min(i, max_input)) if max_input else int(i)
        o = int(min(o, max_output)) if max_output else int(o)
        out.append(LoadRequest(float(a), rng.integers(vocab_low, vocab_high, size=max(1, i)).tolist(), max(1, o)))
    return out


async def _one(client, model: str, req: LoadRequest, t0: float, temperature: float,
               ignore_eos: bool = False) -> LoadResult:
    await asyncio.sleep(max(0.0, t0 + req.arrival_s - time.monotonic()))
    sent = time.monotonic()
    first = last = None
    usage = None
    n_prompt = len(req.prompt) if isinstance(req.prompt, list) else 0
    try:
        stream = await client.completions.create(model=model, prompt=req.prompt, max_tokens=req.max_tokens,
                                                 temperature=temperature, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True} if ignore_eos else None)
        async for chunk in stream:
            now = time.monotonic()
            if chunk.choices and chunk.choices[0].finish_reason is None:  # one chunk per token, even a
                if first is None:  # token whose text is held back (partial character: empty text)
                    first = now
                last = now
            if chunk.usage is not None:
                usage = chunk.usage
                if first is None:  # text held back (partial characters): count the usage chunk
                    first = last = now
    except Exception as exc:  # noqa: BLE001 - one failed request is a result, not the end of the run
        end = time.monotonic()
        return LoadResult(req.arrival_s, n_prompt, 0, end - sent, None, end - sent, repr(exc))
    end = time.monotonic()
    n_out = usage.completion_tokens if usage else 0
    n_prompt = usage.prompt_tokens if usage else n_prompt
    first = first if first is not None else end
    last = last if last is not None else end
    tpot = (last - first) / (n_out - 1) if n_out > 1 else None
    return LoadResult(req.arrival_s, n_prompt, n_out, first - sent, tpot, end - sent)


async def replay_async(url: str, model: str, requests: Sequence[LoadRequest], temperature: float = 0.0,
                       timeout_s: float = 600.0, ignore_eos: bool = False) -> list[LoadResult]:
    import httpx
    import openai

    client = openai.AsyncOpenAI(base_url=url.rstrip("/") + "/v1", api_key="hetserve", max_retries=0,
                                timeout=timeout_s,
                                http_client=openai.DefaultAsyncHttpxClient(
                                    # an idle connection is dropped well before the server's
                                    # keep-alive ends, never as the server closes it (server.KEEP_ALIVE_S)
                                    limits=httpx.Limits(max_connections=max(16, len(requests) + 4),
                                                        keepalive_expiry=min(5.0, KEEP_ALIVE_S / 2)),
                                    trust_env=False))
    try:
        t0 = time.monotonic()
        return list(await asyncio.gather(*(_one(client, model, r, t0, temperature, ignore_eos) for r in requests)))
    finally:
        await client.close()


def replay(url: str, model: str, requests: Sequence[LoadRequest], temperature: float = 0.0,
           timeout_s: float = 600.0, ignore_eos: bool = False) -> list[LoadResult]:
    """Send ``requests`` at their arrival offsets; returns one result per request, in order.
    ``ignore_eos``: every request generates exactly ``max_tokens`` (a trace's output length)."""
    return asyncio.run(replay_async(url, model, requests, temperature, timeout_s, ignore_eos))


def summarize(results: Sequence[LoadResult], duration_s: float | None = None) -> dict:
    """The simulator's summary shape (docs/design.md) for measured results."""
    ok = [r for r in results if r.error is None]
    if duration_s is None:
        duration_s = max((r.arrival_s + r.e2e_s for r in ok), default=0.0)
    tokens = sum(r.output_tokens for r in ok)
    return {
        "requests": len(results), "completed": len(ok), "duration_s": duration_s,
        "throughput_tokens_per_s": tokens / duration_s if duration_s > 0 else 0.0,
        "ttft_s": latency_stats([r.ttft_s for r in ok]),
        "tpot_s": latency_stats([r.tpot_s for r in ok if r.tpot_s is not None]),
        "e2e_s": latency_stats([r.e2e_s for r in ok]),
        "errors": sorted({r.error for r in results if r.error})[:5],
    }
