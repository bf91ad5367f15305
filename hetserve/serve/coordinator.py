"""The coordinator's request path, below HTTP: check, place, generate, detokenize, account.

``Coordinator.prepare`` turns a prompt and the request's limits into a ``Prepared`` request or
raises the ``APIError`` a client should see (no state changes: "can I?" before "do it").
``Coordinator.run`` places it with the placement policy (the same classes the simulator drives,
from ``hetserve.policies.placement``), streams text deltas, and always leaves the engine clean:
a request that ends for any reason other than the engine finishing it — a stop string, a client
that went away, an error — is aborted in the engine, which frees its slot and KV.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Sequence

from hetserve.planner.plan import serves_decode, serves_prefill
from hetserve.policies.base import PlacementPolicy, ReplicaState, RequestInfo
from hetserve.runtime.params import SamplingParams
from hetserve.serve.backend import Backend
from hetserve.policies.request_checks import RequestRefused, able_to_hold, check_prompt_ids, check_request
from hetserve.serve.errors import InvalidRequest, ServerError, refusal
from hetserve.serve.metrics import ServerMetrics
from hetserve.serve.shutdown import drain, wait_answered
from hetserve.serve.text import Codec, TextStream


@dataclass
class Prepared:
    """A checked request, ready to run. ``result`` fields fill in as it runs."""

    request_id: str
    seq: int  # integer id for the policies
    prompt_ids: list[int]
    params: SamplingParams
    stop: tuple[str, ...]
    endpoint: str
    arrival: float = field(default_factory=time.monotonic)
    replica: str | None = None
    completion_tokens: int = 0
    finish_reason: str | None = None
    text: str = ""
    ttft_s: float | None = None
    index: int = 0  # the choice it answers (prompt number x n + choice number)
    score_only: bool = False  # echo with max_tokens 0: the prompt's logprobs, no completion
    # (token id, logprob, [(id, logprob)] alternatives) per completion token shown, when asked
    logprobs: list[tuple] = field(default_factory=list)
    prompt_logprobs: list[tuple] | None = None  # (logprob, alternatives) per prompt token after the first
    share_with: str | None = None  # request id of the first choice of the same prompt (its KV is shared)

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)


class Coordinator:
    """Owns the backend, the tokenizer, the placement policy and the metrics of one server."""

    def __init__(self, backend: Backend, codec: Codec, model_name: str,
                 placement: PlacementPolicy | None = None, predictor=None,
                 clock=time.monotonic):
        self.backend, self.codec, self.model_name = backend, codec, model_name
        self.placement, self.predictor, self.clock = placement, predictor, clock
        self.metrics = ServerMetrics(lambda: (self._safe_replicas(), self._scrape("link_stats", list)),
                                     lambda: self._scrape("refused_connections"), lambda: self._scrape("channel_stats"),
                                     lambda: self._scrape("worker_load_seconds"),
                                     self._faults)
        self._seq = itertools.count(1)
        self.in_flight = 0
        self.draining = False  # set by a graceful shutdown: no new request is admitted
        self.replanner = None  # serve/replan.py Replanner where the backend can re-plan (POST /admin/replan)
        self.admin_replan = False  # POST /admin/replan is reachable (an admin key is configured)

    # ------------------------------------------------------------------ snapshots
    def _scrape(self, method: str, empty: type = dict):
        """``backend.method()`` as an ``empty``-typed copy; empty where the backend has no such method
        (no device channels, no worker processes) or fails: a scrape must not fail because the engine
        is busy or gone."""
        try:
            return empty(getattr(self.backend, method, empty)())
        except Exception:  # noqa: BLE001
            return empty()

    def _faults(self) -> tuple[int, dict[tuple[str, str], int]]:
        """Worker deaths and re-plans by (trigger, outcome), for /metrics (none where nothing re-plans)."""
        return self._scrape("worker_deaths", int), dict(getattr(self.replanner, "counts", None) or {})

    def _safe_replicas(self) -> list[ReplicaState]:
        return self._scrape("replicas", list)

    def health(self) -> tuple[str, list[dict]]:
        """("ok" | "degraded" | "unavailable" | "draining", one entry per replica with its liveness).

        Degraded: some replica is down, or the re-plans run without lost devices (``lost_devices``),
        but the live ones can still serve (prefill and decode); unavailable: they cannot, or the engine
        says it is broken."""
        reps = self._safe_replicas()
        live = [r for r in reps if r.alive]
        can_serve = (any(serves_prefill(r.role) for r in live) and any(r.role != "prefill" for r in live)
                     and not self._broken())
        status = ("draining" if self.draining else "unavailable" if not can_serve
                  else "degraded" if len(live) < len(reps) or self.lost_devices() else "ok")
        return status, [{"id": r.id, "role": r.role, "alive": r.alive} for r in reps]

    def _broken(self) -> str | None:
        """Why the engine refuses every request, where its backend says (``Backend.broken``), or None."""
        return getattr(self.backend, "broken", None)

    def lost_devices(self) -> list[str]:
        """Devices the re-plans leave out, their workers dead or an operator's ``lost`` (``serve/replan.py``),
        until returned."""
        return [] if self.replanner is None else sorted(self.replanner.lost)

    def unavailable(self) -> str | None:
        """Why no request can be served now (no live replica can prefill and decode), or None. A
        backend that is bringing replicas up (a re-plan) queues requests instead: None."""
        if getattr(self.backend, "replanning", False):
            return None
        broken = self._broken()
        if not broken:
            status, reps = self.health()
            if status != "unavailable" or not reps:
                return None  # no replica listed and nothing broken: a failed scrape, not an outage
        # nothing comes back on its own here (an on-failure re-plan holds requests instead: above)
        how = ("an operator re-plans onto returned devices (POST /admin/replan, with the server's admin key) "
               "or restarts the server" if self.comes_back() else "the server is restarted")
        what = (f"the engine cannot serve: {broken}" if broken
                else "no live replica can serve this request (every replica lost a worker)")
        return f"{what}; it serves again once {how}"

    def usable_context(self, pools: list[tuple[str, float]] | None = None) -> int:
        """The most tokens (prompt + completion) one request can use: the model's context, capped by the
        largest KV pool of a live replica that decodes (where prompt and completion are held together).
        The context alone where no pool is known (every replica down: nothing serves). ``pools``: the
        caller's ``kv_pools()``, where it holds them already."""
        decoding = [tokens for role, tokens in (self.kv_pools() if pools is None else pools) if serves_decode(role)]
        return min(self.max_context, int(max(decoding))) if decoding else self.max_context

    def comes_back(self) -> bool:
        """Whether a server with no live replica can serve again without a restart: an operator's
        re-plan (POST /admin/replan) is reachable."""
        return self.replanner is not None and self.admin_replan

    @property
    def max_context(self) -> int:
        return int(self.backend.max_context)

    def kv_pools(self) -> list[tuple[str, float]]:
        """(role, KV pool in tokens) of the live replicas, those the engine checks a request against
        (none while every replica is down: then the request is refused as unavailable, or waits
        for a re-plan)."""
        return [(r.role, r.kv_capacity_tokens) for r in self._safe_replicas() if r.alive and r.kv_capacity_tokens]

    # ------------------------------------------------------------------ can I?
    def tokenize(self, prompt: str | Sequence[int], prompt_param: str = "prompt") -> list[int]:
        """The prompt's token ids: text through the codec, ids checked against the vocabulary; raises
        ``InvalidRequest``. Reads no state but the codec's, so the server may call it on a worker thread
        (a prompt of megabytes takes seconds; ``hetserve.serve.app._tokenize``). O(prompt length)."""
        ids = self.codec.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        vocab = getattr(self.backend, "vocab_size", None)
        try:
            check_prompt_ids(ids, vocab)
        except RequestRefused as exc:
            raise refusal(exc, prompt_param) from exc
        return ids

    def prepare(self, endpoint: str, ids: list[int], *, max_tokens: int | None,
                default_max_tokens: int | None, temperature: float, top_p: float, seed: int | None,
                stop: Sequence[str], prompt_param: str = "prompt", ignore_eos: bool = False,
                min_tokens: int = 0, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                repetition_penalty: float = 1.0, logprobs: int | None = None, prompt_logprobs: int | None = None,
                index: int = 0) -> Prepared:
        """Check a request whose prompt ``tokenize`` gave as ``ids``; raises ``InvalidRequest`` /
        ``ContextLengthExceeded`` for what the engine would refuse (``policies.request_checks``, the
        engine's and the simulator's rules: the context, then the KV pools).

        ``max_tokens`` None takes ``default_max_tokens``, or (if that is None too) the room
        ``usable_context`` leaves. ``max_tokens`` 0 scores the prompt only: the engine runs its prefill
        and one token (which nobody sees), so ``prompt_logprobs`` come back with no completion.
        """
        score_only = max_tokens == 0
        if score_only:
            max_tokens, ignore_eos, min_tokens = 1, True, 0
        pools = self.kv_pools()
        if max_tokens is None:
            room = max(1, self.usable_context(pools) - len(ids))
            max_tokens = min(default_max_tokens, room) if default_max_tokens is not None else room
        try:
            check_request(len(ids), max_tokens, self.max_context, pools, getattr(self.backend, "block_size", 1),
                          kv=bool(pools))
        except RequestRefused as exc:
            raise refusal(exc, prompt_param) from exc
        if min_tokens > max_tokens:
            raise InvalidRequest(f"min_tokens: must be at most max_tokens ({max_tokens}), got {min_tokens}",
                                 param="min_tokens")
        eos = self.codec.eos_token_id
        try:
            params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed,
                                    stop_token_ids=(eos,) if eos is not None and not ignore_eos else (),
                                    ignore_eos=ignore_eos, min_tokens=min_tokens,
                                    presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                                    repetition_penalty=repetition_penalty,
                                    logprobs=None if score_only else logprobs, prompt_logprobs=prompt_logprobs)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from exc
        seq = next(self._seq)
        return Prepared(f"req-{seq}", seq, ids, params, tuple(stop), endpoint, arrival=self.clock(), index=index,
                        score_only=score_only)

    # ------------------------------------------------------------------ do it
    def place(self, req: Prepared) -> str | None:
        """The replica for ``req`` by the placement policy (None: the backend decides)."""
        if self.placement is None:
            return None
        cands = able_to_hold([r for r in self._safe_replicas() if serves_prefill(r.role) and r.alive],
                             req.prompt_tokens, req.params.max_tokens, getattr(self.backend, "block_size", 1))
        if len(cands) <= 1:
            return cands[0].id if cands else None
        predicted = float(req.params.max_tokens)
        if self.predictor is not None:
            predicted = min(predicted, float(self.predictor.predict(req.seq, req.prompt_tokens, 0)))
        info = RequestInfo(req.seq, req.arrival, req.prompt_tokens, predicted)
        return self.placement.choose(info, cands, self.clock())

    async def run(self, req: Prepared) -> AsyncIterator[str]:
        """Yield text deltas; on return ``req`` holds finish_reason, counts and the full text."""
        stream = TextStream(self.codec, req.stop)
        stop_ids = set(req.params.stop_token_ids)
        engine_done = False
        self.in_flight += 1
        self.metrics.in_flight.inc()
        self.metrics.prompt_tokens.inc(req.prompt_tokens)
        outcome = "error"
        try:
            req.replica = self.place(req)
            gen = (self.backend.generate(req.request_id, req.prompt_ids, req.params, req.replica,
                                         share_with=req.share_with) if req.share_with else
                   self.backend.generate(req.request_id, req.prompt_ids, req.params, req.replica))
            try:
                async for token in gen:
                    if req.prompt_logprobs is None:
                        req.prompt_logprobs = getattr(token, "prompt_logprobs", None)
                    if req.finish_reason is not None:
                        break  # the engine went past a stop token or max_tokens: stop it here
                    if req.score_only:  # the one token run for the prompt's logprobs is nobody's completion
                        req.finish_reason = "length"
                        continue
                    req.completion_tokens += 1
                    may_stop = req.completion_tokens >= req.params.min_tokens
                    if token in stop_ids and may_stop:
                        req.finish_reason = "stop"  # the engine ends the request itself
                        continue
                    if req.params.logprobs is not None:
                        req.logprobs.append((int(token), getattr(token, "logprob", None), getattr(token, "top", [])))
                    delta = stream.push(token)
                    if delta:
                        if req.ttft_s is None:  # TTFT as the client sees it: the first text streamed
                            req.ttft_s = self.clock() - req.arrival
                        req.text += delta
                        yield delta
                    else:  # its text is held back (a partial character): the client still sees it arrive
                        yield ""
                    if stream.stopped:  # a stop string: the engine does not know, so abort it
                        req.finish_reason = "stop"
                        break
                    if req.completion_tokens >= req.params.max_tokens:
                        req.finish_reason = "length"
                else:
                    engine_done = True
                    if req.completion_tokens == 0 and not req.score_only:
                        raise ServerError("the engine finished the request without producing a token")
                    req.finish_reason = req.finish_reason or (
                        "length" if req.completion_tokens >= req.params.max_tokens else "stop")
            finally:
                if not engine_done:
                    self.backend.abort(req.request_id)  # sync: safe inside a cancelled task
                await _close(gen)
            tail = stream.finish()
            if stream.stopped and not req.score_only:  # a stop string seen only in the text held back to the end
                req.finish_reason = "stop"
            if req.ttft_s is None and (tail or req.completion_tokens):  # text held back to the end
                req.ttft_s = self.clock() - req.arrival
            if tail:
                req.text += tail
                yield tail
            outcome = req.finish_reason or "stop"
        except GeneratorExit:
            outcome = "aborted"
            raise
        except BaseException as exc:
            outcome = "aborted" if _is_cancel(exc) else "error"
            raise
        finally:
            self.in_flight -= 1
            self.metrics.in_flight.dec()
            self.metrics.requests.labels(req.endpoint, outcome).inc()
            self.metrics.generation_tokens.inc(req.completion_tokens)  # an aborted stream's tokens were made too
            if self.placement is not None and req.replica is not None:
                self.placement.on_finish(req.seq, req.prompt_tokens, req.completion_tokens)
            if outcome in ("stop", "length"):
                self.metrics.observe(req.ttft_s, self.clock() - req.arrival, req.completion_tokens)
                if self.predictor is not None:  # learn lengths only from requests that ran to their end
                    self.predictor.observe(req.seq, req.prompt_tokens, req.completion_tokens)

    async def drain(self, timeout_s: float, poll_s: float = 0.05) -> int:
        """Graceful shutdown: admit nothing new, let requests in flight finish for up to ``timeout_s``,
        then end those left with one clear error (their streams get an error event and ``[DONE]``).
        Returns how many had to be cut. A failed re-plan is not tried again from now on."""
        self._stop_replan_retries()
        return await drain(self, timeout_s, self.clock, poll_s)

    async def end_now(self, reason: str, grace_s: float = 5.0, poll_s: float = 0.05) -> None:
        """Admit nothing new and end every request in flight with ``reason`` (the backend fails what it
        holds), then wait up to ``grace_s`` for their streams to write the error event and [DONE]."""
        self.draining = True
        self._stop_replan_retries()
        fail_all = getattr(self.backend, "fail_all", None)
        if fail_all is not None:
            fail_all(reason)
        await wait_answered(self, grace_s, self.clock, poll_s)

    def _stop_replan_retries(self) -> None:
        # a retried re-plan's new workers would start only for the shutdown to stop them
        stop = getattr(self.replanner, "stop_retries", None)
        if stop is not None:
            stop()

    def reject(self, endpoint: str, outcome: str = "rejected") -> None:
        self.metrics.requests.labels(endpoint, outcome).inc()


def _is_cancel(exc: BaseException) -> bool:
    import asyncio

    return isinstance(exc, (asyncio.CancelledError, GeneratorExit))


async def _close(gen) -> None:
    aclose = getattr(gen, "aclose", None)
    if aclose is None:
        return
    try:
        await aclose()
    except BaseException:  # noqa: BLE001 - closing a generator in a cancelled task may raise; nothing to save
        pass
