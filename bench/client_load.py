"""A burst of streaming completions against any OpenAI-compatible server, timed at the client.

    summary = run_load("http://127.0.0.1:8000", "m", prompts, max_tokens=128, concurrency=32)

Every prompt (a token-id list) is sent at once (up to ``concurrency`` in flight) to
``/v1/completions`` with ``stream``, ``ignore_eos`` and ``min_tokens = max_tokens`` (vLLM's
extensions, which hetserve honours), so every request produces exactly ``max_tokens`` tokens on
either server. A token's time is the arrival of its server-sent event: both servers send one event
per token (an empty text while a partial UTF-8 character is held back); the final usage event gives
the exact count. httpx, not the openai client: its per-chunk parsing costs the client CPU the
servers need on a small machine.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import httpx


@dataclass(frozen=True)
class LoadSummary:
    requests: int
    errors: int
    output_tokens: int
    makespan_s: float  # first send to last token
    tokens_per_s: float
    ttft_mean_s: float
    ttft_p90_s: float
    tpot_mean_s: float  # per request (last - first token) / (tokens - 1), averaged
    first_error: str | None = None


async def _one(client: httpx.AsyncClient, url: str, body: dict, t0: float) -> tuple[list[float], int, str | None]:
    times: list[float] = []
    tokens = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            return times, 0, f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return times, tokens, str(event["error"])[:200]
            if event.get("choices"):
                times.append(time.perf_counter() - t0)
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return times, tokens, None


async def _burst(url: str, model: str, prompts: list[list[int]], max_tokens: int, concurrency: int):
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        t0 = time.perf_counter()
        bodies = [{"model": model, "prompt": p, "max_tokens": max_tokens, "min_tokens": max_tokens,
                   "ignore_eos": True, "temperature": 0.0, "stream": True,
                   "stream_options": {"include_usage": True}} for p in prompts]
        results = await asyncio.gather(*(_one(client, url, b, t0) for b in bodies), return_exceptions=True)
    return results


def run_load(url: str, model: str, prompts: list[list[int]], max_tokens: int, concurrency: int) -> LoadSummary:
    results = asyncio.run(_burst(url, model, prompts, max_tokens, concurrency))
    ok, errors = [], []
    for r in results:
        if isinstance(r, BaseException):
            errors.append(f"{type(r).__name__}: {r}")
        elif r[2] is not None or not r[0]:
            errors.append(r[2] or "no token")
        else:
            ok.append(r)
    if not ok:
        return LoadSummary(len(prompts), len(errors), 0, float("nan"), 0.0, float("nan"), float("nan"), float("nan"),
                           errors[0] if errors else None)
    ttfts = sorted(times[0] for times, _, _ in ok)
    tpots = [(times[-1] - times[0]) / (n - 1) for times, n, _ in ok if n > 1]
    tokens = sum(n for _, n, _ in ok)
    makespan = max(times[-1] for times, _, _ in ok)
    return LoadSummary(len(prompts), len(errors), tokens, makespan, tokens / makespan, sum(ttfts) / len(ttfts),
                       ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))],
                       sum(tpots) / len(tpots) if tpots else float("nan"), errors[0] if errors else None)
